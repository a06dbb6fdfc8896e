"""`gpud k8s-agent` end to end: a real agent process, a simulated gpud, and the Kubernetes API stand-in
(tests/kube_api_stand_in.py: as strict as the real API server, each behaviour cited) with the agent's
RBAC exactly as deploy/kubernetes/rbac.yaml grants it.

The label workflows are NVIDIA's GPU operator contracts (docs/kubernetes.md walks them): MIG layouts
from `nvidia.com/mig.config` with mig-manager's `nvidia.com/mig.config.state` values, named sharing
configs from `nvidia.com/device-plugin.config`. Health goes back as the GPUHealthy condition, the
opt-in taint and Events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import REPO, cli, mig_settled, need, start_daemon, stop_daemon, until_async
from kube_api_stand_in import AGENT_USER, ApiError, KubeApiStandIn
from kube_http import node_path
from kube_manifests import agent_rbac_rules, sharing_configs, stand_in_as_deployed

from gpud.config import Config
from gpud.kubernetes.agent import Agent
from gpud.kubernetes.node_api import NodeApi, api_client

NODE = "gpu-node-1"
MIG_LABEL, STATE_LABEL = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
SHARING_LABEL = "nvidia.com/device-plugin.config"
TAINT = {"key": "nvidia.com/gpu.unhealthy", "value": "gpud", "effect": "NoSchedule"}
MIG_SINGLE = "version: v1\nflags:\n  migStrategy: single\n"
MIG_MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"


def configmap_dir(root: Path, files: dict[str, str]) -> Path:
    """A directory laid out as the kubelet mounts a ConfigMap (pkg/volume/util/atomic_writer.go): the
    files in a timestamped directory, `..data` linking to it, and each name linking through `..data`."""
    root.mkdir()
    stamped = root / "..2026_11_26_00_00_00.000000001"
    stamped.mkdir()
    for name, text in files.items():
        (stamped / name).write_text(text)
        (root / name).symlink_to(f"..data/{name}")
    (root / "..data").symlink_to(stamped.name)
    return root


def gpud_config(tmp: Path, preset: str = "dgx-a100", **kubernetes) -> Config:
    configs = configmap_dir(tmp / "sharing-configs", {**sharing_configs(), "mig-single": MIG_SINGLE,
                                                       "mig-mixed": MIG_MIXED})
    config = Config().with_overrides(**{
        "api.socket": str(tmp / "g.sock"), "simulate": preset, "sim_state": str(tmp / "sim.json"),
        "state_dir": str(tmp / "state"), "inventory.refresh_interval_s": 3600.0,
        "mig.layouts_file": str(tmp / "absent.yaml"), "sharing.configs_dir": str(configs),
        "sharing.default_config": "mig-single"})
    for key, value in kubernetes.items():
        config = config.with_overrides(**{f"kubernetes.{key}": value})
    return config


class AgentProcess:
    """`gpud k8s-agent` as a child process, its JSON log lines in a file."""

    def __init__(self, tmp: Path, kube: KubeApiStandIn, socket: Path, node: str = NODE, in_pod: list[str] | None = None,
                 env: dict | None = None):
        """in_pod: a command that runs the agent as in a pod (its service account, no --kubeconfig)."""
        self.log_path = tmp / f"agent-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")
        where = in_pod if in_pod is not None else [sys.executable, "-m", "gpud", "k8s-agent", "--kubeconfig",
                                                   str(kube.kubeconfig("agent"))]
        self.proc = subprocess.Popen(
            [*where, "--node-name", node, "--socket", str(socket), "--log-format", "json", "--log-level", "debug"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "KUBECONFIG": "", **(env or {})})

    def events(self) -> list[dict]:
        if not self._log.closed:
            self._log.flush()
        found = []
        for line in self.log_path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                found.append({"event": "not-json", "line": line})
        return found

    def stop(self) -> int:
        """SIGTERM and its exit status. From a test's event loop, in a thread: the agent's last act is a
        status sent to the gpud that loop serves."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        finally:
            self._log.close()


class LabelRecorder:
    """Every value the Node's state label took, in order, as a watch (the admin's own) saw them."""

    def __init__(self, kube: KubeApiStandIn, label: str = STATE_LABEL):
        self.values: list[str | None] = []
        self._stop = threading.Event()
        http = kube.http("admin")
        version = kube.node(NODE)["metadata"]["resourceVersion"]

        def record() -> None:
            try:
                for event in http.watch("/api/v1/nodes", timeout=60, fieldSelector=f"metadata.name={NODE}",
                                        resourceVersion=version, timeoutSeconds="60"):
                    value = (event["object"]["metadata"].get("labels") or {}).get(label)
                    if not self.values or self.values[-1] != value:
                        self.values.append(value)
                    if self._stop.is_set():
                        return
            except (OSError, AssertionError):
                return

        self._thread = threading.Thread(target=record, daemon=True)
        self._thread.start()


@pytest.fixture
def kube():
    with stand_in_as_deployed(nodes=[NODE]) as api:
        yield api


def state_label(kube) -> str | None:
    return (kube.node(NODE)["metadata"].get("labels") or {}).get(STATE_LABEL)


def events_named(kube, reason: str) -> list[dict]:
    return [e for e in kube.events() if e["reason"] == reason and e["involvedObject"]["name"] == NODE]


def condition(kube) -> dict | None:
    return next((c for c in kube.node(NODE)["status"].get("conditions", []) if c["type"] == "GPUHealthy"), None)


@contextlib.asynccontextmanager
async def agent_against(short_tmp, kube, **kubernetes):
    """A simulated DGX A100 gpud (in-process) and an agent process for it, stopped afterwards."""
    node = await start_daemon(gpud_config(short_tmp, **kubernetes))
    try:
        await mig_settled(node)
        agent = AgentProcess(short_tmp, kube, node.daemon.config.socket_path)
        try:
            yield node, agent
        finally:
            await asyncio.to_thread(agent.stop)  # the loop serves gpud meanwhile: the agent's last status
    finally:
        await stop_daemon(node)


async def test_the_mig_label_applies_the_layout_and_the_state_label_says_how_it_went(short_tmp, kube):
    """mig-manager's contract on 8 A100-40GB: pending while it runs, then success, and the node then
    advertises 56 devices (`nvidia.com/gpu` under the single strategy, `nvidia.com/mig-1g.5gb` under
    mixed, chosen by the sharing label)."""
    async with agent_against(short_tmp, kube) as (node, agent):
        await until_async(lambda: condition(kube), 20, "the agent's first GPUHealthy condition")
        recorder = LabelRecorder(kube)
        kube.label(NODE, MIG_LABEL, "all-1g.5gb")
        await until_async(lambda: state_label(kube) == "success", 60, "mig.config.state success")
        await until_async(lambda: recorder.values[-1:] == ["success"], 10, "the watch seeing success")
        assert [v for v in recorder.values if v is not None] == ["pending", "success"], recorder.values
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] == "all-1g.5gb" and mig["in_sync"] is True
        applied = await until_async(lambda: events_named(kube, "MigConfigApplied"), 10, "the Event")
        assert len(applied) == 1 and "GPUs 0, 1, 2, 3, 4, 5, 6, 7 changed" in applied[0]["message"]
        assert applied[0]["type"] == "Normal" and applied[0]["source"]["component"] == "gpud-k8s-agent"
        _, sharing = await node.get("/v1/sharing")
        assert {r["name"]: r["count"] for r in sharing["resources"]} == {"nvidia.com/gpu": 56}
        kube.label(NODE, SHARING_LABEL, "mig-mixed")
        await until_async(lambda: events_named(kube, "SharingConfigApplied"), 20, "the sharing config applied")
        _, sharing = await node.get("/v1/sharing")
        assert {r["name"]: r["count"] for r in sharing["resources"]} == {"nvidia.com/mig-1g.5gb": 56}
        assert sharing["config"]["name"] == "mig-mixed" and SHARING_LABEL in sharing["config"]["why"]
        assert await asyncio.to_thread(agent.stop) == 0, agent.events()[-5:]


async def test_an_unknown_layout_fails_and_the_event_names_the_layouts_there_are(short_tmp, kube):
    async with agent_against(short_tmp, kube) as (node, agent):
        kube.label(NODE, MIG_LABEL, "all-9g.99gb")
        await until_async(lambda: state_label(kube) == "failed", 30, "mig.config.state failed")
        [failed] = await until_async(lambda: events_named(kube, "MigConfigFailed"), 10, "the Event")
        assert failed["type"] == "Warning" and "all-9g.99gb" in failed["message"]
        assert "all-1g.5gb" in failed["message"] and "all-7g.40gb" in failed["message"]  # what exists
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] is None  # nothing changed
        # no label at all: nothing changes, the state stays as it was written
        kube.label(NODE, MIG_LABEL, None)
        kube.label(NODE, SHARING_LABEL, "tesla-t4")  # something the agent does act on, to know it read on
        await until_async(lambda: events_named(kube, "SharingConfigApplied"), 20, "the agent read the Node on")
        assert state_label(kube) == "failed" and (await node.get("/v1/mig"))[1]["layout"] is None


async def test_busy_mig_devices_keep_the_change_pending_until_their_processes_end(short_tmp, kube):
    async with agent_against(short_tmp, kube) as (node, agent):
        kube.label(NODE, MIG_LABEL, "all-1g.5gb")
        await until_async(lambda: state_label(kube) == "success", 60, "the first layout")
        _, gpu3 = await node.get("/v1/gpus/3")
        for device in gpu3["mig"]["devices"]:
            await node.post("/v1/sim/processes", {"gpu": device["uuid"], "pids": [4242]})
        kube.label(NODE, MIG_LABEL, "all-7g.40gb")
        waiting = await until_async(lambda: events_named(kube, "MigConfigWaiting"), 30, "the waiting Event")
        assert "GPU 3" in waiting[0]["message"] and "4242" in waiting[0]["message"], waiting[0]["message"]
        assert state_label(kube) == "pending"
        _, gpu3_now = await node.get("/v1/gpus/3")
        assert len(gpu3_now["mig"]["devices"]) == 7  # nothing destroyed
        for device in gpu3["mig"]["devices"]:
            await node.post("/v1/sim/processes", {"gpu": device["uuid"], "pids": []})
        await until_async(lambda: state_label(kube) == "success", 60, "success once the processes ended")
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] == "all-7g.40gb" and mig["in_sync"] is True
        assert len(events_named(kube, "MigConfigWaiting")) == 1  # said once, not at every retry


async def test_busy_devices_past_the_timeout_turn_the_state_to_failed(short_tmp, kube):
    async with agent_against(short_tmp, kube, mig_busy_timeout_s=1.0) as (node, agent):
        kube.label(NODE, MIG_LABEL, "all-1g.5gb")
        await until_async(lambda: state_label(kube) == "success", 60, "the first layout")
        _, gpu0 = await node.get("/v1/gpus/0")
        await node.post("/v1/sim/processes", {"gpu": gpu0["mig"]["devices"][0]["uuid"], "pids": [777]})
        kube.label(NODE, MIG_LABEL, "all-7g.40gb")
        await until_async(lambda: state_label(kube) == "failed", 60, "failed after mig_busy_timeout_s")
        [failed] = await until_async(lambda: events_named(kube, "MigConfigFailed"), 10, "the Event")
        assert "777" in failed["message"] and "mig_busy_timeout_s" in failed["message"]
        assert (await node.get("/v1/mig"))[1]["layout"] == "all-1g.5gb"


async def test_a_label_changed_mid_apply_ends_with_the_last_value_and_no_interleaved_applies(short_tmp, kube):
    async with agent_against(short_tmp, kube) as (node, agent):
        await until_async(lambda: condition(kube), 20, "the agent running")
        for value in ("all-1g.5gb", "all-2g.10gb", "all-3g.20gb", "all-7g.40gb"):
            kube.label(NODE, MIG_LABEL, value)
        await until_async(lambda: state_label(kube) == "success" and
                          any("all-7g.40gb" in e["message"] for e in events_named(kube, "MigConfigApplied")),
                          90, "the last value applied")
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] == "all-7g.40gb" and mig["in_sync"] is True
        # gpud refuses an apply while another runs (apply-in-progress): none was refused, none overlapped
        history = mig["history"]
        spans = sorted((h["started_at"], h["finished_at"]) for h in history if h.get("started_at"))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
        assert not any("apply-in-progress" in json.dumps(e) for e in agent.events())


async def test_the_sharing_label_chooses_a_named_config_and_a_missing_name_keeps_the_default(short_tmp, kube):
    async with agent_against(short_tmp, kube) as (node, agent):
        kube.label(NODE, SHARING_LABEL, "2080ti-12gb")
        await until_async(lambda: events_named(kube, "SharingConfigApplied"), 20, "the config applied")
        _, sharing = await node.get("/v1/sharing")
        assert sharing["config"]["name"] == "2080ti-12gb" and sharing["strategy"] == "time-slicing"
        assert {r["name"]: r["count"] for r in sharing["resources"]} == {"nvidia.com/gpu": 48}  # 8 GPUs × 6
        await until_async(lambda: _nfd_product(node, lambda product: product.endswith("-SHARED")), 10,
                          "the -SHARED product label")
        kube.label(NODE, SHARING_LABEL, "no-such-config")
        [missing] = await until_async(lambda: events_named(kube, "SharingConfigNotFound"), 20, "the Event")
        assert missing["type"] == "Warning" and "no-such-config" in missing["message"]
        assert "2080ti-12gb" in missing["message"] and "mig-single" in missing["message"]  # available, default
        _, sharing = await node.get("/v1/sharing")
        assert sharing["config"]["name"] == "mig-single" and sharing["config"]["chosen"] is None


async def test_gpu_health_reaches_the_node_condition_within_two_seconds_and_the_taint_follows(short_tmp, kube):
    async with agent_against(short_tmp, kube, taint_unhealthy=True) as (node, agent):
        healthy = await until_async(lambda: condition(kube), 20, "the first condition")
        assert healthy["status"] == "True" and healthy["reason"] == "AllGPUsHealthy"
        ready = next(c for c in kube.node(NODE)["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True"  # the kubelet's condition is left as it was
        # an operator's own taint of another key stays through everything the agent does
        http = kube.http("admin")
        status, _ = http.patch(node_path(NODE), {"spec": {"taints": [{"key": "maintenance", "effect": "NoSchedule"}]}})
        assert status == 200
        injected = time.monotonic()
        await node.post("/v1/sim/xid", {"gpu": 2, "xid": 79})
        unhealthy = await until_async(lambda: (c := condition(kube)) and c["status"] == "False" and c, 10,
                                      "GPUHealthy False")
        took = time.monotonic() - injected
        assert took < 2.0, f"the condition took {took:.2f} s"
        assert unhealthy["reason"] == "GPUNeedsReboot"
        assert "GPU 2" in unhealthy["message"] and "XID 79" in unhealthy["message"] and "reboot" in unhealthy["message"]
        taints = await until_async(lambda: (t := kube.node(NODE)["spec"].get("taints", [])) and TAINT in t and t, 10,
                                   "the taint")
        assert {"key": "maintenance", "effect": "NoSchedule"} in taints
        await until_async(lambda: events_named(kube, "GPUNeedsReboot") and events_named(kube, "GPUTaintAdded"), 10,
                          "the Events of the condition and the taint")
        gpu2 = (await node.get("/v1/gpus/2"))[1]["uuid"]
        await node.post(f"/v1/health/{gpu2}/clear", {})
        await until_async(lambda: condition(kube)["status"] == "True", 10, "GPUHealthy True again")
        await until_async(lambda: TAINT not in kube.node(NODE)["spec"].get("taints", []), 10, "the taint removed")
        assert kube.node(NODE)["spec"]["taints"] == [{"key": "maintenance", "effect": "NoSchedule"}]
        await until_async(lambda: len(events_named(kube, "GPUsHealthy")) == 2 and events_named(kube, "GPUTaintRemoved"),
                          10, "the Events of the recovery")


async def test_an_operators_taint_of_the_same_key_is_never_removed(short_tmp, kube):
    async with agent_against(short_tmp, kube, taint_unhealthy=True) as (node, agent):
        await until_async(lambda: condition(kube), 20, "the first condition")
        theirs = {"key": "nvidia.com/gpu.unhealthy", "value": "by-hand", "effect": "NoSchedule"}
        assert kube.http("admin").patch(node_path(NODE), {"spec": {"taints": [theirs]}})[0] == 200
        await node.post("/v1/sim/xid", {"gpu": 1, "xid": 79})
        await until_async(lambda: condition(kube)["status"] == "False", 10, "unhealthy")
        gpu1 = (await node.get("/v1/gpus/1"))[1]["uuid"]
        await node.post(f"/v1/health/{gpu1}/clear", {})
        await until_async(lambda: condition(kube)["status"] == "True", 10, "healthy again")
        assert kube.node(NODE)["spec"]["taints"] == [theirs]
        assert not events_named(kube, "GPUTaintAdded") and not events_named(kube, "GPUTaintRemoved")


async def test_the_agent_watches_only_its_own_node_and_resumes_after_410_with_one_get(short_tmp, kube):
    kube.create_node("other-node")
    async with agent_against(short_tmp, kube) as (node, agent):
        await until_async(lambda: condition(kube), 20, "the agent running")
        kube.label("other-node", MIG_LABEL, "all-1g.5gb")  # a change the agent must not see or act on
        kube.compact()  # the agent's resourceVersion, older than that change, is now too old
        kube.end_watches()
        kube.label(NODE, SHARING_LABEL, "tesla-t4")
        await until_async(lambda: events_named(kube, "SharingConfigApplied"), 20, "the agent saw the label")
        calls = [(r["verb"], r["path"]) for r in kube.requests if r["user"] == AGENT_USER]
        assert ("list", "/api/v1/nodes") not in calls  # never a list of every Node
        watches = [r for r in kube.requests if r["user"] == AGENT_USER and r["verb"] == "watch"]
        assert watches and all(r["query"].get("fieldSelector") == f"metadata.name={NODE}" for r in watches)
        assert all(r["query"].get("allowWatchBookmarks") in ("True", "true") for r in watches)
        # read, watched from its version; after the 410: read again and watched from the most recent
        # (the Node's own version may be as old as its last change, already out of the window)
        calls = [(r["verb"], "resourceVersion" in r["query"]) for r in kube.requests if r["user"] == AGENT_USER
                 and r["verb"] in ("get", "watch")]
        assert calls == [("get", False), ("watch", True), ("watch", True), ("get", False), ("watch", False)], calls
        assert not any("other-node" in r["path"] for r in kube.requests if r["user"] == AGENT_USER)
        assert "other-node" not in {e["involvedObject"]["name"] for e in kube.events()}


async def test_an_unreachable_or_forbidding_api_server_leaves_gpud_alone_and_the_agent_says_why(short_tmp, kube):
    async with agent_against(short_tmp, kube) as (node, agent):
        await until_async(lambda: condition(kube), 20, "the agent running")
        kube.label(NODE, MIG_LABEL, "all-1g.5gb")
        await until_async(lambda: state_label(kube) == "success", 60, "the layout")
        _, before = await node.get("/v1/sharing")
        kube.down()
        await node.post("/v1/sim/xid", {"gpu": 4, "xid": 79})
        status = await until_async(lambda: agent_status_where(node, lambda a: a["kubernetes"]["ok"] is False and
                                                              "write condition or taint" in a["problems"]), 30,
                                   "the agent reporting the API server down", interval=0.2)
        assert "Connect" in status["problems"]["write condition or taint"]["why"], status["problems"]
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] == "all-1g.5gb" and mig["in_sync"] is True  # gpud untouched
        _, after = await node.get("/v1/sharing")
        assert [(r["name"], r["count"]) for r in after["resources"]] == \
            [(r["name"], r["count"]) for r in before["resources"]]
        kube.up()
        await until_async(lambda: (c := condition(kube)) and c["status"] == "False", 90,
                          "the condition written once the API server is back")
        await until_async(lambda: agent_status_where(node, lambda a: a["kubernetes"]["ok"] is True), 30,
                          "the agent reporting the API server back", interval=0.2)
        kube.delay(1.5)  # a slow API server: the agent waits on it, gpud does not
        kube.label(NODE, SHARING_LABEL, "2080ti-12gb")
        asked = time.monotonic()
        assert (await node.get("/healthz"))[0] in (200, 503) and time.monotonic() - asked < 1.0
        await until_async(lambda: events_named(kube, "SharingConfigApplied"), 30, "the slow server's Event")
        kube.delay(0)
        # RBAC without nodes/status: the agent says what it cannot do and why, and goes on with the rest
        kube.bind_agent_rbac([r for r in agent_rbac_rules() if "nodes/status" not in r["resources"]])
        gpu4 = (await node.get("/v1/gpus/4"))[1]["uuid"]
        await node.post(f"/v1/health/{gpu4}/clear", {})
        status = await until_async(
            lambda: agent_status_where(node, lambda a: "HTTP 403" in a["problems"].get("write condition or taint",
                                                                                        {}).get("why", "")),
            30, "the agent reporting the 403", interval=0.2)
        assert "deploy/kubernetes/rbac.yaml" in status["problems"]["write condition or taint"]["why"]
        kube.label(NODE, SHARING_LABEL, "tesla-t4")
        await until_async(lambda: len(events_named(kube, "SharingConfigApplied")) == 2, 20, "labels still acted on")
        assert agent.proc.poll() is None


async def _nfd_product(node, wanted) -> str | None:
    _, nfd = await node.get("/v1/nfd")
    product = nfd["labels"].get("nvidia.com/gpu.product")
    return product if product and wanted(product) else None


async def agent_status_where(node, wanted) -> dict | None:
    """The agent's status as gpud holds it (GET /v1/kubernetes, what `gpud kubernetes` shows) when
    wanted(status) holds."""
    _, document = await node.get("/v1/kubernetes")
    status = document.get("agent")
    return status if status and wanted(status) else None


HOSTILE_VALUES = ("../../etc/passwd", "all-1g.5gb/../x", "x" * 64, "y" * 100_000, "all-1g.5gb\n", "-rf", "é")


async def test_hostile_label_values_are_refused_by_the_api_server_and_by_the_agent_alike(short_tmp, kube, capsys):
    """The API server refuses what is not a label value (a path, 64+ characters, a newline), as the real
    one does (apimachinery validation.IsValidLabelValue); an agent handed one anyway (a lenient server,
    an edited object) says `failed` with an Event and changes nothing: no crash, no partial apply."""
    for value in HOSTILE_VALUES:
        with pytest.raises(ApiError) as refused:
            kube.label(NODE, MIG_LABEL, value)
        assert (refused.value.code, refused.value.status["reason"]) == (422, "Invalid")
    node = await start_daemon(gpud_config(short_tmp))
    await mig_settled(node)
    client = await api_client(kube.kubeconfig("agent"))
    try:
        agent = Agent(NodeApi(client, NODE), node.daemon.config.socket_path)
        agent.node = kube.node(NODE)
        for number, value in enumerate(HOSTILE_VALUES, 1):
            await agent._apply_mig(value)
            assert state_label(kube) == "failed"
            invalid = events_named(kube, "MigConfigInvalid")
            assert len(invalid) == number and all(len(e["message"]) <= 1024 for e in invalid)
            assert any(repr(value[:40])[:-1] in e["message"] for e in invalid), value[:80]
            await agent._choose_sharing(value)
            assert len(events_named(kube, "SharingConfigInvalid")) == number
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] is None and mig["history"] == []  # nothing was applied
        logged = capsys.readouterr().out
        assert "mig_label_outcome" in logged and max(map(len, logged.splitlines())) < 2000  # values cut short
        _, sharing = await node.get("/v1/sharing")
        assert sharing["config"]["name"] == "mig-single" and sharing["config"]["chosen"] is None
    finally:
        await client.close()
        await stop_daemon(node)


async def test_a_mode_change_that_waits_for_a_reset_is_rebooting_until_it_is_done(short_tmp, kube):
    """mig-manager's `rebooting`: an A100 another process holds switches MIG mode only at its next reset
    (gpud leaves that reset to the operator: mig.allow_gpu_reset false). Once it happened and gpud has
    the layout, the state is success."""
    config = gpud_config(short_tmp, preset="A100-SXM4-40GB:2").with_overrides(**{"mig.allow_gpu_reset": False})
    node = await start_daemon(config)
    await mig_settled(node)
    for gpu in (0, 1):
        await node.post("/v1/sim/holders", {"gpu": gpu, "process": "nvidia-persistenced", "pid": 900 + gpu})
    agent = AgentProcess(short_tmp, kube, node.daemon.config.socket_path)
    try:
        kube.label(NODE, MIG_LABEL, "all-1g.5gb")
        await until_async(lambda: state_label(kube) == "rebooting", 60, "mig.config.state rebooting")
        [waiting] = await until_async(lambda: events_named(kube, "MigConfigNeedsReboot"), 10, "the Event")
        assert "GPUs 0, 1" in waiting["message"] and waiting["type"] == "Warning"
        for gpu in (0, 1):  # what a reboot does: the holders go, the GPUs are reset
            await node.post("/v1/sim/holders", {"gpu": gpu, "release": True})
        for gpu in (0, 1):
            async with node.http.post(f"http://localhost/v1/gpus/{gpu}/reset", json={}) as response:
                assert response.status == 200, await response.text()
        await until_async(lambda: state_label(kube) == "success", 60, "success after the reset")
        applied = await until_async(lambda: events_named(kube, "MigConfigApplied"), 10, "the Event")
        assert "after the reset or reboot" in applied[0]["message"]
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] == "all-1g.5gb" and mig["in_sync"] is True
    finally:
        await asyncio.to_thread(agent.stop)  # the loop serves gpud meanwhile: the agent's last status
        await stop_daemon(node)


async def test_a_conflicting_taint_write_is_read_again_and_retried(short_tmp, kube):
    """The taint list goes with the resourceVersion it was computed from; the API server's 409 Conflict
    (someone wrote the Node in between) has the agent read the Node again and retry, not overwrite."""
    async with agent_against(short_tmp, kube, taint_unhealthy=True) as (node, agent):
        await until_async(lambda: condition(kube), 20, "the agent running")
        gets_before = sum(r["verb"] == "get" for r in kube.requests if r["user"] == AGENT_USER)
        kube.fail_next(409, count=2, match=lambda method, path: method == "PATCH" and path == node_path(NODE))
        await node.post("/v1/sim/xid", {"gpu": 5, "xid": 79})
        await until_async(lambda: TAINT in kube.node(NODE)["spec"].get("taints", []), 20, "the taint")
        patches = [r["status"] for r in kube.requests if r["user"] == AGENT_USER and r["verb"] == "patch"
                   and r["path"] == node_path(NODE)]
        assert patches == [409, 409, 200], patches
        gets = sum(r["verb"] == "get" for r in kube.requests if r["user"] == AGENT_USER) - gets_before
        assert gets == 2  # read again after each conflict


async def test_gpud_kubernetes_shows_what_the_agent_reported(short_tmp, kube):
    async with agent_against(short_tmp, kube) as (node, agent):
        socket = str(node.daemon.config.socket_path)
        kube.label(NODE, MIG_LABEL, "all-1g.5gb")
        await until_async(lambda: state_label(kube) == "success", 60, "the layout")
        shown = await until_async(lambda: agent_status_where(node, lambda a: a["mig"]["state"] == "success"), 10,
                                  "the agent's status in gpud")
        assert shown["node"] == NODE and shown["kubernetes"]["ok"] is True and shown["problems"] == {}
        text = await asyncio.to_thread(cli, "kubernetes", socket=socket)
        assert text.returncode == 0, text.stderr
        assert "agent:    running, node gpu-node-1" in text.stdout
        assert "api:      reachable" in text.stdout and "mig:      label all-1g.5gb, state success" in text.stdout
        assert "health:   GPUHealthy True (AllGPUsHealthy), taint off" in text.stdout
        as_json = await asyncio.to_thread(cli, "kubernetes", "--json", socket=socket)
        assert json.loads(as_json.stdout)["agent"]["mig"]["label"] == "all-1g.5gb"
        assert await asyncio.to_thread(agent.stop) == 0
        stopped = await asyncio.to_thread(cli, "kubernetes", socket=socket)  # nothing reports to the Node now
        assert stopped.returncode == 1 and "agent:    STOPPED, node gpu-node-1" in stopped.stdout


async def test_in_a_pod_the_agent_finds_the_api_server_through_its_service_account(short_tmp, kube):
    """No --kubeconfig: what Kubernetes gives a pod (KUBERNETES_SERVICE_HOST/PORT, the service account's
    token and CA under /var/run/secrets/kubernetes.io/serviceaccount), laid out in a mount namespace of
    the agent's own."""
    need(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare for a mount namespace")
    account = short_tmp / "account"
    account.mkdir()
    (account / "token").write_text(kube.tokens["agent"])
    (account / "ca.crt").write_bytes(kube.ca_file.read_bytes())
    (account / "namespace").write_text("gpud-system")
    secrets = "/run/secrets/kubernetes.io/serviceaccount"  # /var/run is /run
    pod = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f"mount -t tmpfs pod-run /run && mkdir -p {secrets} && cp {account}/* {secrets}/ && "
           f'exec {sys.executable} -m gpud k8s-agent "$@"', "agent"]
    host, port = kube.url.removeprefix("https://").rsplit(":", 1)
    node = await start_daemon(gpud_config(short_tmp))
    await mig_settled(node)
    agent = AgentProcess(short_tmp, kube, node.daemon.config.socket_path, in_pod=pod,
                         env={"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port})
    try:
        kube.label(NODE, SHARING_LABEL, "tesla-t4")
        await until_async(lambda: events_named(kube, "SharingConfigApplied"), 30, "the agent at work", interval=0.1)
        users = {r["user"] for r in kube.requests if r["path"].startswith("/api/v1/nodes/gpu-node-1")} - {None}
        assert AGENT_USER in users
        assert not Path(secrets).exists() or not (Path(secrets) / "token").exists()  # it was the pod's own
    finally:
        await asyncio.to_thread(agent.stop)
        await stop_daemon(node)


async def test_bookmarks_keep_the_agents_resource_version_fresh_through_a_compaction(short_tmp, kube):
    """Other Nodes' changes move the server's resourceVersion on; a bookmark brings the agent's along
    (it carries no change of its own Node), so a renewal after a compaction is not a 410 and costs no GET."""
    kube.create_node("other-node")
    async with agent_against(short_tmp, kube) as (node, agent):
        await until_async(lambda: condition(kube), 20, "the agent running")
        for value in ("a", "b", "c"):
            kube.label("other-node", "churn", value)

        def caught_up():
            """A bookmark (each try sends one, as the server does every minute: one sent while the agent
            was between watches is lost) has brought the agent to the server's newest resourceVersion,
            its own writes included."""
            kube.send_bookmarks()
            current = str(kube.revision)
            return agent_status_where(node, lambda a: a["watch"]["resource_version"] == current)

        await until_async(caught_up, 20, "the bookmark's resourceVersion in the agent's status", interval=0.2)
        current = str(kube.revision)
        kube.compact()
        kube.end_watches()
        kube.label(NODE, SHARING_LABEL, "tesla-t4")
        await until_async(lambda: events_named(kube, "SharingConfigApplied"), 20, "the agent watching on")
        calls = [(r["verb"], r["query"].get("resourceVersion"), r["status"]) for r in kube.requests
                 if r["user"] == AGENT_USER and r["verb"] in ("get", "watch")]
        assert calls[-1] == ("watch", current, 200) and sum(verb == "get" for verb, _, _ in calls) == 1, calls
