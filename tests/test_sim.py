"""The simulator as a pynvml stand-in: module surface, devices, MIG devices, faults, persistence."""

import ctypes
import json
import re
import threading
import time

import pynvml
import pytest

from gpud.nvml.sim import PresetError, SimError, SimulatedNvml
from gpud.nvml.sim.scenarios import enable_mig, reset_released, started

MIG_UUID = re.compile(r"MIG-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
NOT_ATTRIBUTED = 0xFFFFFFFF


@pytest.fixture
def state_path(tmp_path):
    return tmp_path / "state.json"


@pytest.fixture
def nvml(state_path):
    return started("dgx-a100", state_path)


def make_mig_devices(nvml, gpu=0):
    """A 1g.5gb at slot 6 (GI 13) with one CI, then a 3g.20gb at 0:4 (GI 1) with a 1c and a 2c."""
    device = enable_mig(nvml, gpu)
    small = nvml.nvmlDeviceCreateGpuInstance(device, 19)
    nvml.nvmlGpuInstanceCreateComputeInstance(small, 0)
    large = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        device, 9, pynvml.c_nvmlGpuInstancePlacement_t(0, 4)
    )
    nvml.nvmlGpuInstanceCreateComputeInstance(large, 0)
    nvml.nvmlGpuInstanceCreateComputeInstance(large, 1)
    return device


def mig_uuids(nvml, device):
    return [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, i)) for i in range(3)]


# --- module surface and lifecycle -------------------------------------------------------------------


def test_pynvml_objects_come_through_unchanged(nvml):
    assert nvml.NVMLError_InUse is pynvml.NVMLError_InUse
    assert nvml.NVMLError is pynvml.NVMLError
    assert nvml.c_nvmlGpuInstancePlacement_t is pynvml.c_nvmlGpuInstancePlacement_t
    assert nvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE == pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE
    assert nvml.nvmlStructToFriendlyObject is pynvml.nvmlStructToFriendlyObject
    assert type(pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)) is pynvml.NVMLError_InUse


def test_functions_it_does_not_simulate_are_function_not_found(nvml):
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nvml.nvmlDeviceGetFanSpeed(nvml.nvmlDeviceGetHandleByIndex(0))
    assert not hasattr(nvml, "_nvmlCheckReturn")  # pynvml internals stay hidden


def test_construction_touches_nothing(state_path):
    nvml = SimulatedNvml("dgx-a100", state_path)
    assert not state_path.exists()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    # sim_* controls are the world outside this process (nvidia-smi -r runs while NVML is shut down
    # here): they work without nvmlInit, on the state file
    nvml.sim_reset_gpu(0)
    assert state_path.exists()


def test_init_and_shutdown_nest(nvml):
    nvml.nvmlInit()
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetCount() == 8
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()


def test_system_versions(nvml):
    assert nvml.nvmlSystemGetDriverVersion() == "550.90.07"
    assert nvml.nvmlSystemGetNVMLVersion() == "12.550.90.07"
    assert nvml.nvmlSystemGetCudaDriverVersion() == nvml.nvmlSystemGetCudaDriverVersion_v2() == 12040


# --- devices ------------------------------------------------------------------------------------------


def test_handles_are_hashable_comparable_and_readable(nvml):
    first = nvml.nvmlDeviceGetHandleByIndex(4)
    again = nvml.nvmlDeviceGetHandleByIndex(4)
    assert first == again and hash(first) == hash(again)
    assert first != nvml.nvmlDeviceGetHandleByIndex(5)
    assert len({first, again}) == 1
    assert repr(first) == "<nvml-sim GPU 4>"
    assert isinstance(first, pynvml.c_nvmlDevice_t)


def test_device_lookup(nvml):
    device = nvml.nvmlDeviceGetHandleByIndex(3)
    uuid = nvml.nvmlDeviceGetUUID(device)
    assert nvml.nvmlDeviceGetHandleByUUID(uuid) == device
    assert nvml.nvmlDeviceGetHandleByUUID(uuid.encode()) == device
    for bus_id in ("00000000:4E:00.0", "0000:4e:00.0", "4E:00.0"):
        assert nvml.nvmlDeviceGetHandleByPciBusId(bus_id) == device
    assert (nvml.nvmlDeviceGetIndex(device), nvml.nvmlDeviceGetMinorNumber(device)) == (3, 3)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByPciBusId("00000000:08:00.0")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByPciBusId("not a bus id")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(8)


def test_device_properties(nvml):
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    pci = nvml.nvmlDeviceGetPciInfo_v3(device)
    assert (pci.busId, pci.bus, pci.domain, pci.device, pci.pciDeviceId) == (
        "00000000:07:00.0",
        7,
        0,
        0,
        0x20B010DE,
    )
    memory = nvml.nvmlDeviceGetMemoryInfo(device)  # v1 counts the driver's reserved 512 MiB as used
    assert (memory.total, memory.used, memory.free) == (40960 * 2**20, 512 * 2**20, 40448 * 2**20)
    assert nvml.nvmlDeviceGetArchitecture(device) == pynvml.NVML_DEVICE_ARCH_AMPERE
    assert nvml.nvmlDeviceGetCudaComputeCapability(device) == (8, 0)
    assert re.fullmatch(r"1\d{12}", nvml.nvmlDeviceGetSerial(device))
    assert nvml.nvmlDeviceGetPersistenceMode(device) == pynvml.NVML_FEATURE_ENABLED


def test_health_readings(nvml):
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetTemperature(device, pynvml.NVML_TEMPERATURE_GPU) == 33
    shutdown = nvml.nvmlDeviceGetTemperatureThreshold(device, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
    slowdown = nvml.nvmlDeviceGetTemperatureThreshold(device, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    assert shutdown > slowdown > 33
    assert 0 < nvml.nvmlDeviceGetPowerUsage(device) < nvml.nvmlDeviceGetEnforcedPowerLimit(device)
    assert nvml.nvmlDeviceGetEccMode(device) == [1, 1]
    assert nvml.nvmlDeviceGetTotalEccErrors(device, 1, pynvml.NVML_AGGREGATE_ECC) == 0
    assert nvml.nvmlDeviceGetRemappedRows(device) == (0, 0, 0, 0)
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(device) == pynvml.nvmlClocksEventReasonGpuIdle


def test_compute_mode(nvml, state_path):
    device = nvml.nvmlDeviceGetHandleByIndex(1)
    nvml.nvmlDeviceSetComputeMode(device, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert started("dgx-a100", state_path).nvmlDeviceGetComputeMode(device) == 3
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceSetComputeMode(device, 7)


def test_t4_is_not_mig_capable(tmp_path):
    nvml = started("t4", tmp_path / "state.json")
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetName(device) == "Tesla T4"
    assert nvml.nvmlDeviceGetMemoryInfo(device).total == 15360 * 2**20
    assert nvml.nvmlDeviceGetArchitecture(device) == pynvml.NVML_DEVICE_ARCH_TURING
    placements = ctypes.c_uint()
    mig_calls = [
        lambda: nvml.nvmlDeviceGetMigMode(device),
        lambda: nvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE),
        lambda: nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, 0),
        lambda: nvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, 19, None, ctypes.byref(placements)),
        lambda: nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 19),
        lambda: nvml.nvmlDeviceCreateGpuInstance(device, 19),
        lambda: nvml.nvmlDeviceGetGpuInstanceById(device, 7),
        lambda: nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0),
    ]
    for call in mig_calls:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(device) == 0
    assert nvml.nvmlDeviceIsMigDeviceHandle(device).value == 0
    assert nvml.nvmlDeviceGetEccMode(device) == [1, 1]  # T4 has ECC
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetRemappedRows(device)  # Turing retires pages instead


def test_geforce_has_no_ecc_and_no_serial(tmp_path):
    nvml = started("rtx-2080ti", tmp_path / "state.json")
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetName(device) == "NVIDIA GeForce RTX 2080 Ti"
    assert nvml.nvmlDeviceGetPciInfo(device).pciDeviceId == 0x1E0710DE
    assert nvml.nvmlDeviceGetMemoryInfo(device).total == 11264 * 2**20
    for call in (
        lambda: nvml.nvmlDeviceGetEccMode(device),
        lambda: nvml.nvmlDeviceGetTotalEccErrors(device, 0, 0),
        lambda: nvml.nvmlDeviceGetSerial(device),
        lambda: nvml.nvmlDeviceGetMigMode(device),
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()


# --- MIG devices ----------------------------------------------------------------------------------


def test_mig_devices_are_ordered_by_gpu_then_compute_instance_id(nvml):
    device = make_mig_devices(nvml)
    handles = [nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, i) for i in range(3)]
    ids = [(nvml.nvmlDeviceGetGpuInstanceId(h), nvml.nvmlDeviceGetComputeInstanceId(h)) for h in handles]
    assert ids == [(1, 0), (1, 1), (13, 0)]
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 3)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(device) == 7


def test_mig_device_properties(nvml):
    device = make_mig_devices(nvml)
    one_c, two_c, small = (nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, i) for i in range(3))
    assert nvml.nvmlDeviceGetName(small) == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    assert nvml.nvmlDeviceGetName(one_c) == "NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb"
    assert nvml.nvmlDeviceGetMemoryInfo(small).total == 4864 * 2**20
    assert nvml.nvmlDeviceGetMemoryInfo(two_c).total == 19968 * 2**20  # the GI's memory
    attributes = nvml.nvmlDeviceGetAttributes(two_c)
    assert (attributes.multiprocessorCount, attributes.gpuInstanceSliceCount) == (28, 3)
    assert (attributes.computeInstanceSliceCount, attributes.memorySizeMB) == (2, 19968)
    assert (attributes.sharedCopyEngineCount, attributes.sharedDecoderCount) == (3, 2)
    is_mig = nvml.nvmlDeviceIsMigDeviceHandle(small)
    assert isinstance(is_mig, ctypes.c_uint) and is_mig.value == 1
    assert nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(small) == device
    assert nvml.nvmlDeviceGetArchitecture(small) == pynvml.NVML_DEVICE_ARCH_AMPERE
    assert repr(small) == "<nvml-sim MIG device gpu=0 gi=13 ci=0>"


def test_mig_only_and_gpu_only_queries(nvml):
    device = make_mig_devices(nvml)
    mig_device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)
    for call in (
        nvml.nvmlDeviceGetAttributes,
        nvml.nvmlDeviceGetGpuInstanceId,
        nvml.nvmlDeviceGetComputeInstanceId,
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(device)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(device)
    for call in (nvml.nvmlDeviceGetPowerUsage, nvml.nvmlDeviceGetPciInfo, nvml.nvmlDeviceGetIndex):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(mig_device)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceCreateGpuInstance(mig_device, 19)


def test_mig_uuids_are_deterministic(nvml):
    device = make_mig_devices(nvml)
    before = mig_uuids(nvml, device)
    assert all(MIG_UUID.fullmatch(uuid) for uuid in before) and len(set(before)) == 3
    assert nvml.nvmlDeviceGetHandleByUUID(before[2]) == nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 2)
    for gi_id in (1, 13):
        gpu_instance = nvml.nvmlDeviceGetGpuInstanceById(device, gi_id)
        for ci_id in (1, 0) if gi_id == 1 else (0,):
            nvml.nvmlComputeInstanceDestroy(nvml.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, ci_id))
        nvml.nvmlGpuInstanceDestroy(gpu_instance)
    make_mig_devices(nvml)
    assert mig_uuids(nvml, device) == before


def test_stale_mig_device_handle_is_not_found(nvml):
    device = make_mig_devices(nvml)
    small = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 2)
    gpu_instance = nvml.nvmlDeviceGetGpuInstanceById(device, 13)
    nvml.nvmlComputeInstanceDestroy(nvml.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, 0))
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetName(small)


# --- processes --------------------------------------------------------------------------------------


def test_processes_without_mig(nvml):
    device = nvml.nvmlDeviceGetHandleByIndex(2)
    nvml.sim_set_processes(2, [101, 102])
    processes = nvml.nvmlDeviceGetComputeRunningProcesses(device)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in processes] == [
        (101, NOT_ATTRIBUTED, NOT_ATTRIBUTED),
        (102, NOT_ATTRIBUTED, NOT_ATTRIBUTED),
    ]
    assert nvml.nvmlDeviceGetMemoryInfo(device, pynvml.nvmlMemory_v2).used == 2 * processes[0].usedGpuMemory > 0
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(device) == pynvml.nvmlClocksEventReasonNone


def test_processes_with_mig(nvml):
    device = make_mig_devices(nvml)
    one_c, two_c, small = mig_uuids(nvml, device)
    nvml.sim_set_processes(small, [7])
    nvml.sim_set_processes(two_c, [8, 9])
    on_parent = nvml.nvmlDeviceGetComputeRunningProcesses_v3(device)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in on_parent] == [
        (8, 1, 1),
        (9, 1, 1),
        (7, 13, 0),
    ]
    on_small = nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByUUID(small))
    assert [p.pid for p in on_small] == [7]
    assert nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByUUID(one_c)) == []
    with pytest.raises(SimError, match="MIG mode"):
        nvml.sim_set_processes(0, [10])
    with pytest.raises(SimError):
        nvml.sim_set_processes("MIG-00000000-0000-5000-8000-000000000000", [10])
    with pytest.raises(SimError):
        nvml.sim_set_processes(small, [0])


# --- lost GPUs and resets -------------------------------------------------------------------------------


def test_lost_gpu_raises_gpu_is_lost_everywhere(nvml, state_path):
    device = make_mig_devices(nvml, gpu=1)
    mig_device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)
    gpu_instance = nvml.nvmlDeviceGetGpuInstanceById(device, 1)
    nvml.sim_set_gpu_lost(nvml.nvmlDeviceGetUUID(device), how="is-lost")
    for call in (
        lambda: nvml.nvmlDeviceGetHandleByIndex(1),
        lambda: nvml.nvmlDeviceGetName(device),
        lambda: nvml.nvmlDeviceGetMemoryInfo(mig_device),
        lambda: nvml.nvmlGpuInstanceGetInfo(gpu_instance),
        lambda: nvml.nvmlDeviceGetMigMode(device),
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0))  # others are fine
    other = started("dgx-a100", state_path)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        other.nvmlDeviceGetHandleByIndex(1)  # persisted
    other.nvmlShutdown()
    reset_released(nvml, [1])  # a reset needs NVML released: this process's session holds the GPUs
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(1)) == "NVIDIA A100-SXM4-40GB"


def test_reset_refuses_while_processes_run_and_clears_instances(nvml):
    device = make_mig_devices(nvml)
    nvml.sim_set_processes(mig_uuids(nvml, device)[0], [55])
    with pytest.raises(pynvml.NVMLError_InUse):
        reset_released(nvml, [0])
    nvml.sim_set_processes(mig_uuids(nvml, device)[0], [])
    reset_released(nvml, [0])
    assert nvml.nvmlDeviceGetMigMode(device) == [1, 1]
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)


def test_sim_resolve(nvml):
    uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(6))
    assert (nvml.sim_resolve(6), nvml.sim_resolve(uuid)) == (6, 6)
    for bad in (8, -1, True, "GPU-x", None):
        with pytest.raises(SimError):
            nvml.sim_resolve(bad)


# --- persistence ------------------------------------------------------------------------------------


def test_a_second_instance_sees_the_same_machine(nvml, state_path):
    device = make_mig_devices(nvml)
    uuids = mig_uuids(nvml, device)
    nvml.sim_set_processes(uuids[1], [31337])
    nvml.sim_add_holder(5, "nv-hostengine", 4242)  # DCGM holds GPU 5: its MIG mode stays pending
    nvml.nvmlDeviceSetMigMode(nvml.nvmlDeviceGetHandleByIndex(5), pynvml.NVML_DEVICE_MIG_ENABLE)
    nvml.sim_set_gpu_lost(7, how="is-lost")
    concurrent = started("dgx-a100", state_path)  # while the first is still running
    nvml.nvmlShutdown()
    for other in (concurrent, started("dgx-a100", state_path)):
        other_device = other.nvmlDeviceGetHandleByIndex(0)
        assert mig_uuids(other, other_device) == uuids
        assert other.nvmlDeviceGetMigMode(other.nvmlDeviceGetHandleByIndex(5)) == [0, 1]
        processes = other.nvmlDeviceGetComputeRunningProcesses(other_device)
        assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in processes] == [(31337, 1, 1)]
        gpu_instance = other.nvmlDeviceGetGpuInstanceById(other_device, 13)
        assert other.nvmlGpuInstanceGetInfo(gpu_instance).placement.start == 6
        with pytest.raises(pynvml.NVMLError_InUse):  # the restored CI still holds the process
            other.nvmlComputeInstanceDestroy(
                other.nvmlGpuInstanceGetComputeInstanceById(
                    other.nvmlDeviceGetGpuInstanceById(other_device, 1), 1
                )
            )
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            other.nvmlDeviceGetHandleByIndex(7)


def test_state_file_is_readable_json_written_atomically(nvml, state_path):
    make_mig_devices(nvml)
    document = json.loads(state_path.read_text())
    assert document["preset"] == "dgx-a100"
    assert [gi["profile"] for gi in document["gpus"][0]["gpu_instances"]] == ["3g.20gb", "1g.5gb"]
    # no temporary files left (beside it, the simulator's sysfs, procfs, device node and driver trees are
    # folders, and its kernel log a file of its own)
    assert sorted(p.name for p in state_path.parent.iterdir() if not p.is_dir()) == ["state.json", "state.json.kmsg"]


def test_state_file_of_another_preset_is_refused(nvml, state_path):
    other = SimulatedNvml("hgx-h100", state_path)
    with pytest.raises(PresetError) as caught:
        other.nvmlInit()
    message = str(caught.value)
    assert str(state_path) in message and "'dgx-a100'" in message and "'hgx-h100'" in message


def test_corrupt_state_file_is_reported(state_path):
    state_path.write_text("{not json")
    with pytest.raises(SimError, match=str(state_path)):
        started("dgx-a100", state_path)


def test_queries_do_not_read_the_state_file(nvml, state_path):
    state_path.unlink()
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    started_at = time.perf_counter()
    for _ in range(2000):
        nvml.nvmlDeviceGetName(device)
        nvml.nvmlDeviceGetMemoryInfo(device)
    assert time.perf_counter() - started_at < 1.0
    assert not state_path.exists()
    nvml.nvmlDeviceSetComputeMode(device, pynvml.NVML_COMPUTEMODE_PROHIBITED)  # a mutation writes it
    assert state_path.exists()


def test_concurrent_calls_are_serialized(nvml):
    devices = [enable_mig(nvml, i) for i in range(4)]
    errors = []

    def churn(device):
        try:
            for _ in range(20):
                gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, 19)
                nvml.nvmlGpuInstanceDestroy(gpu_instance)
        except pynvml.NVMLError as error:
            errors.append(error)

    threads = [threading.Thread(target=churn, args=(device,)) for device in devices * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive(), "the thread thread did not end"
    assert errors == []
    assert all(nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(d, 19) == 7 for d in devices)
