"""Event sets, Xid/ECC injection and lost GPUs (§8)."""

import statistics
import threading
import time

import pynvml
import pytest
from helpers import asleep_in, until

from gpud.nvml.sim import SimError
from gpud.nvml.sim.scenarios import enable_mig, reset_released, started

XID = pynvml.nvmlEventTypeXidCriticalError
SBE = pynvml.nvmlEventTypeSingleBitEccError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
NOT_ATTRIBUTED = 0xFFFFFFFF


@pytest.fixture
def nvml(tmp_path):
    return started("dgx-a100", tmp_path / "state.json")


def subscribe(nvml, index, event_types):
    event_set = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(index), event_types, event_set)
    return event_set


class Waiter(threading.Thread):
    """Waits on an event set in another thread, as gpud's health loop does."""

    def __init__(self, nvml, event_set, timeout_ms=2000):
        super().__init__(daemon=True)
        self.nvml, self.event_set, self.timeout_ms = nvml, event_set, timeout_ms
        self.result = self.error = self.woke_at = None
        self.start()

    def run(self):
        try:
            self.result = self.nvml.nvmlEventSetWait_v2(self.event_set, self.timeout_ms)
        except pynvml.NVMLError as error:
            self.error = error
        self.woke_at = time.perf_counter()


def wait_until_blocked(waiter: Waiter) -> None:
    until(lambda: asleep_in(waiter, "nvmlEventSetWait_v2"), what="the waiter asleep in nvmlEventSetWait_v2")


def test_supported_event_types_follow_ecc(tmp_path):
    a100 = started("dgx-a100", tmp_path / "a.json")
    geforce = started("rtx-2080ti", tmp_path / "g.json")
    supported = a100.nvmlDeviceGetSupportedEventTypes(a100.nvmlDeviceGetHandleByIndex(0))
    assert supported & (XID | SBE | DBE) == XID | SBE | DBE
    device = geforce.nvmlDeviceGetHandleByIndex(0)
    assert geforce.nvmlDeviceGetSupportedEventTypes(device) & (SBE | DBE) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        geforce.nvmlDeviceRegisterEvents(device, XID | DBE, geforce.nvmlEventSetCreate())


def test_wait_times_out(nvml):
    event_set = subscribe(nvml, 0, XID)
    started_at = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(event_set, 50)
    assert 0.045 <= time.monotonic() - started_at < 1


def test_xid_reaches_a_waiting_thread_promptly(nvml):
    event_set = subscribe(nvml, 3, XID)
    latencies = []
    for _ in range(5):
        waiter = Waiter(nvml, event_set)
        wait_until_blocked(waiter)
        injected_at = time.perf_counter()
        nvml.sim_inject_xid(3, 79)
        waiter.join(2)
        latencies.append(waiter.woke_at - injected_at)
        data = waiter.result
        assert (data.eventType, data.eventData) == (XID, 79)
        assert (data.gpuInstanceId, data.computeInstanceId) == (NOT_ATTRIBUTED, NOT_ATTRIBUTED)
        assert nvml.nvmlDeviceGetIndex(data.device) == 3
    assert statistics.median(latencies) < 0.005, latencies


def test_xid_carries_gpu_and_compute_instance_ids(nvml):
    device = enable_mig(nvml, 0)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, 9)
    nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 2)
    event_set = subscribe(nvml, 0, XID)
    nvml.sim_inject_xid(nvml.nvmlDeviceGetUUID(device), 43, gi_id=2, ci_id=0)
    data = nvml.nvmlEventSetWait_v2(event_set, 0)
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (43, 2, 0)


def test_events_go_only_to_sets_that_registered_them(nvml):
    xid_on_0 = subscribe(nvml, 0, XID)
    dbe_on_0 = subscribe(nvml, 0, DBE)
    xid_on_1 = subscribe(nvml, 1, XID)
    nvml.sim_inject_xid(0, 13)
    assert nvml.nvmlEventSetWait(xid_on_0, 0).eventData == 13
    for other in (dbe_on_0, xid_on_1):
        with pytest.raises(pynvml.NVMLError_Timeout):
            nvml.nvmlEventSetWait_v2(other, 0)


def test_inject_xid_validates_its_target(nvml):
    enable_mig(nvml, 0)
    for gpu, kwargs in [(8, {}), ("GPU-nope", {}), (0, {"gi_id": 1}), (1, {"ci_id": 0}), (0, {"xid": -1})]:
        arguments = {"xid": 79, **kwargs}
        with pytest.raises(SimError):
            nvml.sim_inject_xid(gpu, **arguments)
    nvml.nvmlDeviceCreateGpuInstance(nvml.nvmlDeviceGetHandleByIndex(0), 9)
    with pytest.raises(SimError, match="no compute instance 0"):
        nvml.sim_inject_xid(0, 79, gi_id=2, ci_id=0)


def test_ecc_injection_counts_and_signals(nvml):
    device = nvml.nvmlDeviceGetHandleByIndex(2)
    event_set = subscribe(nvml, 2, SBE | DBE)
    nvml.sim_inject_ecc(2, double_bit=False)
    nvml.sim_inject_ecc(2, double_bit=True)
    assert [nvml.nvmlEventSetWait_v2(event_set, 0).eventType for _ in range(2)] == [SBE, DBE]
    total = nvml.nvmlDeviceGetTotalEccErrors
    uncorrected, volatile, aggregate = (
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        pynvml.NVML_VOLATILE_ECC,
        pynvml.NVML_AGGREGATE_ECC,
    )
    assert total(device, uncorrected, volatile) == total(device, uncorrected, aggregate) == 1
    assert nvml.nvmlDeviceGetRemappedRows(device) == (0, 1, 1, 0)
    reset_released(nvml, [2])
    assert (total(device, uncorrected, volatile), total(device, uncorrected, aggregate)) == (0, 1)
    assert nvml.nvmlDeviceGetRemappedRows(device) == (0, 1, 0, 0)


def test_ecc_injection_needs_ecc(tmp_path):
    geforce = started("rtx-2080ti", tmp_path / "state.json")
    with pytest.raises(SimError, match="no ECC"):
        geforce.sim_inject_ecc(0, double_bit=True)


def test_lost_gpu_wakes_the_waiter_and_the_set_keeps_answering_gpu_is_lost(nvml):
    """The error persists while the lost GPU stays registered (Project-HAMi/HAMi#2321)."""
    event_set = subscribe(nvml, 5, XID)
    waiter = Waiter(nvml, event_set)
    wait_until_blocked(waiter)
    nvml.sim_set_gpu_lost(5)
    waiter.join(2)
    assert isinstance(waiter.error, pynvml.NVMLError_GpuIsLost)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlEventSetWait_v2(event_set, 1000)


def test_registering_on_a_mig_device_is_not_supported(nvml):
    device = enable_mig(nvml, 0)
    nvml.nvmlGpuInstanceCreateComputeInstance(nvml.nvmlDeviceCreateGpuInstance(device, 19), 0)
    mig_device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceRegisterEvents(mig_device, XID, nvml.nvmlEventSetCreate())


def test_freeing_a_set_wakes_its_waiter(nvml):
    event_set = subscribe(nvml, 0, XID)
    waiter = Waiter(nvml, event_set)
    wait_until_blocked(waiter)
    nvml.nvmlEventSetFree(event_set)
    waiter.join(2)
    assert isinstance(waiter.error, pynvml.NVMLError_InvalidArgument)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlEventSetWait_v2(event_set, 0)


def test_shutdown_wakes_waiters(nvml):
    event_set = subscribe(nvml, 0, XID)
    waiter = Waiter(nvml, event_set)
    wait_until_blocked(waiter)
    nvml.nvmlShutdown()
    waiter.join(2)
    assert isinstance(waiter.error, pynvml.NVMLError_Uninitialized)


def test_nvlink_pcie_and_page_retirement_readings(tmp_path):
    a100 = started("A100-SXM4-40GB:1", tmp_path / "a.json")
    handle = a100.nvmlDeviceGetHandleByIndex(0)
    assert [a100.nvmlDeviceGetNvLinkState(handle, link) for link in range(12)] == [pynvml.NVML_FEATURE_ENABLED] * 12
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        a100.nvmlDeviceGetNvLinkState(handle, 12)
    a100.sim_set_nvlink(0, 2, up=False)
    assert a100.nvmlDeviceGetNvLinkState(handle, 2) == pynvml.NVML_FEATURE_DISABLED
    a100.sim_add_pcie_replays(0, 7)
    assert a100.nvmlDeviceGetPcieReplayCounter(handle) == 7
    with pytest.raises(pynvml.NVMLError_NotSupported):
        a100.nvmlDeviceGetRetiredPagesPendingStatus(handle)  # Ampere remaps rows instead
    reset_released(a100, [0])
    assert a100.nvmlDeviceGetNvLinkState(handle, 2) == pynvml.NVML_FEATURE_ENABLED

    t4 = started("t4", tmp_path / "t.json")
    t4_handle = t4.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        t4.nvmlDeviceGetNvLinkState(t4_handle, 0)  # a PCIe board
    with pytest.raises(SimError):
        t4.sim_set_nvlink(0, 0, up=False)
    t4.sim_set_retired_pages_pending(0)
    assert t4.nvmlDeviceGetRetiredPagesPendingStatus(t4_handle) == pynvml.NVML_FEATURE_ENABLED
