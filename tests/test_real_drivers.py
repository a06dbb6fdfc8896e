"""gpud's NVML paths against drivers as they really behave (issue 10): releasing NVML for a reset,
an event thread that survives lost GPUs, lost GPUs as drivers report them, MIG tables per MIG mode
and driver branch, compute-instance profiles from NVML, non-root users, old drivers, NVLink boards
without a bridge, memory reserved by the driver.

Each test names the source of the driver behaviour it relies on; the simulator models it with the
same source beside it (gpud/nvml/sim/).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pynvml
import pytest
from helpers import answer_until, mig_config, put_layout, start_daemon, stop_daemon, until, until_async
from openapi_check import assert_matches_openapi

from gpud.inventory import _identities, _load_known
from gpud.model.driver import MINIMUM_BRANCH
from gpud.model.inventory import Gpu, MigInfo
from gpud.nvml.health import EventListener, NvmlEvent, read_readings
from gpud.nvml.mig_tables import ReadTables, _shipped, shipped_table
from gpud.nvml.reader import MissingNvmlCall, NodeReader
from gpud.nvml.session import NvmlSession, NvmlUnavailable, SessionState
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim.models import catalog

XID = pynvml.nvmlEventTypeXidCriticalError
H100_PCI_ID = "0x233010DE"  # reference mig-profiles.md §2


def started(preset: str, path: Path, **kwargs) -> SimulatedNvml:
    sim = SimulatedNvml(preset, path, **kwargs)
    sim.nvmlInit()
    return sim


def set_mig(sim: SimulatedNvml, index: int, enabled: bool) -> None:
    """As an administrator would with nvidia-smi -mig, plus the reset Ampere needs (§7.2)."""
    handle = sim.nvmlDeviceGetHandleByIndex(index)
    sim.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE)
    if sim.nvmlDeviceGetMigMode(handle)[0] != sim.nvmlDeviceGetMigMode(handle)[1]:
        sim.nvmlShutdown()
        sim.sim_reset_gpu(index)
        sim.nvmlInit()


@pytest.fixture
def as_nobody(monkeypatch):
    """gpud running as an unprivileged user: the simulator reads os.geteuid() at each call, as the
    driver checks the caller's capabilities (MIG user guide, "Device Nodes and Capabilities")."""
    monkeypatch.setattr(os, "geteuid", lambda: 65534)


# -- 1. NVML released for a GPU reset ----------------------------------------------------------


async def test_release_shuts_nvml_down_and_calls_wait_until_it_is_back(tmp_path):
    # A reset needs every NVML client gone, gpud's own session included (nvidia-smi's manual, -r;
    # reference README.md corrections): the simulator counts nvmlInit references as NVML does.
    sim = SimulatedNvml("A100-SXM4-40GB:2", tmp_path / "sim.json")
    session = NvmlSession(sim)
    await session.initialise()
    order = []

    async def before_async():
        await asyncio.sleep(0)
        order.append(("before", sim._init_count))

    session.on_release(before_async, lambda: order.append(("after", sim._init_count)))
    async with session.released("gpu reset"):
        assert sim._init_count == 0 and session.state is SessionState.RELEASED
        waiting = asyncio.ensure_future(session.call(lambda nvml: nvml.nvmlDeviceGetCount()))
        await asyncio.sleep(0.05)  # fixed time: a call made while NVML is released waits, and does not fail
        assert not waiting.done()
    assert await asyncio.wait_for(waiting, 2) == 2
    assert session.state is SessionState.READY and sim._init_count == 1
    assert order == [("before", 1), ("after", 1)]  # before NVML went down, after it came back
    await session.stop()


async def test_a_failed_reset_still_brings_nvml_back(tmp_path):
    sim = SimulatedNvml("A100-SXM4-40GB:1", tmp_path / "sim.json")
    session = NvmlSession(sim)
    await session.initialise()
    with pytest.raises(RuntimeError, match="reset failed"):
        async with session.released("gpu reset"):
            raise RuntimeError("reset failed")
    assert session.state is SessionState.READY
    assert await session.call(lambda nvml: nvml.nvmlDeviceGetCount()) == 1
    await session.stop()


async def test_nvml_that_does_not_come_back_fails_waiting_calls_and_is_retried(tmp_path):
    sim_state = tmp_path / "sim.json"
    sim = SimulatedNvml("A100-SXM4-40GB:1", sim_state)
    session = NvmlSession(sim, retry_initial_s=0.02, retry_max_s=0.05)
    await session.initialise()
    resumed = asyncio.Event()
    session.on_release(lambda: None, resumed.set)
    good = sim_state.read_bytes()
    async with session.released("gpu reset"):
        sim_state.write_text("{broken")  # nvmlInit fails on it: NVML stays down after the reset
        waiting = asyncio.ensure_future(session.call(lambda nvml: nvml.nvmlDeviceGetCount()))
    with pytest.raises(NvmlUnavailable, match="did not come back"):
        await asyncio.wait_for(waiting, 2)
    assert session.state is SessionState.UNAVAILABLE
    sim_state.write_bytes(good)
    await asyncio.wait_for(resumed.wait(), 5)  # retried in the background, then the after hooks
    assert session.state is SessionState.READY
    await session.stop()


async def test_release_stops_the_event_thread_and_registers_every_gpu_again(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100"))
    try:
        listener = node.daemon.health.events._listener
        until(lambda: len(listener.registered) == 8, what="8 GPUs registered")
        sim = node.daemon.session.nvml
        sim.sim_set_gpu_lost(3)
        async with node.daemon.session.released("gpu reset"):
            assert not listener.running and sim._init_count == 0
            sim.sim_reset_gpu(3)  # a reset brings a lost GPU back (works with NVML shut down)
        await asyncio.to_thread(until, lambda: len(listener.registered) == 8, 5, "GPU 3 registered again")
        assert listener.running
    finally:
        await stop_daemon(node)


# -- 2. The event thread survives ----------------------------------------------------------------


class Collected:
    def __init__(self):
        self.events: list[NvmlEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: NvmlEvent) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, kind: str) -> list[NvmlEvent]:
        with self._lock:
            return [e for e in self.events if e.kind == kind]


@pytest.fixture
def listening(tmp_path):
    sim = started("A100-SXM4-40GB:2", tmp_path / "sim.json")
    events = Collected()
    listener = EventListener(sim, events, retry_unregistered_s=0.1)
    listener.start()
    until(lambda: len(listener.registered) == 2, what="both GPUs registered")
    yield sim, listener, events
    listener.stop()
    sim.nvmlShutdown()


@pytest.mark.parametrize("how", ["unknown", "is-lost"])
def test_a_lost_gpu_is_reported_once_and_xids_of_other_gpus_still_arrive(listening, how):
    # A set with a lost GPU registered answers every wait with GPU_IS_LOST at once (nvml.h,
    # nvmlEventSetWait_v2; the simulator's model, gpud/nvml/sim/_event_calls.py).
    sim, listener, events = listening
    gpu0, gpu1 = (sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1))
    sim.sim_set_gpu_lost(0, how=how)
    until(lambda: events.of("lost"), what="the lost event")
    cpu_before = time.process_time()
    time.sleep(0.5)  # fixed time: the CPU this process uses over it is what is measured
    assert time.process_time() - cpu_before < 0.1  # no spinning on the answer that comes at once
    assert [e.gpu for e in events.of("lost")] == [gpu0]  # once, not once per wait
    assert set(listener.registered) == {gpu1}
    sim.sim_inject_xid(1, 79)
    xid = until(lambda: events.of("xid"), what="the XID of GPU 1")
    assert (xid[0].gpu, xid[0].xid) == (gpu1, 79)
    assert (xid[0].gi_id, xid[0].ci_id) == (None, None)  # NVML's 0xFFFFFFFF: attributed to no MIG instance
    assert listener.running


def test_a_gpu_that_comes_back_is_registered_again(listening):
    sim, listener, events = listening
    gpu0 = sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetHandleByIndex(0))
    sim.sim_set_gpu_lost(0)
    until(lambda: events.of("lost"), what="the lost event")
    sim.sim_recover_gpu(0)
    until(lambda: events.of("back"), what="the GPU back")
    assert events.of("back")[0].gpu == gpu0 and gpu0 in listener.registered
    sim.sim_inject_xid(0, 48)
    assert until(lambda: events.of("xid"), what="an XID of GPU 0")[0].gpu == gpu0


def test_a_gpu_lost_before_the_start_leaves_the_others_listened_to(tmp_path):
    sim = started("A100-SXM4-40GB:3", tmp_path / "sim.json")
    sim.sim_set_gpu_lost(1)  # registering events on a lost GPU fails (simulator, _event_calls.py)
    events = Collected()
    listener = EventListener(sim, events)
    listener.start()
    try:
        until(lambda: len(listener.registered) == 2, what="GPUs 0 and 2 registered")
        assert 1 in listener.unregistered and not events.of("lost")  # the inventory tells that one
        sim.sim_inject_xid(2, 79)
        assert until(lambda: events.of("xid"), what="the XID of GPU 2")[0].xid == 79
    finally:
        listener.stop()
        sim.nvmlShutdown()


def test_errors_outside_the_wait_back_off_and_never_end_the_thread(tmp_path):
    """NVML shut down under the thread: every call answers UNINITIALIZED (pynvml; our capture,
    shutdown_twice) until it is back. The thread backs off instead of spinning, then recovers."""
    sim = started("A100-SXM4-40GB:1", tmp_path / "sim.json")
    events = Collected()
    listener = EventListener(sim, events)
    listener.start()
    until(lambda: listener.registered, what="GPU 0 registered")
    sim.nvmlShutdown()
    time.sleep(1.0)  # fixed time: how many rebuilds the backoff allows in a second is what is measured
    failures = listener.rebuilds
    assert listener.running and 2 <= failures <= 8  # 0.05 s doubling: a handful in a second, not thousands
    assert len(events.of("error")) == 1  # told once per outage
    assert listener.registered == {}  # no set: nothing is registered
    sim.nvmlInit()
    until(lambda: listener.registered, timeout=8, what="registered again")
    sim.sim_inject_xid(0, 79)
    assert until(lambda: events.of("xid"), what="an XID after the outage")
    listener.stop()
    sim.nvmlShutdown()


@pytest.mark.slow
def test_gpud_with_a_lost_gpu_stays_under_5_percent_of_a_core(run_gpud):
    gpud = run_gpud("--simulate", "dgx-a100", "--log-level", "warning")
    gpud.wait_healthy()
    gpud.client.request("POST", "/v1/sim/gpu-lost", {"gpu": 0})
    gpud.wait_for(lambda: gpud.client.get("/v1/gpus/0")["lost"], what="GPU 0 lost in the inventory")
    time.sleep(1.0)  # fixed time: the one-time work of the loss is over before the measured window

    def cpu_seconds() -> float:
        fields = Path(f"/proc/{gpud.proc.pid}/stat").read_text().rsplit(") ", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before, started_at = cpu_seconds(), time.monotonic()
    time.sleep(10)  # fixed time: the window the CPU use is measured over
    percent = (cpu_seconds() - before) / (time.monotonic() - started_at) * 100
    assert percent < 5, f"gpud used {percent:.1f}% of a core with GPU 0 lost"
    gpud.client.request("POST", "/v1/sim/xid", {"gpu": 1, "xid": 79})
    gpud.wait_for(lambda: gpud.client.get("/v1/gpus/1/health")["state"] == "unhealthy", what="XID on GPU 1")


# -- 3. Lost GPUs from the errors real drivers give -----------------------------------------------


@pytest.mark.parametrize("how, code", [("unknown", pynvml.NVML_ERROR_UNKNOWN),
                                       ("is-lost", pynvml.NVML_ERROR_GPU_IS_LOST)])
def test_the_reader_marks_a_gpu_lost_from_unknown_and_gpu_is_lost(tmp_path, how, code):
    # A GPU that fell off the bus mostly answers UNKNOWN ("Unable to determine the device handle
    # for GPU ...: Unknown Error"), otherwise GPU_IS_LOST (nvml.h); simulator sim_set_gpu_lost.
    sim = started("A100-SXM4-40GB:2", tmp_path / "sim.json")
    reader = NodeReader()
    first = reader.read(sim, {})
    sim.sim_set_gpu_lost(1, how=how)
    known = {gpu.index: gpu for gpu in first.gpus}
    second = reader.read(sim, known)
    lost = second.gpus[1]
    assert lost.lost and f"NVML error {code}" in lost.error
    identity = lambda gpu: (gpu.uuid, gpu.pci_bus_id, gpu.minor_number)  # noqa: E731
    assert identity(lost) == identity(known[1])
    assert not second.gpus[0].lost and second.gpus[0].error is None
    sim.sim_recover_gpu(1)
    again = reader.read(sim, known).gpus[1]
    assert not again.lost and again.error is None and again.uuid == known[1].uuid


async def test_a_lost_gpu_is_unhealthy_with_the_drivers_answer(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100"))
    try:
        assert (await node.post("/v1/sim/gpu-lost", {"gpu": 4, "how": "unknown"}))[0] == 200
        await node.daemon.inventory.refresh("test")
        _, gpu = await node.get("/v1/gpus/4")
        assert gpu["lost"] and "Unknown Error" in gpu["error"]
        _, health = await node.get("/v1/gpus/4/health")
        (reason,) = health["reasons"]
        assert health["state"] == "unhealthy" and reason["kind"] == "lost" and "Unknown Error" in reason["message"]
    finally:
        await stop_daemon(node)


def test_health_readings_treat_unknown_as_lost(tmp_path):
    sim = started("A100-SXM4-40GB:2", tmp_path / "sim.json")
    uuids = [sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)]
    sim.sim_set_gpu_lost(0, how="unknown")
    readings = read_readings(sim, uuids)
    assert readings[uuids[0]] is None and readings[uuids[1]] is not None


# -- 4. MIG profile tables per MIG mode and driver branch -----------------------------------------


def test_r535_with_mig_off_uses_the_shipped_table_then_reads_nvmls_once_mig_is_on(tmp_path):
    # R535 answers NOT_SUPPORTED to GI profile queries while MIG is off (NVIDIA mig-parted commit
    # 219e780d; reference README.md corrections); with MIG on it answers.
    sim = started("hgx-h100", tmp_path / "sim.json", driver="535.183.01")
    profiles_path = tmp_path / "state" / "mig-profiles.json"
    reader = NodeReader(profiles_path)
    off = reader.read(sim, {}).gpus[0].mig
    assert off.profiles_source == "shipped" and not profiles_path.exists()
    assert off.capabilities == shipped_table(H100_PCI_ID).capabilities
    set_mig(sim, 0, True)
    on = reader.read(sim, {}).gpus[0].mig
    assert on.profiles_source == "nvml"
    assert [p.name for p in on.capabilities.gi_profiles] == \
        [p.name for p in sorted(off.capabilities.gi_profiles, key=lambda p: p.constant)]
    uuid = reader.read(sim, {}).gpus[0].uuid
    saved = json.loads(profiles_path.read_text())[uuid]
    assert saved["pci_device_id"] == H100_PCI_ID and saved["driver_version"] == "535.183.01"
    set_mig(sim, 0, False)
    again = reader.read(sim, {}).gpus[0].mig
    assert again.profiles_source == "last-read" and again.capabilities == on.capabilities
    # A new gpud (a restart) finds the table it read before on disk.
    assert NodeReader(profiles_path).read(sim, {}).gpus[0].mig.profiles_source == "last-read"


def test_r580_answers_the_table_with_mig_off(tmp_path):
    # Our H100 capture on 580.159.04 (tests/fixtures/hardware/...): gip_v1/v2 answer with MIG disabled.
    sim = started("hgx-h100", tmp_path / "sim.json", driver="580.65.06")
    mig = NodeReader().read(sim, {}).gpus[0].mig
    assert mig.mode == "disabled" and mig.profiles_source == "nvml"
    assert {p.name for p in mig.capabilities.gi_profiles} == \
        {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}


def test_the_table_is_read_again_after_a_mode_change(tmp_path):
    sim = started("hgx-h100", tmp_path / "sim.json", driver="535.183.01")
    reader = NodeReader()
    assert reader.read(sim, {}).gpus[0].mig.profiles_source == "shipped"
    set_mig(sim, 0, True)
    assert reader.read(sim, {}).gpus[0].mig.profiles_source == "nvml"


def test_a_broken_profiles_file_is_ignored(tmp_path):
    path = tmp_path / "mig-profiles.json"
    path.write_text("[1, 2")
    assert ReadTables(path).get("GPU-x") is None
    path.write_text(json.dumps({"GPU-x": {"table": {"memory_slices": 8, "gi_profiles": [{"id": "x"}]}}}))
    assert ReadTables(path).get("GPU-x") is None


async def test_r535_hgx_h100_applies_all_1g_10gb(short_tmp):
    config = mig_config(short_tmp, "hgx-h100").with_overrides(sim_driver="535.183.01")
    node = await start_daemon(config)
    try:
        assert (await node.get("/v1/node"))[1]["driver_version"] == "535.183.01"
        _, gpus = await node.get("/v1/gpus")
        assert {g["mig"]["profiles_source"] for g in gpus["gpus"]} == {"shipped"}
        assert_matches_openapi("GET", "/v1/gpus", 200, gpus)
        status, body = await put_layout(node, "all-1g.10gb")
        assert status == 200, body
        _, gpus = await node.get("/v1/gpus")
        assert [len(g["mig"]["devices"]) for g in gpus["gpus"]] == [7] * 8
        assert {g["mig"]["profiles_source"] for g in gpus["gpus"]} == {"nvml"}
    finally:
        await stop_daemon(node)


def test_reference_tables_are_the_shipped_data():
    tables = _shipped()[2]
    assert set(tables) >= {"A100-SXM4-40GB", "A100-SXM4-80GB", "A30", "H100-80GB", "H100-NVL-94GB",
                                     "H200", "B200"}
    for pci_id, model in [("0x20B010DE", "A100-SXM4-40GB"), ("0x20F110DE", "A100-SXM4-40GB"),
                          ("0x20B510DE", "A100-SXM4-80GB"), ("0x233110DE", "H100-80GB"),
                          ("0x232110DE", "H100-NVL-94GB"),
                          ("0x233510DE", "H200"), ("0x290110DE", "B200"), ("0x20B710DE", "A30")]:
        assert shipped_table(pci_id).capabilities == tables[model].capabilities
    assert shipped_table("0x1EB810DE") is None and shipped_table("garbage") is None  # T4: no MIG


def test_shipped_constants_are_nvml_h_values():
    gi_constants, ci_by_slices, _ = _shipped()
    for name, value in gi_constants.items():
        assert getattr(pynvml, f"NVML_GPU_INSTANCE_PROFILE_{name}") == value
    for slices, value in ci_by_slices.items():
        assert getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE") == value


# -- 5. Compute-instance profiles and placements from NVML ---------------------------------------


def test_ci_profiles_are_read_through_an_existing_gpu_instance(tmp_path):
    # NVML tells CI profiles only through a GI (nvml.h, nvmlGpuInstanceGetComputeInstanceProfileInfo);
    # the simulator answers every constant (NOT_SUPPORTED for one the GI does not offer).
    sim = started("A100-SXM4-40GB:1", tmp_path / "sim.json")
    set_mig(sim, 0, True)
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    sim.nvmlDeviceCreateGpuInstance(handle, 5)  # 4g.20gb: NVML describes its CI profiles now
    mig = NodeReader().read(sim, {}).gpus[0].mig
    four = mig.capabilities.gi_profile("4g.20gb")
    assert four.ci_source == "nvml" and mig.capabilities.gi_profile("3g.20gb").ci_source == "derived"
    # what the driver model offers in that GI, from its data (gpud/nvml/sim/models.yaml), not NVML calls
    offered = catalog().models["A100-SXM4-40GB"].mig.by_id(5).compute_profiles
    expected = [(ci.slice_count, tuple(sorted(span.start for span in ci.spans))) for ci in offered]
    assert sorted((ci.slices, ci.starts) for ci in four.ci_profiles) == sorted(expected)
    assert four.whole_ci.slices == 4  # §4.2: a 4g GI has no 3c profile, and the whole one comes last
    assert 3 not in [ci.slices for ci in four.ci_profiles]


def test_a30_instance_counts_come_from_the_shipped_table(tmp_path):
    # NVML reports wrong instance counts on A30; mig-parted hard-codes them (pkg/mig/discovery/
    # discovery.go @ ab1c1452; reference migparted.md §2). The simulator's A30 models that.
    sim = started("a30", tmp_path / "sim.json")
    set_mig(sim, 0, True)
    mig = NodeReader().read(sim, {}).gpus[0].mig
    assert mig.profiles_source == "nvml"
    counts = {p.name: p.instance_count for p in mig.capabilities.gi_profiles}
    assert counts == {"1g.6gb": 4, "1g.6gb+me": 1, "2g.12gb": 2, "2g.12gb+me": 1, "4g.24gb": 1}
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    reported = {p.name: sim.nvmlDeviceGetGpuInstanceProfileInfo(handle, p.constant).instanceCount
                for p in mig.capabilities.gi_profiles}
    assert reported != counts  # what the driver said was corrected


def test_other_gpus_keep_the_instance_counts_nvml_reports(tmp_path):
    sim = started("A100-SXM4-40GB:1", tmp_path / "sim.json")
    set_mig(sim, 0, True)
    capabilities = NodeReader().read(sim, {}).gpus[0].mig.capabilities
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    assert all(p.instance_count == sim.nvmlDeviceGetGpuInstanceProfileInfo(handle, p.constant).instanceCount
               for p in capabilities.gi_profiles)


# -- 6. Non-root ---------------------------------------------------------------------------------


def test_no_permission_degrades_only_the_mig_instances(tmp_path, as_nobody):
    # GI/CI enumeration needs the MIG capabilities (MIG user guide, "Device Nodes and
    # Capabilities"); every other read works as uid 65534 (our capture: probe-nobody.json).
    path = tmp_path / "sim.json"
    with pytest.MonkeyPatch.context() as root:
        root.setattr(os, "geteuid", lambda: 0)
        sim = started("A100-SXM4-40GB:2", path)
        set_mig(sim, 0, True)
        gi = sim.nvmlDeviceCreateGpuInstance(sim.nvmlDeviceGetHandleByIndex(0), 9)
        sim.nvmlGpuInstanceCreateComputeInstance(gi, 2)
    gpu0, gpu1 = NodeReader().read(sim, {}).gpus
    assert not gpu0.lost and gpu0.error is None and gpu0.mig.mode == "enabled"
    assert gpu0.unreadable == ("mig.instances: needs root (NVML NO_PERMISSION)",)
    assert gpu0.mig.devices == () and gpu0.mig.profiles_source == "nvml"
    assert gpu1.unreadable == () and gpu1.error is None


# -- 7. Drivers gpud does not support --------------------------------------------------------------


async def test_an_old_driver_leaves_nvml_unavailable_and_is_retried(tmp_path):
    sim = SimulatedNvml("A100-SXM4-40GB:1", tmp_path / "sim.json", driver="470.57.02")
    session = NvmlSession(sim, retry_initial_s=0.01, retry_max_s=0.02)
    task = asyncio.ensure_future(session.initialise())
    # NVML is not held for nothing: between attempts it is shut down again (during one it is held, so the
    # test waits for a moment between two: a leak would keep the count above 0 for good).
    await until_async(lambda: session.init_attempts >= 3 and sim._init_count == 0,
                      what="three attempts to initialise, NVML shut down after each")
    assert session.state is SessionState.UNAVAILABLE
    assert "470.57.02" in session.error and f"R{MINIMUM_BRANCH}" in session.error
    with pytest.raises(NvmlUnavailable, match="470.57.02"):
        await session.call(lambda nvml: nvml.nvmlDeviceGetCount())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await session.stop()


async def test_healthz_and_node_say_the_driver_is_too_old(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100").with_overrides(sim_driver="470.57.02"),
                              healthy=False)
    try:
        status, body = await answer_until(node, "/healthz", lambda _, body: body.get("status") == "unavailable")
        assert status == 503 and f"R{MINIMUM_BRANCH}" in body["reason"] and "470.57.02" in body["reason"]
    finally:
        await stop_daemon(node)


async def test_node_shows_the_minimum_branch_and_whether_the_driver_is_supported(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100"))
    try:
        _, body = await node.get("/v1/node")
        assert_matches_openapi("GET", "/v1/node", 200, body)
        assert body["minimum_driver_branch"] == MINIMUM_BRANCH and body["driver_supported"] is True
    finally:
        await stop_daemon(node)


class DriverWithout(SimulatedNvml):
    """A driver missing some calls: pynvml raises NVMLError_FunctionNotFound for a symbol the
    library lacks (_nvmlGetFunctionPointer), NVMLLibraryMismatchError from its unversioned wrappers
    (throwOnVersionMismatch) — the latter is not an NVMLError."""

    missing: dict[str, type] = {}

    def __getattribute__(self, name):
        missing = type(self).missing
        if name in missing:
            error = missing[name]

            def call(*args, **kwargs):
                if error is pynvml.NVMLLibraryMismatchError:
                    raise pynvml.NVMLLibraryMismatchError("Unversioned function called")
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return call
        return super().__getattribute__(name)


def test_missing_optional_calls_leave_fields_out(tmp_path):
    class Driver(DriverWithout):
        missing = {"nvmlDeviceGetMinorNumber": pynvml.NVMLError, "nvmlDeviceGetSerial": pynvml.NVMLError,
                   "nvmlDeviceGetComputeRunningProcesses": pynvml.NVMLLibraryMismatchError}

    sim = Driver("A100-SXM4-40GB:1", tmp_path / "sim.json")
    sim.nvmlInit()
    set_mig(sim, 0, True)
    sim.nvmlGpuInstanceCreateComputeInstance(sim.nvmlDeviceCreateGpuInstance(sim.nvmlDeviceGetHandleByIndex(0), 9), 2)
    (gpu,) = NodeReader().read(sim, {}).gpus
    assert gpu.minor_number is None and gpu.serial is None and gpu.error is None
    assert len(gpu.mig.devices) == 1 and gpu.mig.devices[0].pids == ()


def test_a_missing_required_call_is_a_clear_error(tmp_path):
    class Driver(DriverWithout):
        missing = {"nvmlDeviceGetCudaComputeCapability": pynvml.NVMLError}

    sim = Driver("A100-SXM4-40GB:1", tmp_path / "sim.json")
    sim.nvmlInit()
    with pytest.raises(MissingNvmlCall, match=f"nvmlDeviceGetCudaComputeCapability.*R{MINIMUM_BRANCH}"):
        NodeReader().read(sim, {})


# -- 8. NVLink ---------------------------------------------------------------------------------


async def test_a_pcie_board_without_a_bridge_stays_healthy(short_tmp):
    # NVLink-capable PCIe boards without a bridge report every link present but inactive
    # (reference README.md corrections; simulator model A100-PCIE-80GB).
    node = await start_daemon(mig_config(short_tmp, "A100-PCIE-80GB:2"))
    try:
        health = node.daemon.health
        await health.check_once()
        readings = next(iter(health.readings.values()))
        assert readings.nvlinks_up and not any(readings.nvlinks_up)
        _, view = await node.get("/v1/health")
        assert view["status"] == "healthy", view
    finally:
        await stop_daemon(node)


async def test_links_that_were_up_and_go_down_are_a_fault(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        sim, health = node.daemon.session.nvml, node.daemon.health
        await health.check_once()  # every link seen up
        for link in range(12):
            sim.sim_set_nvlink(0, link, up=False)
        await health.check_once()
        _, gpu = await node.get("/v1/gpus/0/health")
        assert gpu["state"] == "unhealthy" and "every NVLink link that was up" in gpu["reasons"][0]["message"]
    finally:
        await stop_daemon(node)


async def test_links_seen_up_are_remembered_across_restarts(short_tmp):
    from gpud.events import EventBus
    from gpud.health.catalog import load_catalog
    from gpud.health.service import HealthService

    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    path = short_tmp / "nvlinks.json"
    try:
        first = HealthService(node.daemon.session, node.daemon.inventory, EventBus(), load_catalog(),
                              nvlinks_path=path)
        await first.check_once()
        second = HealthService(node.daemon.session, node.daemon.inventory, EventBus(), load_catalog(),
                               nvlinks_path=path)
        second.load()
        seen = first.gpu_checks.nvlinks_ever_up
        assert second.gpu_checks.nvlinks_ever_up == seen and len(next(iter(seen.values()))) == 12
    finally:
        await stop_daemon(node)


# -- 9. Memory, +gfx, minor numbers ------------------------------------------------------------------


def test_used_memory_leaves_out_what_the_driver_reserves(tmp_path):
    # Our H100 capture on 580: v1 used = 480 MiB = v2 reserved; v2 used = 0. nvidia-smi shows v2's.
    sim = started("hgx-h100", tmp_path / "sim.json", driver="580.65.06")
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    v1 = sim.nvmlDeviceGetMemoryInfo(handle)
    v2 = sim.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    assert v2.reserved > 0 and v1.used == v2.used + v2.reserved
    uuid = sim.nvmlDeviceGetUUID(handle)
    assert read_readings(sim, [uuid])[uuid].fb_used_mib == v2.used >> 20


def test_three_slice_graphics_profiles_are_named_gfx(tmp_path):
    # NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX (0x11, nvml.h 13.x) is a graphics-capable profile:
    # "+gfx" in NVIDIA's naming (go-nvlib; reference mig-profiles.md §4.4).
    class Driver(SimulatedNvml):
        def nvmlDeviceGetGpuInstanceProfileInfo(self, device, profile, version=2):
            if profile == pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX:
                info = super().nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE,
                                                                   version)
                return info
            return super().nvmlDeviceGetGpuInstanceProfileInfo(device, profile, version)

    from gpud.nvml.mig import read_capabilities
    sim = Driver("A100-SXM4-40GB:1", tmp_path / "sim.json")
    sim.nvmlInit()
    set_mig(sim, 0, True)
    names = [p.name for p in read_capabilities(sim, sim.nvmlDeviceGetHandleByIndex(0), 40960).gi_profiles]
    assert "3g.20gb+gfx" in names and "3g.20gb" in names


def test_the_inventory_has_each_gpus_minor_number(tmp_path):
    sim = started("A100-SXM4-40GB:3", tmp_path / "sim.json")
    gpus = NodeReader().read(sim, {}).gpus
    assert [g.minor_number for g in gpus] == [sim.nvmlDeviceGetMinorNumber(sim.nvmlDeviceGetHandleByIndex(i))
                                              for i in range(3)]
    assert all(isinstance(g.minor_number, int) for g in gpus)


def test_known_gpus_keep_their_minor_number(tmp_path):
    # The reset of a lost GPU needs /dev/nvidia<minor>: it is kept with the rest of its identity.
    gpu = Gpu(index=0, uuid="GPU-a", name="n", pci_bus_id="b", pci_device_id="0x20B010DE", memory_total_mib=1,
              compute_mode="default", architecture="ampere", cuda_compute_capability="8.0", serial=None,
              mig=MigInfo(capable=False, mode=None, pending_mode=None), minor_number=5)
    path = tmp_path / "known.json"
    path.write_text(json.dumps(_identities({0: gpu})))
    assert _load_known(path)[0].minor_number == 5
