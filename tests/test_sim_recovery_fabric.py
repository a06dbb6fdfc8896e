"""The simulator's GPU recovery action, NVLink fabric, kernel log and driver procfs files, and gpud's
readings of them (gpud.nvml.health.read_readings on the simulator)."""

from __future__ import annotations

import ctypes
import json
import re
import uuid

import pynvml
import pytest

from gpud.nvml.health import FabricReading, fabric_health_bits, read_readings
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim._fabric_calls import DEGRADED_BW_MASK, HEALTHY_MASK
from gpud.nvml.sim.errors import SimError
from gpud.nvml.sim.kernel import KMSG_KEEP_RECORDS, KMSG_MAX_BYTES

XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:]+)\): (\d+),")
KMSG_RECORD = re.compile(r"^(\d+),(\d+),(\d+),-;(.*)$")
NONE = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
GPU_RESET = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
NODE_REBOOT = pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT


def started(tmp_path, preset="hgx-h100", driver="580.65.06", name="state.json"):
    nvml = SimulatedNvml(preset, tmp_path / name, driver)
    nvml.nvmlInit()
    return nvml


def recovery_field(nvml, index=0):
    value = nvml.nvmlDeviceGetFieldValues(nvml.nvmlDeviceGetHandleByIndex(index),
                                          [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
    return value.nvmlReturn, value.value.uiVal


def reading(nvml, index=0):
    uuid_ = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index))
    return read_readings(nvml, [uuid_])[uuid_]


def kmsg_records(nvml):
    return [KMSG_RECORD.match(line).groups() for line in nvml.sim_kmsg_path.read_text().splitlines()]


# --- recovery action -----------------------------------------------------------------------------


@pytest.mark.parametrize("driver, answers", [("535.183.01", False), ("550.90.07", False), ("560.35.03", False),
                                             ("570.124.06", True), ("580.65.06", True)])
def test_field_230_answers_from_r565(tmp_path, driver, answers):
    nvml = started(tmp_path, driver=driver)
    status, value = recovery_field(nvml)
    if answers:
        assert (status, value) == (pynvml.NVML_SUCCESS, NONE)
        assert reading(nvml).recovery_action == NONE
    else:
        assert status == pynvml.NVML_ERROR_NOT_SUPPORTED
        assert reading(nvml).recovery_action is None
    # The other fields of the same call answer whatever the driver: one unknown field fails alone.
    assert reading(nvml).memory_temp_c is not None


def test_xid_sets_the_action_reset_clears_it(tmp_path):
    nvml = started(tmp_path)
    nvml.sim_inject_xid(1, 119)
    assert recovery_field(nvml, 1) == (pynvml.NVML_SUCCESS, GPU_RESET)
    assert reading(nvml, 1).recovery_action == GPU_RESET
    assert reading(nvml, 0).recovery_action == NONE  # another GPU's is its own
    nvml.sim_inject_xid(1, 13)  # an application's Xid: the action stays
    assert reading(nvml, 1).recovery_action == GPU_RESET
    nvml.nvmlShutdown()
    nvml.sim_reset_gpu(1)
    nvml.nvmlInit()
    assert reading(nvml, 1).recovery_action == NONE


def test_node_reboot_outlives_a_reset_until_reboot(tmp_path):
    nvml = started(tmp_path)
    nvml.sim_inject_xid(0, 79)
    nvml.sim_inject_xid(0, 119)  # a lesser action never lowers the one asked for
    assert reading(nvml).recovery_action == NODE_REBOOT
    nvml.nvmlShutdown()
    nvml.sim_reset_gpu(0)
    nvml.nvmlInit()
    assert reading(nvml).recovery_action == NODE_REBOOT
    with pytest.raises(SimError, match="nvmlShutdown"):
        nvml.sim_reboot()  # this process would not survive it
    nvml.nvmlShutdown()
    nvml.sim_reboot()
    nvml.nvmlInit()
    assert reading(nvml).recovery_action == NONE


def test_reboot_brings_lost_gpus_back_and_ends_processes(tmp_path):
    nvml = started(tmp_path)
    nvml.sim_set_gpu_lost(2)
    nvml.sim_set_processes(3, [4_000_001])
    nvml.sim_add_holder(3, "dcgm", 4_000_002)
    assert reading(nvml, 0) is not None
    nvml.nvmlShutdown()
    nvml.sim_reboot()
    nvml.nvmlInit()
    assert reading(nvml, 2) is not None
    assert nvml.sim_holders(3) == []
    assert nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(3)) == []


def test_set_recovery_action_and_bad_input(tmp_path):
    nvml = started(tmp_path)
    nvml.sim_set_recovery_action(0, pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET)
    assert reading(nvml).recovery_action == pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET
    for bad in (-1, 99, "1", None, True):
        with pytest.raises(SimError):
            nvml.sim_set_recovery_action(0, bad)
    with pytest.raises(SimError):
        nvml.sim_set_recovery_action(8, NONE)
    nvml.nvmlShutdown()
    nvml.sim_reset_gpu(0)  # drain-and-reset is satisfied by a reset
    nvml.nvmlInit()
    assert reading(nvml).recovery_action == NONE
    old = started(tmp_path, driver="550.90.07", name="old.json")
    with pytest.raises(SimError, match="R565"):
        old.sim_set_recovery_action(0, GPU_RESET)


@pytest.mark.parametrize("how", ["is-lost", "unknown"])
def test_lost_gpu_reading_is_none(tmp_path, how):
    nvml = started(tmp_path)
    uuids = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    nvml.sim_inject_xid(0, 79)
    nvml.sim_set_gpu_lost(0, how)
    readings = read_readings(nvml, uuids)
    assert readings[uuids[0]] is None
    assert readings[uuids[1]].fabric.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED


# --- fabric ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["hgx-h100", "hgx-h200", "B200:8"])
def test_fabric_completed_with_fabric_manager(tmp_path, preset):
    nvml = started(tmp_path, preset=preset)
    fabric = reading(nvml).fabric
    assert fabric == FabricReading(state=pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, status=pynvml.NVML_SUCCESS,
                                   health_mask=HEALTHY_MASK, clique_id=0, cluster_uuid="")
    bits = fabric_health_bits(fabric.health_mask)
    assert bits["degraded_bw"] == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE
    assert bits["incorrect_configuration"] == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE


@pytest.mark.parametrize("preset", ["dgx-a100", "hgx-a100-4gpu", "t4"])
def test_fabric_not_supported_before_hopper(tmp_path, preset):
    nvml = started(tmp_path, preset=preset)
    info = pynvml.c_nvmlGpuFabricInfo_t()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuFabricInfo(nvml.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))
    assert reading(nvml).fabric is None


@pytest.mark.parametrize("preset", ["H100-NVL-94GB:2", "H100-SXM5-80GB:1"])
def test_a_hopper_gpu_without_nvswitches_answers_the_state_not_supported(tmp_path, preset):
    # As our H100 SXM5 alone in a VM answered on 580.159.04 (docs/hardware.md, 2026-11-26): the call
    # succeeds and the state says there is no fabric, which is no fault (gpud took it for one before).
    nvml = started(tmp_path, preset=preset)
    info = pynvml.c_nvmlGpuFabricInfo_t()
    assert nvml.nvmlDeviceGetGpuFabricInfo(nvml.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info)) == \
        pynvml.NVML_SUCCESS
    assert info.state & 0xFF == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
    assert reading(nvml).fabric is None


def test_fabric_not_supported_in_a_vm(tmp_path):
    nvml = started(tmp_path)
    nvml.sim_set_passthrough(True)
    info = pynvml.c_nvmlGpuFabricInfo_t()
    nvml.nvmlDeviceGetGpuFabricInfo(nvml.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))
    assert info.state & 0xFF == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
    assert reading(nvml).fabric is None


def test_fabric_in_progress_until_fabric_manager_registers(tmp_path):
    nvml = started(tmp_path)
    nvml.nvmlShutdown()
    nvml.sim_set_fabric_manager(False)
    nvml.sim_reboot()  # FM dead since boot
    nvml.nvmlInit()
    assert reading(nvml).fabric.state == pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS
    nvml.sim_set_fabric_manager(True)
    assert reading(nvml).fabric.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    nvml.sim_set_fabric_manager(False)  # registered GPUs stay registered
    assert reading(nvml).fabric.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    nvml.nvmlShutdown()
    nvml.sim_reset_gpu(0)  # a reset GPU needs FM to register it again
    nvml.nvmlInit()
    assert reading(nvml, 0).fabric.state == pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS
    assert reading(nvml, 1).fabric.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED


def test_injected_degraded_fabric(tmp_path):
    nvml = started(tmp_path)
    nvml.sim_set_fabric(3, health_mask=DEGRADED_BW_MASK)
    fabric = reading(nvml, 3).fabric
    assert fabric.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    assert fabric_health_bits(fabric.health_mask)["degraded_bw"] == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
    info = pynvml.c_nvmlGpuFabricInfo_v3_t()
    info.version = pynvml.nvmlGpuFabricInfo_v3
    nvml.nvmlDeviceGetGpuFabricInfoV(nvml.nvmlDeviceGetHandleByIndex(3), ctypes.byref(info))
    assert info.healthSummary == pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY
    assert reading(nvml, 2).fabric.health_mask == HEALTHY_MASK
    nvml.sim_set_fabric(3, status=pynvml.NVML_ERROR_UNKNOWN)  # a new fault replaces the old one
    fabric = reading(nvml, 3).fabric
    assert (fabric.status, fabric.health_mask) == (pynvml.NVML_ERROR_UNKNOWN, HEALTHY_MASK)
    nvml.sim_set_fabric(3)
    assert reading(nvml, 3).fabric.status == pynvml.NVML_SUCCESS
    for bad in ({"state": 4}, {"state": -1}, {"status": "x"}, {"health_mask": 1 << 32}, {"health_mask": True}):
        with pytest.raises(SimError):
            nvml.sim_set_fabric(3, **bad)


@pytest.mark.parametrize("driver, health_mask", [("580.65.06", HEALTHY_MASK), ("550.90.07", HEALTHY_MASK),
                                                 ("535.183.01", None)])
def test_fabric_struct_versions_by_driver(tmp_path, driver, health_mask):
    """580 takes v3, 550 only v2 (read_readings falls back), 535 has no versioned call (v1: no mask)."""
    nvml = started(tmp_path, driver=driver)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.c_nvmlGpuFabricInfo_v3_t()
    info.version = pynvml.nvmlGpuFabricInfo_v3
    if driver.startswith("580"):
        nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    elif driver.startswith("550"):
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    else:
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    fabric = reading(nvml).fabric
    assert (fabric.state, fabric.health_mask) == (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, health_mask)


def test_fabric_bad_arguments(tmp_path):
    nvml = started(tmp_path)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    for version in (0, 4 << 24 | 40, pynvml.nvmlGpuFabricInfo_v2 + 1):  # unset, a version to come, a wrong size
        info = pynvml.c_nvmlGpuFabricInfo_v3_t()
        info.version = version
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    small = pynvml.c_nvmlGpuFabricInfo_v2_t()
    small.version = pynvml.nvmlGpuFabricInfo_v3  # claims v3 in a v2-sized buffer
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(small))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(ctypes.c_int()))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuFabricInfo("not a handle", ctypes.byref(pynvml.c_nvmlGpuFabricInfo_t()))


def test_fabric_health_bits_decodes_each_condition():
    mask = (1 << 0) | (2 << 2) | (1 << 4) | (2 << 6) | (5 << 8) | (1 << 12) | (2 << 14)
    assert fabric_health_bits(mask) == {"degraded_bw": 1, "route_recovery": 2, "route_unhealthy": 1,
                                        "access_timeout_recovery": 2, "incorrect_configuration": 5,
                                        "partition_assigned": 1, "gfm_state": 2}
    assert set(fabric_health_bits(0).values()) == {0}


# --- kernel log --------------------------------------------------------------------------------------


def test_xid_lines_in_the_kernel_log(tmp_path):
    nvml = started(tmp_path)
    nvml.sim_inject_xid(0, 79)
    nvml.sim_inject_xid(7, 13, nvml_event=False)
    records = kmsg_records(nvml)
    assert [priority for priority, _, _, _ in records] == ["3", "3", "3"]
    seqs = [int(seq) for _, seq, _, _ in records]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    xids = [XID_LINE.search(message) for *_, message in records]
    assert [(m.group(1), int(m.group(2))) for m in xids] == [("0000:07:00", 79), ("0000:07:00", 154),
                                                              ("0000:bd:00", 13)]
    assert "from 0x0 (None) to 0x2 (Node Reboot Required)" in records[1][3]


def test_kernel_log_goes_on_counting_after_a_restart(tmp_path):
    first = started(tmp_path)
    first.sim_inject_xid(0, 13)
    first.nvmlShutdown()
    second = started(tmp_path)
    second.sim_inject_xid(0, 13)
    assert [int(seq) for _, seq, _, _ in kmsg_records(second)] == [0, 1]


def test_xid_without_nvml_event_reaches_only_the_kernel_log(tmp_path):
    nvml = started(tmp_path)
    events = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError, events)
    nvml.sim_inject_xid(0, 79, nvml_event=False)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(events, 0)
    assert XID_LINE.search(nvml.sim_kmsg_path.read_text())
    nvml.sim_inject_xid(0, 79)
    assert nvml.nvmlEventSetWait_v2(events, 0).eventData == 79
    with pytest.raises(SimError):
        nvml.sim_inject_xid(0, 79, nvml_event="no")


def test_old_driver_logs_no_xid_154(tmp_path):
    nvml = started(tmp_path, driver="550.90.07")
    nvml.sim_inject_xid(0, 79)
    assert [int(XID_LINE.search(m).group(2)) for *_, m in kmsg_records(nvml)] == [79]


def test_kernel_log_is_bounded(tmp_path):
    nvml = started(tmp_path)
    count = KMSG_MAX_BYTES // 200  # over the limit, and more records than are kept
    assert count > KMSG_KEEP_RECORDS
    nvml.sim_kmsg_path.write_text("".join(f"3,{seq},1,-;{'x' * 200}\n" for seq in range(count)))
    nvml.sim_inject_xid(0, 13)
    records = kmsg_records(nvml)
    assert len(records) == KMSG_KEEP_RECORDS
    assert XID_LINE.search(records[-1][3]) and int(records[-1][1]) == count
    assert int(records[0][1]) == count + 1 - KMSG_KEEP_RECORDS


# --- procfs: driver version, boot id, NVSwitches, mismatch -----------------------------------------


def test_procfs_files(tmp_path):
    nvml = started(tmp_path)
    version = (nvml.sim_procfs_root / "driver" / "nvidia" / "version").read_text().splitlines()
    assert version[0] == "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (nixbld@)  "
    assert version[1].startswith("GCC version:  gcc version ")
    boot_id = (nvml.sim_procfs_root / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    assert str(uuid.UUID(boot_id)) == boot_id
    switches = sorted(p.name for p in (nvml.sim_procfs_root / "driver" / "nvidia-nvswitch" / "devices").iterdir())
    assert len(switches) == 4 and all(re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", s) for s in switches)
    assert (nvml.sim_procfs_root / "driver" / "nvidia-nvswitch" / "devices" / switches[0] / "information").read_text() \
        == "BIOS Version: N/A\n"


@pytest.mark.parametrize("preset", ["hgx-a100-4gpu", "H100-NVL-94GB:2", "t4"])
def test_no_nvswitch_directory_without_switches(tmp_path, preset):
    nvml = started(tmp_path, preset=preset)
    assert not (nvml.sim_procfs_root / "driver" / "nvidia-nvswitch").exists()


def test_kernel_module_mismatch_until_reboot(tmp_path):
    nvml = started(tmp_path)
    nvml.nvmlShutdown()
    boot_id = (nvml.sim_procfs_root / "sys" / "kernel" / "random" / "boot_id").read_text()
    nvml.sim_set_kernel_module("570.124.06")
    assert nvml.sim_library_version() == "580.65.06"
    assert nvml.sim_kernel_module_version() == "570.124.06"
    assert "  570.124.06  " in (nvml.sim_procfs_root / "driver" / "nvidia" / "version").read_text()
    with pytest.raises(pynvml.NVMLError_LibRmVersionMismatch):
        nvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_LibRmVersionMismatch):
        nvml.nvmlInitWithFlags(0)
    with pytest.raises(pynvml.NVMLError_Uninitialized):  # a failed init leaves NVML uninitialised
        nvml.nvmlDeviceGetCount()
    with pytest.raises(SimError):
        nvml.sim_set_kernel_module("not a version")
    nvml.sim_reboot()
    assert (nvml.sim_procfs_root / "sys" / "kernel" / "random" / "boot_id").read_text() != boot_id
    assert "  580.65.06  " in (nvml.sim_procfs_root / "driver" / "nvidia" / "version").read_text()
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 8


# --- persistence ---------------------------------------------------------------------------------


def test_state_persists_across_simulators(tmp_path):
    first = started(tmp_path)
    first.sim_inject_xid(0, 79)
    first.sim_inject_xid(1, 48)
    first.sim_set_fabric(2, health_mask=DEGRADED_BW_MASK)
    first.nvmlShutdown()
    first.sim_set_fabric_manager(False)
    first.sim_reset_gpu(3)
    first.sim_set_kernel_module("570.124.06")
    boot_id = json.loads((tmp_path / "state.json").read_text())["boot_id"]

    second = SimulatedNvml("hgx-h100", tmp_path / "state.json", "580.65.06")
    with pytest.raises(pynvml.NVMLError_LibRmVersionMismatch):
        second.nvmlInit()
    second.sim_set_kernel_module("580.65.06")  # the matching module loaded again
    second.nvmlInit()
    assert [reading(second, i).recovery_action for i in range(3)] == [NODE_REBOOT, GPU_RESET, NONE]
    assert reading(second, 2).fabric.health_mask == DEGRADED_BW_MASK
    assert reading(second, 3).fabric.state == pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS
    assert json.loads((tmp_path / "state.json").read_text())["boot_id"] == boot_id


def test_old_state_file_means_none_and_registered(tmp_path):
    nvml = started(tmp_path)
    nvml.nvmlShutdown()
    document = json.loads((tmp_path / "state.json").read_text())
    for key in ("kernel_module", "boot_id"):
        del document[key]
    for gpu in document["gpus"]:
        for key in ("recovery_action", "fabric_registered", "fabric_fault"):
            del gpu[key]
    (tmp_path / "state.json").write_text(json.dumps(document))
    nvml = started(tmp_path)
    assert reading(nvml).recovery_action == NONE
    assert reading(nvml).fabric.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    assert "boot_id" in json.loads((tmp_path / "state.json").read_text())


def test_bad_fabric_fault_in_state_file_is_refused(tmp_path):
    nvml = started(tmp_path)
    nvml.nvmlShutdown()
    document = json.loads((tmp_path / "state.json").read_text())
    document["gpus"][0]["fabric_fault"] = {"colour": 1}
    (tmp_path / "state.json").write_text(json.dumps(document))
    with pytest.raises(SimError, match="fabric_fault"):
        SimulatedNvml("hgx-h100", tmp_path / "state.json", "580.65.06").nvmlInit()
