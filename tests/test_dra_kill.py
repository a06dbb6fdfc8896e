"""`gpud dra-plugin` killed (SIGKILL) in the middle of Prepare and of Unprepare, at the step where it waits
for gpud (held there by stopping gpud with SIGSTOP: the plugin has written its record and asked gpud to
hold or release the devices), then started again: the kubelet's retry converges, with the plugin's
checkpoint, the claim's CDI spec and gpud's holds agreeing. tests/test_dra_prepare.py covers every other
state a kill can leave the files in; this is the real process, killed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import GpudProcess, until
from kube_api_stand_in import KubeApiStandIn
from kube_manifests import dra_rbac_rules
from kubelet_dra_stand_in import DraKubelet, KubeletDraError
from test_dra_plugin import DRIVER, GPU_CLASS, NODE, PluginProcess, whole_pool

from gpud.dra.claim_cdi import spec_path

pytestmark = pytest.mark.slow


@pytest.fixture
def parts(short_tmp, request):
    """gpud.yaml takes request.param's lines too (a test's own settings)."""
    for sub in ("kubelet", "cdi"):
        (short_tmp / sub).mkdir()
    (short_tmp / "gpud.yaml").write_text(f"mig:\n  layouts_file: {short_tmp / 'absent.yaml'}\n"
                                         f"{getattr(request, 'param', '')}")
    gpud = GpudProcess(short_tmp, "--simulate", "hgx-a100-4gpu", "--sim-state", str(short_tmp / "sim.json"),
                       "--config", str(short_tmp / "gpud.yaml"))
    gpud.wait_healthy()
    kube = KubeApiStandIn(server_version="1.36")
    kube.create_node(NODE)
    kube.bind_rbac("dra", dra_rbac_rules())
    kubelet = DraKubelet(short_tmp / "kubelet", NODE, wipe=kube.wipe_resource_slices).start()
    started: list[PluginProcess] = []

    def plugin() -> PluginProcess:
        since = time.monotonic()
        started.append(PluginProcess(short_tmp, kube, gpud.socket))
        until(lambda: kubelet.connected(DRIVER, since), 20, "the plugin registered")
        until(lambda: whole_pool(kube.resource_slices(NODE, DRIVER)), 20, "the plugin's slices")
        return started[-1]

    try:
        yield short_tmp, gpud, kube, kubelet, plugin
    finally:
        os.kill(gpud.proc.pid, signal.SIGCONT)
        for process in started:
            process.stop()
        kubelet.stop()
        gpud.stop()
        kube.stop()


def _checkpoint(tmp: Path) -> dict:
    path = tmp / "kubelet" / "plugins" / DRIVER / "gpud-checkpoint.json"
    return json.loads(path.read_text())["claims"] if path.exists() else {}


def _in_background(call, *args) -> dict:
    """call(*args) on a thread of its own (the kubelet's call waits for the plugin); what it raised or gave."""
    outcome: dict = {}

    def run():
        try:
            outcome["answer"] = call(*args)
        except KubeletDraError as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    outcome["thread"] = thread
    return outcome


def _killed_while_gpud_waits(gpud, plugin, call, claim, reached, what: str) -> None:
    """gpud stopped (SIGSTOP), the kubelet's call of claim made on a thread; once reached() (the plugin has
    written its step and waits for gpud) the plugin is SIGKILLed and gpud goes on: the kubelet's call fails."""
    os.kill(gpud.proc.pid, signal.SIGSTOP)
    pending = _in_background(call, [claim])
    until(reached, 20, what)
    plugin.stop(signal.SIGKILL)
    os.kill(gpud.proc.pid, signal.SIGCONT)
    pending["thread"].join(50)
    assert "error" in pending  # the kubelet's call failed with the plugin: the pod does not start (or end) yet


def test_killed_waiting_for_gpud_in_prepare_then_in_unprepare_converges(parts):
    tmp, gpud, kube, kubelet, start_plugin = parts
    plugin = start_plugin()
    created = kube.create_resource_claim("default", "c", [GPU_CLASS], [
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1"}], node=NODE)
    claim = ("default", "c", created["metadata"]["uid"])

    # the plugin's hold waits for gpud
    _killed_while_gpud_waits(gpud, plugin, kubelet.prepare, claim,
                             lambda: _checkpoint(tmp).get(claim[2], {}).get("state") == "preparing", "the claim recorded")
    assert not spec_path(tmp / "cdi", DRIVER, claim[2]).exists()

    plugin = start_plugin()
    kubelet.prepare([claim])  # the kubelet retries
    assert _checkpoint(tmp)[claim[2]]["state"] == "prepared" and spec_path(tmp / "cdi", DRIVER, claim[2]).exists()
    holds = gpud.client.get("/v1/claims")["claims"]
    assert [(c["uid"], [d["gpu_index"] for d in c["devices"]]) for c in holds] == [(claim[2], [1])]

    # now its release waits for gpud
    _killed_while_gpud_waits(gpud, plugin, kubelet.unprepare, claim,
                             lambda: not spec_path(tmp / "cdi", DRIVER, claim[2]).exists(), "the spec removed")
    assert claim[2] in _checkpoint(tmp)  # still recorded: the release never finished

    start_plugin()
    kubelet.unprepare([claim])  # retried: the release finishes
    assert _checkpoint(tmp) == {} and gpud.client.get("/v1/claims")["claims"] == []
    assert not spec_path(tmp / "cdi", DRIVER, claim[2]).exists()


def _migs(gpud, index: int) -> list[tuple[str, str, int]]:
    gpu = gpud.client.get("/v1/gpus")["gpus"][index]
    return [(m["uuid"], m["profile"], m["placement"]["start"]) for m in gpu["mig"]["devices"]]


@pytest.mark.parametrize("parts", ["dra:\n  dynamic_mig_gpus: [1]\n"], indirect=True)
def test_killed_while_gpud_makes_and_destroys_a_dynamic_mig_device_converges_to_one_device_then_none(parts):
    tmp, gpud, kube, kubelet, start_plugin = parts
    plugin = start_plugin()
    created = kube.create_resource_claim("default", "m", [{"name": "mig", "exactly": {"deviceClassName": "mig.nvidia.com"}}], [
        {"request": "mig", "driver": DRIVER, "pool": NODE, "device": "gpu-1-mig-1g5gb-19-0"}], node=NODE)
    claim = ("default", "m", created["metadata"]["uid"])

    # the plugin asks gpud to make the device, and waits; gpud then makes it for a plugin that is gone
    _killed_while_gpud_waits(gpud, plugin, kubelet.prepare, claim,
                             lambda: _checkpoint(tmp).get(claim[2], {}).get("state") == "preparing", "the claim recorded")

    plugin = start_plugin()
    kubelet.prepare([claim])  # the kubelet retries: the device gpud made is the claim's, not a second one
    (made,) = _migs(gpud, 1)
    assert made[1:] == ("1g.5gb", 0)
    (device,) = _checkpoint(tmp)[claim[2]]["devices"]
    assert _checkpoint(tmp)[claim[2]]["state"] == "prepared" and device["uuid"] == made[0]
    assert [i["uuid"] for i in gpud.client.get("/v1/mig/dynamic")["instances"]] == [made[0]]

    # now the release and the destruction wait for gpud
    _killed_while_gpud_waits(gpud, plugin, kubelet.unprepare, claim,
                             lambda: not spec_path(tmp / "cdi", DRIVER, claim[2]).exists(), "the spec removed")

    start_plugin()
    kubelet.unprepare([claim])
    assert _migs(gpud, 1) == [] and gpud.client.get("/v1/mig/dynamic")["instances"] == []
    assert _checkpoint(tmp) == {}
