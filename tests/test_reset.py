"""GPU resets as real drivers accept them, through the API on simulated nodes.

The simulator refuses `nvidia-smi -r` as the driver does (nvidia-smi(1) under -r/--gpu-reset):
while this process has NVML initialised, while another process holds the GPU or a compute process
runs on it, and when a GPU that must be reset with its NVLink peers goes without them. So every
successful reset here also shows that gpud released its own NVML session and named the right peers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace

import pynvml
import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer
from helpers import Lines, curl_as, mig_config, put_layout, start_daemon, stop_daemon, until_async
from openapi_check import assert_matches_openapi

from gpud.daemon import Daemon
from gpud.model.inventory import Gpu, MigInfo
from gpud.nvml.host_tools import HostTools, ResetFailed
from gpud.nvml.reset import NvlinkTopology


async def post(node, path: str, body=None):
    async with node.http.post(f"http://localhost{path}", json=body) as response:
        return response.status, await response.json()


async def gpus(node) -> list[dict]:
    return (await node.get("/v1/gpus"))[1]["gpus"]


# -- refusing before any change ----------------------------------------------------------------


async def test_a_holder_refuses_an_ampere_mode_change_and_nothing_changes(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100"))
    try:
        status, body = await post(node, "/v1/sim/holders", {"gpu": 3, "process": "nv-hostengine", "pid": 4242})
        assert status == 200 and body["holders"] == [{"pid": 4242, "process": "nv-hostengine"}], body
        assert_matches_openapi("POST", "/v1/sim/holders", 200, body)
        sim_state = (short_tmp / "sim.json").read_bytes()
        before = await gpus(node)

        status, body = await put_layout(node, "all-balanced")
        assert status == 409 and body["error"]["code"] == "reset-blocked", body
        assert_matches_openapi("PUT", "/v1/mig", 409, body)
        message = body["error"]["message"]
        assert "GPU 3" in message and "nv-hostengine" in message and "4242" in message and "stop DCGM" in message
        assert [b["gpu"] for b in body["error"]["blockers"]] == [3]
        assert (short_tmp / "sim.json").read_bytes() == sim_state  # no mode set, nothing destroyed
        assert not (short_tmp / "state" / "mig-desired.json").exists()  # the layout was not adopted
        assert await gpus(node) == before
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] is None

        status, body = await post(node, "/v1/sim/holders", {"gpu": 3, "release": True})
        assert status == 200 and body["holders"] == [] and body["injected"] == "holders-released"
        status, body = await put_layout(node, "all-balanced")
        assert status == 200 and body["in_sync"], body
    finally:
        await stop_daemon(node)


async def test_compute_processes_on_a_whole_gpu_block_its_mode_change(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        assert (await post(node, "/v1/sim/processes", {"gpu": 1, "pids": [777]}))[0] == 200
        status, body = await put_layout(node, "all-1g.5gb")
        assert status == 409 and body["error"]["code"] == "reset-blocked"
        assert "GPU 1" in body["error"]["message"] and "777" in body["error"]["message"]
        assert all(g["mig"]["pending_mode"] == "disabled" for g in await gpus(node))
    finally:
        await stop_daemon(node)


async def test_hopper_changes_mig_mode_without_a_reset_so_holders_do_not_matter(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "hgx-h100"))
    try:
        assert (await post(node, "/v1/sim/holders", {"gpu": 3, "process": "nv-hostengine", "pid": 4242}))[0] == 200
        status, body = await put_layout(node, "all-balanced")
        assert status == 200 and body["in_sync"], body  # a reset would have been refused: none was needed
        assert all(g["mig"]["mode"] == "enabled" for g in await gpus(node))
    finally:
        await stop_daemon(node)


async def test_allow_gpu_reset_false_leaves_the_reset_to_the_operator_without_a_preflight(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2", allow_gpu_reset=False))
    try:
        assert (await post(node, "/v1/sim/holders", {"gpu": 0, "process": "nvidia-persiste", "pid": 900}))[0] == 200
        status, body = await put_layout(node, "all-1g.5gb")
        assert status == 409 and body["error"]["code"] == "reset-required", body
        assert "nvidia-smi -r -i" in body["error"]["message"]
    finally:
        await stop_daemon(node)


async def test_in_a_passthrough_vm_an_ampere_mode_change_waits_for_a_reboot(short_tmp):
    # SetMigMode's activation status RESET_REQUIRED (nvml.h: pass-through VMs expose no reset) means
    # only a reboot applies the mode: gpud says so and does not try a reset.
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        node.daemon.session.nvml.sim_set_passthrough(True)
        status, body = await put_layout(node, "all-1g.5gb")
        assert status == 409 and body["error"]["code"] == "reset-required", body
        assert "reboot" in body["error"]["message"]
        _, gpu = await node.get("/v1/gpus/0")
        assert gpu["mig"]["mode"] == "disabled" and gpu["mig"]["pending_mode"] == "enabled"
    finally:
        await stop_daemon(node)


# -- gpud lets go of NVML for the reset ----------------------------------------------------------


async def test_gpud_releases_its_nvml_session_for_the_reset(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        sim = node.daemon.session.nvml
        with pytest.raises(pynvml.NVMLError_InUse):  # what the driver answers while gpud holds NVML
            sim.sim_reset_gpu([0])
        status, body = await post(node, "/v1/gpus/0/reset")
        assert status == 200 and body["reset"] == [0], body
        assert (await node.get("/healthz"))[0] == 200  # NVML is back
        # The health event thread is back too: an XID after the reset still reaches the tracker.
        assert (await post(node, "/v1/sim/xid", {"gpu": 0, "xid": 79}))[0] == 200
        assert await _eventually(lambda: _state(node, 0), "unhealthy")
    finally:
        await stop_daemon(node)


async def _state(node, index: int) -> str:
    return (await node.get(f"/v1/gpus/{index}/health"))[1]["state"]


async def _eventually(read, wanted, tries: int = 300) -> bool:
    for _ in range(tries):
        if await read() == wanted:
            return True
        await asyncio.sleep(0.01)
    return False


# -- the reset route -----------------------------------------------------------------------------


async def test_ampere_on_direct_nvlink_resets_one_gpu_at_a_time(short_tmp):
    # nvidia-smi(1), -r: "Direct connected NVLink systems ... Ampere+: Each GPU can be reset individually".
    node = await start_daemon(mig_config(short_tmp, "hgx-a100-4gpu"))
    try:
        assert (await post(node, "/v1/sim/holders", {"gpu": 2, "process": "dcgm-exporter", "pid": 31}))[0] == 200
        status, body = await post(node, "/v1/gpus/1/reset", {})
        assert status == 200, body
        assert_matches_openapi("POST", "/v1/gpus/{id}/reset", 200, body)
        assert body["requested"] == [1] and body["reset"] == [1] and body["peers"] == []
    finally:
        await stop_daemon(node)


async def test_without_fabric_manager_nvswitch_peers_are_reset_together(short_tmp):
    # nvidia-smi(1), -r: on Ampere NVSwitch systems without Fabric Manager "All PEER connected GPUs
    # must be reset in same command", and no compute process may run on any GPU of the system.
    node = await start_daemon(mig_config(short_tmp, "dgx-a100"))
    try:
        node.daemon.session.nvml.sim_set_fabric_manager(False)  # systemctl stop nvidia-fabricmanager
        status, body = await post(node, "/v1/gpus/1/reset")
        assert status == 200, body
        assert body["reset"] == list(range(8)) and body["peers"] == [0, 2, 3, 4, 5, 6, 7]

        assert (await post(node, "/v1/sim/holders", {"gpu": 6, "process": "dcgm-exporter", "pid": 31}))[0] == 200
        state = (short_tmp / "sim.json").read_bytes()
        status, body = await post(node, "/v1/gpus/1/reset")
        assert status == 409 and body["error"]["code"] == "reset-blocked", body
        assert_matches_openapi("POST", "/v1/gpus/{id}/reset", 409, body)
        assert body["error"]["reset_gpus"] == list(range(8))  # the peer's holder blocks GPU 1's reset
        assert [(b["gpu"], "dcgm-exporter" in b["reason"]) for b in body["error"]["blockers"]] == [(6, True)]
        assert (short_tmp / "sim.json").read_bytes() == state

        node.daemon.session.nvml.sim_set_fabric_manager(True)
        status, body = await post(node, "/v1/gpus/1/reset")
        assert status == 200 and body["reset"] == [1], body  # with Fabric Manager, GPU by GPU again
    finally:
        await stop_daemon(node)


async def test_forced_mode_change_on_busy_gpus_ends_the_work_and_resets_them_in_one_command(short_tmp):
    # A busy A100 keeps its new MIG mode pending (SetMigMode's activation status IN_USE); with
    # force, gpud ends the compute processes and resets the GPUs, all in one command as mig-parted does.
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:3"))
    try:
        for index in range(3):
            assert (await post(node, "/v1/sim/processes", {"gpu": index, "pids": [500 + index]}))[0] == 200
        status, body = await put_layout(node, "all-balanced")
        assert status == 409 and body["error"]["code"] == "reset-blocked"
        assert [b["gpu"] for b in body["error"]["blockers"]] == [0, 1, 2]
        with structlog.testing.capture_logs() as logs:
            status, body = await put_layout(node, "all-balanced", force=True)
        assert status == 200 and body["in_sync"], body
        ended = sorted(pid for e in logs if e["event"] == "gpu_reset_processes_ended" for pid in e["pids"])
        assert ended == [500, 501, 502]
        resets = [e for e in logs if e["event"] == "gpu_reset"]
        assert sorted(e["gpu"] for e in resets) == [0, 1, 2]  # each GPU reset once...
        assert all(e["together_with"] == [i for i in range(3) if i != e["gpu"]] for e in resets)  # ...together
    finally:
        await stop_daemon(node)


async def test_reset_brings_a_lost_gpu_back_and_says_what_it_cleared(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100"))
    try:
        assert (await post(node, "/v1/sim/gpu-lost", {"gpu": 5}))[0] == 200
        lost = (await gpus(node))[5]
        assert lost["lost"] is True
        status, body = await post(node, f"/v1/gpus/{lost['uuid']}/reset")
        assert status == 200, body
        assert body["reset"] == [5] and body["peers"] == []  # NVSwitch: no direct peers
        assert body["gpus"] == [{"index": 5, "uuid": lost["uuid"], "lost": False, "mig_mode": "disabled"}]
        assert any(c["kind"] == "lost" and c["device"] == lost["uuid"] for c in body["cleared"]), body["cleared"]
        assert (await gpus(node))[5]["lost"] is False
    finally:
        await stop_daemon(node)


async def test_reset_clears_the_xid_that_asks_for_one(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        assert (await post(node, "/v1/sim/xid", {"gpu": 0, "xid": 79}))[0] == 200
        assert await _eventually(lambda: _state(node, 0), "unhealthy")
        status, body = await post(node, "/v1/gpus/0/reset", {"force": False})
        assert status == 200, body
        assert [(c["kind"], c["code"]) for c in body["cleared"]] == [("xid", "79")]
        assert (await node.get("/v1/gpus/0/health"))[1]["state"] == "healthy"
    finally:
        await stop_daemon(node)


async def test_reset_of_a_mig_gpu_with_busy_devices_is_refused_unless_forced(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        assert (await put_layout(node, "all-balanced"))[0] == 200
        device = (await gpus(node))[0]["mig"]["devices"][0]
        assert (await post(node, "/v1/sim/processes", {"gpu": device["uuid"], "pids": [4343]}))[0] == 200
        status, body = await post(node, "/v1/gpus/0/reset")
        assert status == 409 and body["error"]["code"] == "reset-blocked"
        assert device["uuid"] in body["error"]["message"] and "4343" in body["error"]["message"]

        status, body = await post(node, "/v1/gpus/0/reset", {"force": True})
        assert status == 200, body
        assert body["ended_processes"] == {device["uuid"]: [4343]}
        after = (await gpus(node))[0]
        # The reset destroyed every instance; gpud made the layout it manages again, idle.
        assert after["mig"]["mode"] == "enabled" and len(after["mig"]["devices"]) == 4
        assert all(d["pids"] == [] for d in after["mig"]["devices"])
        _, mig = await node.get("/v1/mig")
        assert mig["in_sync"] is True
    finally:
        await stop_daemon(node)


async def test_files_kept_for_others_wait_out_a_reset_whose_mig_instances_come_back(short_tmp):
    """A reset destroys a MIG GPU's instances and gpud makes them again: gres.conf, the CDI spec and NFD's
    labels never lose them meanwhile. A gres.conf with fewer records, and the `scontrol reconfigure` after it, has
    slurmd register a lower count, and Slurm marks the node invalid; a spec without the devices fails a
    container that names one."""
    gres_path = short_tmp / "gres.conf"
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2").with_overrides(
        **{"slurm.gres_file": str(gres_path)}))
    try:
        assert (await put_layout(node, "all-3g.20gb"))[0] == 200
        gres, cdi = node.daemon.slurm_gres, node.daemon.cdi
        await until_async(lambda: gres.content is not None and gres.content.count("Type=3g.20gb") == 4
                          and cdi.content is not None, what="gres.conf and the CDI spec with 4 MIG devices")
        nfd = node.daemon.nfd.path
        await until_async(lambda: nfd.exists() and "nvidia.com/mig.config.state=success" in nfd.read_text(),
                          what="NFD's labels of the layout applied")
        before = (gres_path.read_text(), cdi.path.read_text(), gres.written_at, cdi.written_at, nfd.read_text())
        restore = node.daemon.resetter._restore

        async def slow_restore(gpus, after):
            # a real GPU takes seconds to make its MIG instances again
            await asyncio.sleep(1.0)  # fixed time: longer than the writers' debounce (0.15 s)
            await restore(gpus, after)
        node.daemon.resetter._restore = slow_restore
        with structlog.testing.capture_logs() as logs:
            status, body = await post(node, "/v1/gpus/1/reset")
        assert status == 200, body
        assert len((await gpus(node))[1]["mig"]["devices"]) == 2
        # said while it waited: what for
        waits = [entry for entry in logs if entry["event"].endswith("_write_waits")]
        assert waits and all(entry["until"] == "a reset of GPUs 1" for entry in waits), logs
        await asyncio.sleep(0.5)  # fixed time: past the writers' debounce, were they to write again
        assert (gres_path.read_text(), cdi.path.read_text(), gres.written_at, cdi.written_at, nfd.read_text()) == before
    finally:
        await stop_daemon(node)


async def test_reset_route_refuses_bad_targets(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        status, body = await post(node, "/v1/gpus/9/reset")
        assert status == 404 and body["error"]["code"] == "gpu-not-found"
        assert_matches_openapi("POST", "/v1/gpus/{id}/reset", 404, body)
        async with node.http.post("http://localhost/v1/gpus/0/reset", data=b'{"force": "yes"}') as response:
            assert response.status == 400 and (await response.json())["error"]["code"] == "invalid-field"
        async with node.http.post("http://localhost/v1/gpus/0/reset", data=b'{"forse": true}') as response:
            assert response.status == 400 and (await response.json())["error"]["code"] == "unknown-field"
        assert (await put_layout(node, "all-7g.40gb"))[0] == 200
        mig_uuid = (await gpus(node))[0]["mig"]["devices"][0]["uuid"]
        status, body = await post(node, f"/v1/gpus/{mig_uuid}/reset")
        assert status == 422 and body["error"]["code"] == "not-a-gpu"
    finally:
        await stop_daemon(node)


# -- simulator fault routes ----------------------------------------------------------------------


@pytest.mark.parametrize("body, status, code", [
    ({"gpu": 9, "process": "x", "pid": 5}, 422, "invalid-target"),
    ({"gpu": "GPU-nope", "release": True}, 422, "invalid-target"),
    ({"gpu": 0, "process": "x"}, 400, "missing-field"),
    ({"gpu": 0, "pid": 5}, 400, "missing-field"),
    ({"gpu": 0, "process": "x", "pid": 0}, 400, "invalid-field"),
    ({"gpu": 0, "process": "x", "pid": "5"}, 400, "invalid-field"),
    ({"gpu": 0, "process": "", "pid": 5}, 400, "invalid-field"),
    ({"gpu": 0, "process": "a\nb", "pid": 5}, 400, "invalid-field"),
    ({"gpu": 0, "release": True, "pid": 5}, 400, "invalid-body"),
    ({"gpu": 0, "release": "yes"}, 400, "invalid-field"),
    ({"gpu": 0, "process": "x", "pid": 5, "name": "y"}, 400, "unknown-field"),
])
async def test_sim_holders_refuses_bad_input(short_tmp, body, status, code):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        got, answer = await post(node, "/v1/sim/holders", body)
        assert (got, answer["error"]["code"]) == (status, code), answer
        assert_matches_openapi("POST", "/v1/sim/holders", status, answer)
        assert (await post(node, "/v1/sim/holders", {"gpu": 0, "release": True}))[1]["holders"] == []
    finally:
        await stop_daemon(node)


async def test_sim_gpu_lost_how_and_gpu_recover(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        status, body = await post(node, "/v1/sim/gpu-lost", {"gpu": 1, "how": "is-lost"})
        assert status == 200 and body == {"injected": "gpu-lost", "gpu": 1, "how": "is-lost"}
        assert (await gpus(node))[1]["lost"] is True
        status, body = await post(node, "/v1/sim/gpu-lost", {"gpu": 0, "how": "melted"})
        assert status == 422 and body["error"]["code"] == "invalid-target"
        assert (await gpus(node))[0]["lost"] is False
        status, body = await post(node, "/v1/sim/gpu-recover", {"gpu": 1})
        assert status == 200 and body["injected"] == "gpu-recovered"
        assert_matches_openapi("POST", "/v1/sim/gpu-recover", 200, body)
        assert (await gpus(node))[1]["lost"] is False
        for bad, code in (({"gpu": 7}, 422), ({"gpu": True}, 400), ({}, 400)):
            status, body = await post(node, "/v1/sim/gpu-recover", bad)
            assert status == code, (bad, body)
            assert_matches_openapi("POST", "/v1/sim/gpu-recover", code, body)
    finally:
        await stop_daemon(node)


async def test_a_real_nvml_node_has_no_simulator_routes(short_tmp):
    app = Daemon(replace(mig_config(short_tmp, "dgx-a100"), simulate=None)).api.app()  # real pynvml, not started
    assert not any(r.resource.canonical == "/v1/sim/holders" for r in app.router.routes() if r.method == "POST")
    async with TestClient(TestServer(app)) as client:
        for path in ("/v1/sim/holders", "/v1/sim/gpu-recover", "/v1/sim/xid"):
            response = await client.post(path, json={"gpu": 0, "release": True})
            assert response.status == 404 and (await response.json())["error"]["code"] == "not-simulated"


# -- admin only ----------------------------------------------------------------------------------


def gpud_of_readers_and_admins(run_gpud, short_tmp):
    """A simulated one-GPU gpud whose readers are group gpudt-readers and admins gpudt-admins (the users
    fixture's groups)."""
    short_tmp.chmod(0o755)
    config = short_tmp / "gpud.yaml"
    config.write_text("api:\n  group: gpudt-readers\n  admin_group: gpudt-admins\n")
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:1", "--sim-state", str(short_tmp / "sim.json"),
                    "--config", str(config))
    gpud.wait_healthy()
    return gpud


def test_resets_and_holders_are_for_admins_only(run_gpud, short_tmp, users):  # noqa: F811
    gpud = gpud_of_readers_and_admins(run_gpud, short_tmp)
    for method, path, body in (("POST", "/v1/gpus/0/reset", {}), ("POST", "/v1/sim/holders",
                                                                   {"gpu": 0, "process": "x", "pid": 5}),
                               ("POST", "/v1/sim/gpu-recover", {"gpu": 0})):
        status, text = curl_as("gpudt-reader", gpud.socket, method, path, body)
        assert status == 403 and json.loads(text)["error"]["code"] == "forbidden", path
    status, text = curl_as("gpudt-admin", gpud.socket, "POST", "/v1/gpus/0/reset", {})
    assert status == 200, text
    assert gpud.stop() == 0


# -- the real host tools, against real processes and a stand-in nvidia-smi ------------------------


def _gpu(index: int, bus_id: str, minor: int | None) -> Gpu:
    return Gpu(index=index, uuid=f"GPU-{index}", name="x", pci_bus_id=bus_id, pci_device_id="0x20B010DE",
               memory_total_mib=1, compute_mode="default", architecture="ampere", cuda_compute_capability="8.0",
               serial=None, mig=MigInfo(capable=False, mode=None, pending_mode=None), minor_number=minor)


def _fake_smi(tmp, exit_status: int):
    smi = tmp / "nvidia-smi"
    smi.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "args: $*"
        [ {exit_status} -eq 0 ] || echo "Unable to reset GPU: In use by another client" >&2
        exit {exit_status}
        """))
    smi.chmod(0o755)
    return str(smi)


def test_host_tools_reset_names_every_gpu_in_one_command(tmp_path):
    tools = HostTools(smi=_fake_smi(tmp_path, 0))
    output = tools.reset([_gpu(0, "00000000:07:00.0", 0), _gpu(1, "00000000:0F:00.0", 1)])
    assert output == "args: -r -i 00000000:07:00.0,00000000:0F:00.0"


def test_host_tools_reset_failure_carries_what_nvidia_smi_said(tmp_path, monkeypatch):
    tools = HostTools(smi=_fake_smi(tmp_path, 255))
    with pytest.raises(ResetFailed, match="(?s)exit status 255.*In use by another client"):
        tools.reset([_gpu(0, "00000000:07:00.0", 0)])
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ResetFailed, match="nvidia-smi is not installed"):
        HostTools().reset([_gpu(0, "00000000:07:00.0", 0)])


def test_host_tools_refuse_a_gpu_whose_device_node_is_unknown():
    (line,) = HostTools().blockers(_gpu(2, "00000000:10:00.0", None), exclude_pids={os.getpid()})
    assert "GPU 2" in line and "minor number is unknown" in line and "nvidia-smi -r -i 00000000:10:00.0" in line


def test_host_tools_end_processes_terminates_then_kills():
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                                 "time.sleep(60)"], stdout=subprocess.PIPE)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert Lines(stubborn.stdout, "the stubborn child").next("ready").strip() == b"ready"
    HostTools().end_processes("GPU-0", [stubborn.pid, polite.pid], grace_s=0.5)
    assert polite.wait(5) == -signal.SIGTERM
    assert stubborn.wait(5) == -signal.SIGKILL


# -- which GPUs go together: the rule of nvidia-smi(1), -r ------------------------------------------


def _topology(direct=None, switched=(), pre_ampere=(), ampere=()):
    return NvlinkTopology(direct={k: frozenset(v) for k, v in (direct or {}).items()}, switched=frozenset(switched),
                          pre_ampere=frozenset(pre_ampere), needs_fabric_manager=frozenset(ampere))


def test_pre_ampere_direct_peers_go_together_transitively():
    # A DGX-1-like chain of V100s 0-1-2 and a lone 3: "Pre-Ampere | All PEER connected GPUs must be reset".
    chain = _topology(direct={0: {1}, 1: {0, 2}, 2: {1}, 3: set()}, pre_ampere={0, 1, 2, 3})
    assert chain.group([0], fabric_manager_running=True) == {0, 1, 2}
    assert chain.group([3], fabric_manager_running=True) == {3}
    assert not chain.individually({0, 1, 2}, True) and chain.individually({3}, True)


def test_ampere_and_later_on_direct_links_go_alone():
    quad = _topology(direct={i: {j for j in range(4) if j != i} for i in range(4)}, ampere=range(4))
    assert quad.group([1], fabric_manager_running=False) == {1}
    assert quad.individually({1}, False)


def test_nvswitch_ampere_needs_fabric_manager_to_go_alone_and_hopper_does_not():
    dgx = _topology(switched=range(8), ampere=range(8))
    assert dgx.asks_fabric_manager()
    assert dgx.group([5], fabric_manager_running=True) == {5}
    assert dgx.group([5], fabric_manager_running=False) == set(range(8))
    assert not dgx.individually(set(range(8)), False)
    hgx_h100 = _topology(switched=range(8))  # Hopper: neither pre-Ampere nor needing Fabric Manager
    assert not hgx_h100.asks_fabric_manager()
    assert hgx_h100.group([5], fabric_manager_running=False) == {5}
