"""Who uses the GPUs: compute processes per GPU and MIG device, their GPU memory and SM use, and the
container or systemd unit each belongs to, through the simulator, the API and /metrics, with real
processes in real cgroups."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pynvml
import pytest
from helpers import (IN_CI, PODMAN_RUN, curl_as, gpud_for_users, mig_config, minimal_rootfs, need_podman_as_root,
                     podman, put_layout, sim_config, start_daemon, stop_daemon, until)
from openapi_check import assert_matches_openapi

from gpud.nvml.processes import read_processes
from gpud.nvml.sim import SimError
from gpud.nvml.sim.scenarios import enable_mig, started
from gpud.processes.cgroup import UNKNOWN, Owner, owner_of
from gpud.processes.host import describe

MIB = 1 << 20
ID = "01f3c60cfaadbb51e4d5947dd2ef0480d53551cbcee8f3ada8c3723b2bf03bf4"
ID2 = "89e89703fbd1e88b72d279d951ce389d3742874205196d73f96e0dcbc0da0659"

# -- /proc/<pid>/cgroup as hosts write it --------------------------------------------------------
# Lines in the shapes public sources show (podman's, docker's, kubelet's and systemd's layouts, as
# quoted in the test fixtures of open-source tracers and exporters, and a CRI-O node's cgroup v1 file
# from an OpenShift 4.6 bug report), plus the lines this test host writes itself.

CGROUP_LINES = {
    "podman, systemd manager, rootful": (
        f"0::/machine.slice/libpod-{ID}.scope/container\n", Owner("container", "podman", ID)),
    "podman, systemd manager, rootless": (
        f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/container\n",
        Owner("container", "podman", ID)),
    "podman, cgroupfs manager, v2": (f"0::/libpod_parent/libpod-{ID}\n", Owner("container", "podman", ID)),
    "podman, cgroupfs manager, v1": (
        "".join(f"{n}:{c}:/libpod_parent/libpod-{ID}\n" for n, c in ((9, "name=systemd"), (4, "memory"), (1, "cpu")))
        + "0::/\n", Owner("container", "podman", ID)),
    "podman's conmon is not the container": (
        f"0::/machine.slice/libpod-conmon-{ID}.scope\n",
        Owner("systemd", systemd_unit=f"libpod-conmon-{ID}.scope", systemd_slice="machine.slice")),
    "podman's conmon, cgroupfs": ("0::/libpod_parent/conmon\n", Owner("other")),
    "docker, systemd driver": (f"0::/system.slice/docker-{ID}.scope\n", Owner("container", "docker", ID)),
    "docker, cgroupfs driver, v1": (
        f"12:memory:/docker/{ID}\n11:cpu,cpuacct:/docker/{ID}\n1:name=systemd:/docker/{ID}\n",
        Owner("container", "docker", ID)),
    "containerd under Kubernetes, systemd driver": (
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod48d25824_cbe2_4fdc_9928_5bb49e05473d"
        f".slice/cri-containerd-{ID}.scope\n",
        Owner("container", "containerd", ID, "48d25824-cbe2-4fdc-9928-5bb49e05473d")),
    "containerd, guaranteed pod (no QoS slice)": (
        f"0::/kubepods.slice/kubepods-pod6553a60b_2b97_442a_b6da_a5704d81dd98.slice/cri-containerd-{ID}.scope\n",
        Owner("container", "containerd", ID, "6553a60b-2b97-442a-b6da-a5704d81dd98")),
    "containerd under Kubernetes, cgroupfs driver": (
        f"0::/kubepods/besteffort/pod13cb8437-00ed-40e4-99d8-e17193a58086/{ID}\n",
        Owner("container", "containerd", ID, "13cb8437-00ed-40e4-99d8-e17193a58086")),
    "containerd, cgroup v1 with the systemd driver's colon form": (
        "4:pids:/podruntime.slice/containerd.service/kubepods-burstable-pod29349498_197c_4919_b13f_9a928e7d001b"
        f".slice:cri-containerd:{ID}\n",
        Owner("container", "containerd", ID, "29349498-197c-4919-b13f-9a928e7d001b")),
    "CRI-O, cgroup v1 (OpenShift 4.6)": (
        "".join(f"{n}:{c}:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod8ca306fa_3c03_47fa_97dd_"
                f"19979c345572.slice/crio-{ID}.scope\n"
                for n, c in ((12, "devices"), (11, "pids"), (1, "name=systemd"))),
        Owner("container", "cri-o", ID, "8ca306fa-3c03-47fa-97dd-19979c345572")),
    "CRI-O, static pod (its UID is a 32-digit hash)": (
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pode4e6004e827fdf45941cf777618f60ce.slice/"
        f"crio-{ID}.scope\n", Owner("container", "cri-o", ID, "e4e6004e827fdf45941cf777618f60ce")),
    "CRI-O's conmon is not the container": (
        f"0::/kubepods.slice/kubepods-besteffort.slice/crio-conmon-{ID}.scope\n",
        Owner("systemd", systemd_unit=f"crio-conmon-{ID}.scope", systemd_slice="kubepods-besteffort.slice")),
    "a container inside a container (kind): the inner one": (
        f"0::/system.slice/docker-{ID2}.scope/kubepods/burstable/pod09a70ae9-ccc4-91e6-51e5-c773579b3490/{ID}\n",
        Owner("container", "containerd", ID, "09a70ae9-ccc4-91e6-51e5-c773579b3490")),
    "a system service": ("0::/system.slice/nvidia-persistenced.service\n",
                         Owner("systemd", systemd_unit="nvidia-persistenced.service", systemd_slice="system.slice")),
    "a login session": ("0::/user.slice/user-1000.slice/session-3.scope\n",
                        Owner("systemd", systemd_unit="session-3.scope", systemd_slice="user-1000.slice")),
    "a user's own service": ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service\n",
                             Owner("systemd", systemd_unit="jupyter.service", systemd_slice="app.slice")),
    "a transient scope (systemd-run --scope)": (
        "0::/system.slice/run-r3c1d.scope\n", Owner("systemd", systemd_unit="run-r3c1d.scope",
                                                    systemd_slice="system.slice")),
    "PID 1": ("0::/init.scope\n", Owner("systemd", systemd_unit="init.scope")),
    "the root cgroup": ("0::/\n", Owner("other")),
    "cgroup v1 hybrid, systemd's hierarchy only": (
        "9:name=systemd:/system.slice/cron.service\n4:memory:/\n0::/\n",
        Owner("systemd", systemd_unit="cron.service", systemd_slice="system.slice")),
    "a cgroup that names nothing known": ("9:name=systemd:/\n4:memory:/process_api/4bbba5bf4d3e201b\n0::/\n",
                                          Owner("other")),
}


@pytest.mark.parametrize("case", CGROUP_LINES)
def test_the_owner_is_read_from_real_world_cgroup_lines(case):
    text, expected = CGROUP_LINES[case]
    owner = owner_of(text)
    assert {**owner.as_dict(), "cgroup": None} == {**expected.as_dict(), "cgroup": None}
    assert owner.cgroup is not None and owner.cgroup in text


@pytest.mark.parametrize("garbage", ["", "\n", "garbage", "0::relative/path", "x:y:/z", "::::", "\x00\xff" * 50,
                                     "0::/" + "a/" * 5000, "1:memory\n"])
def test_garbage_is_an_unknown_or_plain_owner_never_an_error(garbage):
    owner = owner_of(garbage)
    assert owner.kind in ("unknown", "other") and owner.container_id is None


def test_a_container_id_is_64_hex_digits_exactly():
    assert owner_of(f"0::/system.slice/docker-{ID[:12]}.scope\n").kind == "systemd"
    assert owner_of(f"0::/docker/{ID}0\n").kind == "other"
    assert owner_of(f"0::/libpod_parent/libpod-{ID.upper()}\n").kind == "other"


def test_a_process_that_exited_or_cannot_be_read_has_an_unknown_owner(tmp_path):
    child = subprocess.Popen(["true"])
    child.wait(10)
    gone = describe(child.pid)
    assert gone.comm is None and gone.owner == UNKNOWN
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "comm").write_text("python3\n")  # and no cgroup file
    assert describe(77, tmp_path).owner == UNKNOWN
    me = describe(os.getpid())
    assert me.uid == os.getuid() and me.comm == Path("/proc/self/comm").read_text().strip()
    assert me.owner.kind != "unknown" and me.owner.cgroup in Path("/proc/self/cgroup").read_text()


# -- the simulator's process table -----------------------------------------------------------------


@pytest.fixture
def sleeper():
    """A real host process, killed (and reaped) by the test or at the end."""
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait(10)


def test_each_process_has_its_own_memory_and_sm_use(tmp_path, sleeper):
    nvml = started("H100-SXM5-80GB:2", tmp_path / "sim.json")
    nvml.sim_set_processes(0, [{"pid": sleeper.pid, "used_memory_mib": 30_000, "sm_percent": 87}, 4242])
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    listed = {p.pid: p for p in nvml.nvmlDeviceGetComputeRunningProcesses(device)}
    assert listed[sleeper.pid].usedGpuMemory == 30_000 * MIB and listed[4242].usedGpuMemory == 256 * MIB
    assert listed[4242].gpuInstanceId == listed[4242].computeInstanceId == 0xFFFFFFFF
    memory = nvml.nvmlDeviceGetMemoryInfo(device, version=pynvml.nvmlMemory_v2)
    assert memory.used == 30_256 * MIB and memory.free == memory.total - memory.reserved - memory.used
    since = (time.time_ns() // 1000) - 2_000_000
    samples = nvml.nvmlDeviceGetProcessUtilization(device, since)
    assert [(s.pid, s.smUtil) for s in samples] == [(sleeper.pid, 87)]  # 4242 used no SM: no sample
    assert samples[0].timeStamp > since
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than the last sample
        nvml.nvmlDeviceGetProcessUtilization(device, samples[0].timeStamp)
    with pytest.raises(pynvml.NVMLError_NotFound):  # no process on GPU 1
        nvml.nvmlDeviceGetProcessUtilization(nvml.nvmlDeviceGetHandleByIndex(1), 0)


def test_a_host_process_that_exits_is_no_longer_listed_and_its_memory_is_free(tmp_path, sleeper):
    nvml = started("H100-SXM5-80GB:1", tmp_path / "sim.json")
    nvml.sim_set_processes(0, [{"pid": sleeper.pid, "used_memory_mib": 1024}, 4242])
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    sleeper.kill()  # killed, not yet reaped: a zombie has exited too
    until(lambda: Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z"),
          what="the killed sleeper a zombie")
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(device)] == [4242]
    sleeper.wait(10)
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(device)] == [4242]
    assert nvml.nvmlDeviceGetMemoryInfo(device, version=pynvml.nvmlMemory_v2).used == 256 * MIB


def test_the_process_table_survives_a_restart_and_reads_old_state_files(tmp_path, sleeper):
    state = tmp_path / "sim.json"
    nvml = started("H100-SXM5-80GB:1", state)
    nvml.sim_set_processes(0, [{"pid": sleeper.pid, "used_memory_mib": 2048, "sm_percent": 10}])
    nvml.nvmlShutdown()
    again = started("H100-SXM5-80GB:1", state)
    (listed,) = again.nvmlDeviceGetComputeRunningProcesses(again.nvmlDeviceGetHandleByIndex(0))
    assert (listed.pid, listed.usedGpuMemory) == (sleeper.pid, 2048 * MIB)
    again.nvmlShutdown()
    document = json.loads(state.read_text())
    document["gpus"][0]["processes"] = [31337]  # as an older gpud wrote them: bare PIDs
    state.write_text(json.dumps(document))
    old = started("H100-SXM5-80GB:1", state)
    (listed,) = old.nvmlDeviceGetComputeRunningProcesses(old.nvmlDeviceGetHandleByIndex(0))
    assert (listed.pid, listed.usedGpuMemory) == (31337, 256 * MIB)


@pytest.mark.parametrize("processes", [[{"pid": 0}], [{"pid": 5, "used_memory_mib": 0}], [{"pid": 5, "colour": 1}],
                                       [{"pid": 5, "used_memory_mib": 81_560}], [{"pid": 5, "sm_percent": 101}],
                                       [{"pid": 5, "sm_percent": True}], [5, {"pid": 5}], ["5"], "5", [None]])
def test_bad_processes_are_refused_and_change_nothing(tmp_path, processes):
    nvml = started("H100-SXM5-80GB:1", tmp_path / "sim.json")
    nvml.sim_set_processes(0, [77])
    with pytest.raises(SimError):
        nvml.sim_set_processes(0, processes)
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(0))] == [77]


def one_mig_device(nvml, device, slices_constant):
    """A GPU instance of the profile the constant names, with one compute instance taking all of it."""
    profile = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, slices_constant)
    gi = nvml.nvmlDeviceCreateGpuInstance(device, profile.id)
    ci_profile = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, slices_constant, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)  # the same slice count
    return gi, nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)


def test_mig_devices_list_their_own_processes_and_give_no_utilisation(tmp_path):
    nvml = started("A100-SXM4-40GB:1", tmp_path / "sim.json")
    device = enable_mig(nvml, 0)
    gi = one_mig_device(nvml, device, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)[0]
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)
    nvml.sim_set_processes(nvml.nvmlDeviceGetUUID(mig), [{"pid": 99, "used_memory_mib": 5000, "sm_percent": 50}])
    (listed,) = nvml.nvmlDeviceGetComputeRunningProcesses(mig)
    assert (listed.pid, listed.usedGpuMemory, listed.gpuInstanceId) == (99, 5000 * MIB,
                                                                        nvml.nvmlGpuInstanceGetInfo(gi).id)
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(device)] == [99]  # the aggregate, for root
    assert nvml.nvmlDeviceGetMemoryInfo(mig).used == 5000 * MIB
    for handle in (mig, device):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetProcessUtilization(handle, 0)
    with pytest.raises(SimError):  # more than the MIG device's memory (a 3g.20gb)
        nvml.sim_set_processes(nvml.nvmlDeviceGetUUID(mig), [{"pid": 99, "used_memory_mib": 30_000}])


def test_the_reader_lists_each_device_and_says_why_one_cannot_be_read(tmp_path, sleeper):
    nvml = started("A100-SXM4-40GB:3", tmp_path / "sim.json")
    nvml.sim_set_processes(0, [{"pid": sleeper.pid, "used_memory_mib": 700, "sm_percent": 33}])
    device = enable_mig(nvml, 1)
    gi, ci = one_mig_device(nvml, device, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    mig_uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0))
    nvml.sim_set_processes(mig_uuid, [4343])
    uuids = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(3)]
    nvml.sim_set_gpu_lost(2)
    read = read_processes(nvml, uuids, time.time_ns() // 1000 - 2_000_000)
    whole, on_mig, lost = read
    assert [(p.pid, p.used_memory_bytes, p.sm_percent) for p in whole.processes] == [(sleeper.pid, 700 * MIB, 33)]
    assert whole.unavailable is None and whole.sm_unavailable is None and whole.gi_id is None
    assert (on_mig.uuid, on_mig.gpu_uuid, on_mig.gi_id, on_mig.ci_id) == \
        (mig_uuid, uuids[1], nvml.nvmlGpuInstanceGetInfo(gi).id, nvml.nvmlComputeInstanceGetInfo(ci).id)
    assert [p.pid for p in on_mig.processes] == [4343] and "MIG" in on_mig.sm_unavailable
    assert lost.uuid == uuids[2] and lost.processes == () and "lost" in lost.unavailable


# -- the daemon: API and metrics -------------------------------------------------------------------


def fast(config):
    return config.with_overrides(**{"health.check_interval_s": 0.5})


async def processes_until(node, ident: str, wanted, timeout: float = 5.0) -> dict:
    for _ in range(int(timeout / 0.05)):
        status, body = await node.get(f"/v1/gpus/{ident}/processes")
        if status == 200 and wanted(body):
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"/v1/gpus/{ident}/processes never answered as wanted: {status} {body}")


def assert_promtool_accepts(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not IN_CI, "CI installs Debian's prometheus package (promtool)"
        return
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    # Lint remarks (a counter's name, a help text) are promtool's taste; an unparsable exposition is an error.
    assert "error while linting" not in checked.stderr and "text format parsing error" not in checked.stderr, \
        checked.stderr


async def metrics(node) -> str:
    async with node.http.get("http://localhost/metrics") as response:
        return await response.text()


def listed(body: dict) -> dict[int, dict]:
    return {p["pid"]: p for device in body["devices"] for p in device["processes"]}


async def test_the_api_and_metrics_show_a_real_process_until_it_exits(short_tmp, sleeper):
    node = await start_daemon(fast(sim_config(short_tmp, "H100-SXM5-80GB:2")))
    try:
        process = {"pid": sleeper.pid, "used_memory_mib": 4096, "sm_percent": 64}
        status, body = await node.post("/v1/sim/processes", {"gpu": 1, "processes": [process]})
        assert status == 200, body
        assert_matches_openapi("POST", "/v1/sim/processes", 200, body)
        gpu = (await node.get("/v1/gpus/1"))[1]
        body = await processes_until(node, "1", lambda b: sleeper.pid in listed(b))
        assert_matches_openapi("GET", "/v1/gpus/{id}/processes", 200, body)
        assert (body["gpu"], body["uuid"], len(body["devices"])) == (1, gpu["uuid"], 1)
        assert body["read_at"] <= time.time()
        entry = listed(body)[sleeper.pid]
        assert (entry["comm"], entry["uid"], entry["used_memory_bytes"]) == ("sleep", os.getuid(), 4096 * MIB)
        assert entry["owner"]["kind"] != "unknown" and entry["owner"]["cgroup"] in \
            Path(f"/proc/{sleeper.pid}/cgroup").read_text()
        sm = await processes_until(node, gpu["pci_bus_id"], lambda b: listed(b)[sleeper.pid]["sm_utilization_percent"])
        assert listed(sm)[sleeper.pid]["sm_utilization_percent"] == 64
        assert set(listed((await node.get(f"/v1/gpus/{gpu['uuid']}/processes"))[1])) == {sleeper.pid}
        assert (await node.get("/v1/gpus/0/processes"))[1]["devices"][0]["processes"] == []

        text = await metrics(node)
        memory = [line for line in text.splitlines() if line.startswith("gpud_process_gpu_memory_used_bytes{")]
        assert len(memory) == 1 and f'pid="{sleeper.pid}"' in memory[0] and 'comm="sleep"' in memory[0]
        assert f'UUID="{gpu["uuid"]}"' in memory[0] and 'gpu="1"' in memory[0] and "GPU_I_ID" not in memory[0]
        assert memory[0].endswith(f" {4096 * MIB}")
        assert re.search(rf'gpud_process_sm_utilization_percent{{[^}}]*pid="{sleeper.pid}"[^}}]*}} 64$', text, re.M)
        assert re.search(r'gpud_device_compute_processes{[^}]*gpu="1"[^}]*} 1$', text, re.M)
        assert_promtool_accepts(text)

        sleeper.kill()
        sleeper.wait(10)
        body = await processes_until(node, "1", lambda b: not listed(b))
        assert body["devices"][0]["processes"] == []
        text = await metrics(node)
        assert f'pid="{sleeper.pid}"' not in text
        assert re.search(r'gpud_device_compute_processes{[^}]*gpu="1"[^}]*} 0$', text, re.M)
    finally:
        await stop_daemon(node)


async def test_mig_devices_have_their_own_entries_and_series(short_tmp):
    node = await start_daemon(fast(mig_config(short_tmp, "A100-SXM4-40GB:1")))
    try:
        status, body = await put_layout(node, "all-balanced")
        assert status == 200, body
        devices = (await node.get("/v1/gpus/0"))[1]["mig"]["devices"]
        first, second = devices[0], devices[1]
        for device, pid in ((first, 4242), (second, 4343)):
            status, body = await node.post("/v1/sim/processes", {
                "gpu": device["uuid"], "processes": [{"pid": pid, "used_memory_mib": 1000 + pid % 100}]})
            assert status == 200, body
        body = await processes_until(node, "0", lambda b: {4242, 4343} <= set(listed(b)))
        assert_matches_openapi("GET", "/v1/gpus/{id}/processes", 200, body)
        assert len(body["devices"]) == len(devices)
        by_uuid = {d["uuid"]: d for d in body["devices"]}
        assert by_uuid[first["uuid"]]["mig"] == {"gi_id": first["gi_id"], "ci_id": first["ci_id"],
                                                 "profile": first["profile"]}
        assert by_uuid[first["uuid"]]["sm_utilization_unavailable"]
        assert listed({"devices": [by_uuid[first["uuid"]]]})[4242]["used_memory_bytes"] == 1042 * MIB
        status, only = await node.get(f"/v1/gpus/{second['uuid']}/processes")
        assert status == 200 and [d["uuid"] for d in only["devices"]] == [second["uuid"]]
        assert set(listed(only)) == {4343}

        text = await metrics(node)
        line = next(line for line in text.splitlines()
                    if line.startswith("gpud_process_gpu_memory_used_bytes{") and 'pid="4242"' in line)
        assert f'GPU_I_ID="{first["gi_id"]}"' in line and f'GPU_I_PROFILE="{first["profile"]}"' in line
        assert f'mig_uuid="{first["uuid"]}"' in line and line.endswith(f" {1042 * MIB}")
        # the device's labels are those of its health series, so a dashboard joins the two
        health = next(line for line in text.splitlines()
                      if line.startswith("gpud_gpu_health{") and f'mig_uuid="{first["uuid"]}"' in line)
        assert health[health.index("{"):health.index("}")] in line
        assert "gpud_process_sm_utilization_percent{" not in text
    finally:
        await stop_daemon(node)


BAD_IDS = ["9", "GPU-00000000-0000-0000-0000-000000000000", "MIG-nope", "0000:ff:00.0", "%00", "-1", "a" * 300]
BAD_BODIES = [{"gpu": 0}, {"gpu": 0, "pids": [1], "processes": []}, {"gpu": 0, "processes": [{"pid": "1"}]},
              {"gpu": 0, "processes": [{"pid": 1, "x": 1}]}, {"gpu": 0, "processes": [{"pid": 1, "sm_percent": -1}]},
              {"gpu": 0, "processes": [{"pid": 1, "used_memory_mib": 1.5}]}, {"gpu": 0, "processes": [7]},
              {"gpu": 0, "processes": {"pid": 1}}, {"gpu": 0, "pids": [True]}]


async def test_unknown_devices_are_404_and_bad_simulated_processes_400(short_tmp):
    node = await start_daemon(fast(sim_config(short_tmp, "H100-SXM5-80GB:1")))
    try:
        await processes_until(node, "0", lambda b: True)
        for ident in BAD_IDS:
            status, body = await node.get(f"/v1/gpus/{ident}/processes")
            assert status == 404 and body["error"]["code"] == "gpu-not-found", (ident, body)
            assert_matches_openapi("GET", "/v1/gpus/{id}/processes", 404, body)
        for bad in BAD_BODIES:
            status, answer = await node.post("/v1/sim/processes", bad)
            assert status == 400, (bad, answer)
        status, answer = await node.post("/v1/sim/processes", {"gpu": 0, "processes": [
            {"pid": 5, "used_memory_mib": 100_000}]})  # more than the GPU's 80 GB
        assert status == 422 and "used_memory_mib" in answer["error"]["message"], answer

        assert (await node.post("/v1/sim/gpu-lost", {"gpu": 0}))[0] == 200
        body = await processes_until(node, "0", lambda b: b["devices"] and b["devices"][0]["unavailable"])
        assert "lost" in body["devices"][0]["unavailable"] and body["devices"][0]["processes"] == []
    finally:
        await stop_daemon(node)


@pytest.mark.slow
def test_a_reader_who_is_not_admin_sees_every_process(run_gpud, short_tmp, users, sleeper):
    gpud = gpud_for_users(run_gpud, short_tmp)
    gpud.client.request("POST", "/v1/sim/processes", {"gpu": 0, "pids": [sleeper.pid]})

    def seen():
        status, text = curl_as("gpudt-reader", gpud.socket, "GET", "/v1/gpus/0/processes")
        return status == 200 and sleeper.pid in listed(json.loads(text))
    gpud.wait_for(seen, timeout=15, what="the reader seeing the process")
    status, _ = curl_as("gpudt-reader", gpud.socket, "POST", "/v1/sim/processes", {"gpu": 0, "pids": []})
    assert status == 403


# -- real containers -------------------------------------------------------------------------------


@pytest.fixture
def podman_container(short_tmp):
    need_podman_as_root()
    rootfs = minimal_rootfs(short_tmp / "rootfs", "sleep")
    name = f"gpud-test-{os.getpid()}-{time.monotonic_ns()}"
    started = podman(*PODMAN_RUN, "-d", "--name", name, "--read-only", "--rootfs", str(rootfs), "/bin/sleep", "300")
    if started.returncode != 0:
        if IN_CI:
            pytest.fail(f"podman could not run a container: {started.stderr}")
        pytest.skip(f"podman cannot run containers here: {started.stderr.strip()}")
    try:
        inspected = podman("inspect", "--format", "{{.Id}} {{.State.Pid}}", name)
        container_id, pid = inspected.stdout.split()
        yield container_id, int(pid)
    finally:
        podman("rm", "--force", "--time", "0", name)


@pytest.mark.slow
async def test_a_podman_container_owns_its_process(short_tmp, podman_container):
    container_id, pid = podman_container
    node = await start_daemon(fast(sim_config(short_tmp, "H100-SXM5-80GB:1")))
    try:
        status, body = await node.post("/v1/sim/processes", {"gpu": 0, "processes": [
            {"pid": pid, "used_memory_mib": 512}]})
        assert status == 200, body
        body = await processes_until(node, "0", lambda b: pid in listed(b))
        owner = listed(body)[pid]["owner"]
        assert (owner["kind"], owner["container_runtime"], owner["container_id"]) == \
            ("container", "podman", container_id), owner
        assert listed(body)[pid]["comm"] == "sleep"
        text = await metrics(node)
        assert re.search(rf'gpud_process_gpu_memory_used_bytes{{[^}}]*container_runtime="podman",'
                         rf'container_id="{container_id}"', text), text
        podman("rm", "--force", "--time", "0", container_id)
        await processes_until(node, "0", lambda b: pid not in listed(b))
        assert f'pid="{pid}"' not in await metrics(node)
    finally:
        await stop_daemon(node)
