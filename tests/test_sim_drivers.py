"""The simulator as real NVIDIA drivers behave (issue 10): GPU resets and the processes that block
them, lost GPUs, driver branches, NVLink wiring, the newer GPU models, privileges.

Each test names the public source of the behaviour it checks. "H100 capture" is
tests/fixtures/hardware/h100-sxm5-580.159.04 (a real H100 80GB HBM3 on driver 580.159.04).
"""

import ctypes
import json
import threading
import time

import pynvml
import pytest
from helpers import asleep_in, until

from gpud.nvml.sim import PRESETS, SimError, SimulatedNvml
from gpud.nvml.sim.scenarios import enable_mig, reset_released, started

R535, R550, R580 = "535.183.01", "550.90.07", "580.159.04"
MIB = 2**20
XID = pynvml.nvmlEventTypeXidCriticalError


@pytest.fixture
def state_path(tmp_path):
    return tmp_path / "state.json"


def count_placements(nvml, device, profile_id):
    count = ctypes.c_uint()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, None, ctypes.byref(count))
    return count.value


def list_gpu_instances(nvml, device, profile_id, capacity=7):
    count = ctypes.c_uint(capacity)
    array = (pynvml.c_nvmlGpuInstance_t * capacity)()
    nvml.nvmlDeviceGetGpuInstances(device, profile_id, array, ctypes.byref(count))
    return list(array[: count.value])


def subscribe(nvml, index, event_types=XID, event_set=None):
    event_set = event_set or nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(index), event_types, event_set)
    return event_set


# --- processes holding a GPU, and nvidia-smi -r --------------------------------------------------


def test_holders_are_other_processes_kept_in_the_state_file(state_path):
    nvml = started("dgx-a100", state_path)
    nvml.sim_add_holder(3, "nv-hostengine", 4242)
    nvml.sim_add_holder(3, "nvidia-persistenced", 1200)
    assert nvml.sim_holders(3) == [(1200, "nvidia-persistenced"), (4242, "nv-hostengine")]
    nvml.nvmlShutdown()
    # they outlive this simulator: another one on the same machine sees them
    assert SimulatedNvml("dgx-a100", state_path).sim_holders(3) == [(1200, "nvidia-persistenced"),
                                                                    (4242, "nv-hostengine")]
    nvml.sim_release_holders(3)
    assert nvml.sim_holders(3) == []
    assert json.loads(state_path.read_text())["gpus"][3]["holders"] == []


@pytest.mark.parametrize(("gpu", "process", "pid"), [
    (8, "dcgm", 10), ("GPU-nope", "dcgm", 10), (0, "", 10), (0, "  ", 10), (0, None, 10),
    (0, "dcgm", 0), (0, "dcgm", -3), (0, "dcgm", True), (0, "dcgm", "10"),
])
def test_holders_are_validated(state_path, gpu, process, pid):
    nvml = SimulatedNvml("dgx-a100", state_path)
    with pytest.raises(SimError):
        nvml.sim_add_holder(gpu, process, pid)
    assert nvml.sim_holders(0) == []


def test_the_same_process_holds_a_gpu_once(state_path):
    nvml = SimulatedNvml("t4", state_path)
    nvml.sim_add_holder(0, "dcgm", 10)
    with pytest.raises(SimError, match="already holds"):
        nvml.sim_add_holder(0, "dcgm", 10)


def test_controls_work_while_this_process_has_nvml_shut_down(state_path):
    """nvidia-smi -r runs while gpud has released NVML: the controls act on the state file."""
    nvml = SimulatedNvml("dgx-a100", state_path)
    nvml.sim_set_gpu_lost(2)
    nvml.sim_add_holder(4, "dcgm", 77)
    nvml.sim_reset_gpu(2)
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(2)) == "NVIDIA A100-SXM4-40GB"
    assert nvml.sim_holders(4) == [(77, "dcgm")]


def test_a_reset_is_refused_while_this_process_holds_nvml(state_path):
    """Reference README correction: gpud's own NVML session (and its event sets) count as clients."""
    nvml = started("dgx-a100", state_path)
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(0), XID, nvml.nvmlEventSetCreate())
    nvml.sim_set_gpu_lost(0)
    before = state_path.read_bytes()
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.sim_reset_gpu(0)
    assert state_path.read_bytes() == before
    reset_released(nvml, [0])
    assert nvml.nvmlDeviceGetHandleByIndex(0)


@pytest.mark.parametrize("blocker", ["holder", "process"])
def test_a_reset_is_refused_by_another_client_and_changes_nothing(state_path, blocker):
    """nvidia-smi manual, -r: "There can't be any applications using these devices (e.g. CUDA
    application, ... monitoring application like other instance of nvidia-smi)"."""
    nvml = SimulatedNvml("dgx-a100", state_path)
    nvml.sim_set_gpu_lost(2)
    if blocker == "holder":
        nvml.sim_add_holder(3, "nv-hostengine", 4242)
    else:
        nvml.sim_set_processes(3, [5150])
    before = state_path.read_bytes()
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.sim_reset_gpu([2, 3])
    assert state_path.read_bytes() == before  # GPU 2 was not reset either
    nvml.sim_reset_gpu(2)  # GPU 3's client does not block GPU 2 on its own (NVSwitch + Fabric Manager)
    assert json.loads(state_path.read_text())["gpus"][2]["lost"] is False


def test_a_reset_keeps_holders_of_other_gpus_and_does_what_a_reset_does(state_path):
    nvml = started("dgx-a100", state_path)
    nvml.sim_add_holder(1, "dcgm", 10)
    nvml.sim_add_holder(0, "dcgm", 10)
    # GPU 0 held by DCGM: its MIG mode stays pending (activation status IN_USE)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_IN_USE
    nvml.sim_inject_ecc(0, double_bit=True)
    nvml.sim_set_nvlink(0, 3, up=False)
    nvml.sim_release_holders(0)
    reset_released(nvml, [0])
    assert nvml.nvmlDeviceGetMigMode(device) == [1, 1]
    assert nvml.nvmlDeviceGetTotalEccErrors(device, 1, pynvml.NVML_VOLATILE_ECC) == 0
    assert nvml.nvmlDeviceGetTotalEccErrors(device, 1, pynvml.NVML_AGGREGATE_ECC) == 1
    assert nvml.nvmlDeviceGetRemappedRows(device)[2] == 0  # the pending remap applied
    assert nvml.nvmlDeviceGetNvLinkState(device, 3) == pynvml.NVML_FEATURE_ENABLED
    assert nvml.sim_holders(1) == [(10, "dcgm")]


def test_a_reset_destroys_mig_instances(state_path):
    nvml = started("hgx-h100", state_path)
    device = enable_mig(nvml, 0)
    nvml.nvmlDeviceCreateGpuInstance(device, 9)
    reset_released(nvml, [0])
    assert list_gpu_instances(nvml, device, 9) == []
    assert nvml.nvmlDeviceGetMigMode(device) == [1, 1]  # Hopper's mode is not touched by a reset


def test_reset_arguments(state_path):
    nvml = SimulatedNvml("dgx-a100", state_path)
    for bad in ([], [0, 8], "GPU-nope", -1, True, None):
        with pytest.raises(SimError):
            nvml.sim_reset_gpu(bad)
    nvml.sim_set_gpu_lost(1)
    nvml.sim_reset_gpu([1, 1, 0])  # duplicates are one GPU
    reader = started("dgx-a100", state_path)
    uuid = reader.nvmlDeviceGetUUID(reader.nvmlDeviceGetHandleByIndex(1))
    reader.nvmlShutdown()
    nvml.sim_reset_gpu(uuid)


def test_recover_gpu_changes_nothing_else(state_path):
    nvml = started("dgx-a100", state_path)
    nvml.sim_add_holder(0, "dcgm", 10)  # keeps GPU 0's MIG change pending
    nvml.nvmlDeviceSetMigMode(nvml.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_DEVICE_MIG_ENABLE)
    nvml.sim_set_gpu_lost(0)
    nvml.sim_recover_gpu(0)
    nvml.sim_recover_gpu(0)  # not lost: nothing to do
    assert nvml.nvmlDeviceGetMigMode(nvml.nvmlDeviceGetHandleByIndex(0)) == [0, 1]
    with pytest.raises(SimError):
        nvml.sim_recover_gpu(9)


# --- NVLink peers and the reset ------------------------------------------------------------------
# nvidia-smi manual, -r: "Starting with the NVIDIA Ampere architecture, GPUs with NVLink connections
# can be individually reset. On Ampere NVSwitch systems, Fabric Manager is required to facilitate
# reset. On Hopper and later NVSwitch systems, the dependency ... is removed." Without Fabric
# Manager "any GPUs with NVLink connections to a GPU being reset must also be reset in the same
# command"; direct-connected Ampere+: "Each GPU can be reset individually".


def test_ampere_nvswitch_without_fabric_manager_resets_all_peers_together(state_path):
    nvml = SimulatedNvml("dgx-a100", state_path)
    assert nvml.sim_fabric_manager_running()
    nvml.sim_set_fabric_manager(False)
    assert not SimulatedNvml("dgx-a100", state_path).sim_fabric_manager_running()  # persisted
    before = state_path.read_bytes()
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.sim_reset_gpu([0, 1, 2, 3, 4, 5, 6])  # GPU 7 left out
    assert state_path.read_bytes() == before
    nvml.sim_reset_gpu(list(range(8)))
    nvml.sim_set_fabric_manager(True)
    nvml.sim_reset_gpu(5)
    with pytest.raises(SimError):
        nvml.sim_set_fabric_manager("no")


def test_when_gpus_reset_together_no_gpu_of_the_system_may_compute(state_path):
    """nvidia-smi manual, -r: "There also can't be any compute applications running on any other
    GPU in the system if individual GPU reset is not feasible"."""
    nvml = SimulatedNvml("A100-SXM4-40GB:2,T4:1", state_path)
    nvml.sim_set_fabric_manager(False)
    nvml.sim_set_processes(2, [99])  # on the T4, which has no NVLink
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.sim_reset_gpu([0, 1])
    nvml.sim_set_processes(2, [])
    nvml.sim_reset_gpu([0, 1])


def test_hopper_nvswitch_resets_one_gpu_without_fabric_manager(state_path):
    nvml = SimulatedNvml("hgx-h100", state_path)
    nvml.sim_set_fabric_manager(False)
    nvml.sim_reset_gpu(3)


@pytest.mark.parametrize(("preset", "links", "switches"), [
    ("dgx-a100", 12, 6), ("dgx-a100-80gb", 12, 6), ("hgx-h100", 18, 4), ("hgx-h200", 18, 4), ("B200:8", 18, 2),
])
def test_nvswitch_systems_report_a_switch_at_the_far_end_of_every_link(state_path, preset, links, switches):
    nvml = started(preset, state_path, R580)
    gpu_buses = {nvml.nvmlDeviceGetPciInfo_v3(nvml.nvmlDeviceGetHandleByIndex(i)).bus for i in range(8)}
    device = nvml.nvmlDeviceGetHandleByIndex(4)
    types = {nvml.nvmlDeviceGetNvLinkRemoteDeviceType(device, link) for link in range(links)}
    assert types == {pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH}
    remote = {nvml.nvmlDeviceGetNvLinkRemotePciInfo(device, link).busId for link in range(links)}
    assert len(remote) == switches and not {int(bus_id[9:11], 16) for bus_id in remote} & gpu_buses
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetNvLinkRemoteDeviceType(device, links)


def test_hgx_a100_4gpu_links_each_gpu_to_the_other_three(state_path):
    """Direct GPU-to-GPU NVLink, no NVSwitch: remote type GPU, the peers' bus ids (the link-to-peer
    map itself is plausible: no public map was found)."""
    assert PRESETS["hgx-a100-4gpu"].spec == "A100-SXM4-40GB:4"
    nvml = started("hgx-a100-4gpu", state_path)
    bus_ids = [nvml.nvmlDeviceGetPciInfo_v3(nvml.nvmlDeviceGetHandleByIndex(i)).busId for i in range(4)]
    device = nvml.nvmlDeviceGetHandleByIndex(1)
    assert {nvml.nvmlDeviceGetNvLinkRemoteDeviceType(device, link) for link in range(12)} == \
        {pynvml.NVML_NVLINK_DEVICE_TYPE_GPU}
    remote = [nvml.nvmlDeviceGetNvLinkRemotePciInfo(device, link).busId for link in range(12)]
    assert sorted(remote) == sorted([bus_ids[0]] * 4 + [bus_ids[2]] * 4 + [bus_ids[3]] * 4)
    nvml.sim_set_nvlink(1, 5, up=False)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # a failed link reports no far end
        nvml.nvmlDeviceGetNvLinkRemotePciInfo(device, 5)
    nvml.nvmlShutdown()
    nvml.sim_reset_gpu(1)  # Ampere+, direct-connected: each GPU can be reset individually


@pytest.mark.parametrize(("spec", "links"), [("A100-PCIE-80GB:2", 12), ("H100-NVL-94GB:2", 12)])
def test_nvlink_boards_without_a_bridge_have_inactive_links(state_path, spec, links):
    """Reference README correction: links present but inactive, no fault."""
    nvml = started(spec, state_path)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert [nvml.nvmlDeviceGetNvLinkState(device, link) for link in range(links)] == \
        [pynvml.NVML_FEATURE_DISABLED] * links
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetNvLinkState(device, links)
    for remote_query in (nvml.nvmlDeviceGetNvLinkRemoteDeviceType, nvml.nvmlDeviceGetNvLinkRemotePciInfo):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            remote_query(device, 0)
    with pytest.raises(SimError, match="no active NVLink"):
        nvml.sim_set_nvlink(0, 0, up=False)
    nvml.nvmlShutdown()
    nvml.sim_reset_gpu(0)  # inactive links connect nothing: no peer to reset with


def test_pynvml_has_no_v2_suffix_for_the_remote_pci_info(state_path):
    """pynvml binds nvmlDeviceGetNvLinkRemotePciInfo_v2 under the name without the suffix."""
    nvml = started("dgx-a100", state_path)
    with pytest.raises(AttributeError):
        nvml.nvmlDeviceGetNvLinkRemotePciInfo_v2  # noqa: B018


# --- lost GPUs ------------------------------------------------------------------------------------


def test_a_gpu_lost_the_common_way_fails_handle_lookups_with_unknown_error(state_path):
    """nvidia-smi after an Xid 79: "Unable to determine the device handle for GPU 0000:09:00.0:
    Unknown Error" (NVIDIA/nvidia-docker#1553, NVIDIA/dcgm-exporter#604); handles a long-running
    client already holds answer GPU_IS_LOST (leptonai/gpud#604, §8)."""
    nvml = started("dgx-a100", state_path)
    device = nvml.nvmlDeviceGetHandleByIndex(6)
    uuid, bus_id = nvml.nvmlDeviceGetUUID(device), nvml.nvmlDeviceGetPciInfo_v3(device).busId
    nvml.sim_set_gpu_lost(6)
    for lookup in (lambda: nvml.nvmlDeviceGetHandleByIndex(6), lambda: nvml.nvmlDeviceGetHandleByUUID(uuid),
                   lambda: nvml.nvmlDeviceGetHandleByPciBusId(bus_id)):
        with pytest.raises(pynvml.NVMLError_Unknown):
            lookup()
    for call in (nvml.nvmlDeviceGetUUID, nvml.nvmlDeviceGetMemoryInfo, nvml.nvmlDeviceGetMigMode):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(device)
    assert nvml.nvmlDeviceGetCount() == 8
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(5)) == "NVIDIA A100-SXM4-40GB"
    assert json.loads(state_path.read_text())["gpus"][6]["lost"] == "unknown"
    with pytest.raises(pynvml.NVMLError_Unknown):
        started("dgx-a100", state_path).nvmlDeviceGetHandleByIndex(6)  # persisted, with how


def test_a_gpu_lost_with_gpu_is_lost_answers_it_everywhere(state_path):
    """ "Unable to determine the device handle for GPU 0000:02:00.0: GPU is lost. Reboot the system
    to recover this GPU" (JosephKJ/OWOD#81)."""
    nvml = started("dgx-a100", state_path)
    nvml.sim_set_gpu_lost(2, how="is-lost")
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(SimError, match="how"):
        nvml.sim_set_gpu_lost(2, how="gone")


def test_an_event_set_with_a_lost_gpu_answers_gpu_is_lost_at_once_every_time(state_path):
    """A persistent wait error returns immediately without blocking (Project-HAMi/HAMi#2321); the
    set keeps answering it while the lost GPU is registered, ahead of other GPUs' events (no source
    on those: the strictest plausible)."""
    nvml = started("dgx-a100", state_path)
    event_set = subscribe(nvml, 0)
    subscribe(nvml, 1, event_set=event_set)
    other_set = subscribe(nvml, 1)
    handle_before = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.sim_set_gpu_lost(0)
    nvml.sim_inject_xid(1, 31)
    started_at = time.perf_counter()
    for _ in range(3):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            nvml.nvmlEventSetWait_v2(event_set, 5000)
    assert time.perf_counter() - started_at < 0.5
    assert nvml.nvmlEventSetWait_v2(other_set, 0).eventData == 31  # a set without it still works
    with pytest.raises(pynvml.NVMLError_GpuIsLost):  # registering a lost GPU fails
        nvml.nvmlDeviceRegisterEvents(handle_before, XID, nvml.nvmlEventSetCreate())
    nvml.sim_recover_gpu(0)
    assert nvml.nvmlEventSetWait_v2(event_set, 0).eventData == 31


def test_a_blocked_wait_wakes_up_with_gpu_is_lost(state_path):
    nvml = started("dgx-a100", state_path)
    event_set = subscribe(nvml, 3)
    errors = []

    def wait():
        try:
            nvml.nvmlEventSetWait_v2(event_set, 5000)
        except pynvml.NVMLError as error:
            errors.append(error)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    until(lambda: asleep_in(waiter, "nvmlEventSetWait_v2"), what="the waiter asleep in nvmlEventSetWait_v2")
    nvml.sim_set_gpu_lost(3)
    waiter.join(2)
    assert [type(error) for error in errors] == [pynvml.NVMLError_GpuIsLost]


def test_the_device_of_an_event_from_a_gpu_lost_since_raises(state_path):
    """A listener can die outside the wait: nvmlDeviceGetUUID(data.device) on a lost GPU."""
    nvml = started("dgx-a100", state_path)
    event_set = subscribe(nvml, 4)
    nvml.sim_inject_xid(4, 79)
    data = nvml.nvmlEventSetWait_v2(event_set, 0)
    nvml.sim_set_gpu_lost(4)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetUUID(data.device)


def test_older_state_files_still_load(state_path):
    """lost: true (before `how`), no holders, no fabric_manager."""
    SimulatedNvml("t4", state_path).sim_reset_gpu(0)
    document = json.loads(state_path.read_text())
    document["gpus"][0]["lost"] = True
    del document["gpus"][0]["holders"], document["fabric_manager"]
    state_path.write_text(json.dumps(document))
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        started("t4", state_path).nvmlDeviceGetHandleByIndex(0)
    document["gpus"][0]["lost"] = "melted"
    state_path.write_text(json.dumps(document))
    with pytest.raises(SimError, match="lost"):
        started("t4", state_path)


# --- driver branches ------------------------------------------------------------------------------


@pytest.mark.parametrize(("driver", "nvml_version", "cuda"), [
    (R535, "12.535.183.01", 12020),
    (R550, "12.550.90.07", 12040),
    ("570.86", "12.570.86", 12040),
    (R580, "13.580.159.04", 13000),  # H100 capture
    ("470.256.02", "12.470.256.02", 12020),  # older than R535: behaves like it
])
def test_versions_by_driver_branch(state_path, driver, nvml_version, cuda):
    nvml = started("t4", state_path, driver)
    assert nvml.nvmlSystemGetDriverVersion() == driver
    assert nvml.nvmlSystemGetNVMLVersion() == nvml_version
    assert nvml.nvmlSystemGetCudaDriverVersion_v2() == cuda


def test_the_default_driver_is_r550(state_path):
    assert started("t4", state_path).nvmlSystemGetDriverVersion() == R550


@pytest.mark.parametrize("driver", ["", "5.5", "550", "550.9", "550.90.7", "r550.90", "550.90.07.1", 550])
def test_unparseable_driver_versions_are_refused(state_path, driver):
    with pytest.raises(SimError, match="driver version"):
        SimulatedNvml("t4", state_path, driver)


@pytest.mark.parametrize("driver", [R535, R550])
def test_r535_and_r550_refuse_profile_queries_while_mig_is_off(state_path, driver):
    """R535: NVIDIA mig-parted commit 219e780d (reference README correction). R550: no evidence
    either way, modelled the strictest way. With MIG on every branch answers."""
    nvml = started("hgx-h100", state_path, driver)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    refused = [
        lambda: nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE),
        lambda: nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 1),
        lambda: nvml.nvmlDeviceGetGpuInstanceProfileInfoById(device, 19),
        lambda: count_placements(nvml, device, 19),
        lambda: nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 19),
        lambda: list_gpu_instances(nvml, device, 19),
    ]
    for call in refused:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    enable_mig(nvml, 0)
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE).id == 19
    assert (count_placements(nvml, device, 19), nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 19)) == (7, 7)
    assert list_gpu_instances(nvml, device, 19) == []


def test_r580_answers_profile_queries_with_mig_off(state_path):
    """H100 capture: profile info v1/v2, placements, remaining capacity and an empty instance list."""
    nvml = started("hgx-h100", state_path, R580)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    v2 = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert (v2.id, v2.memorySizeMB, v2.name, v2.version) == (19, 9984, "MIG 1g.10gb", 0)  # version 0 as captured
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, 0, 1).id == 19
    assert (count_placements(nvml, device, 15), nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 15)) == (4, 4)
    assert list_gpu_instances(nvml, device, 19) == []
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceCreateGpuInstance(device, 19)


@pytest.mark.parametrize(("driver", "first_unknown"), [(R535, 0xA), (R580, 0x11)])
def test_gpu_instance_profile_constants_a_branch_does_not_know_are_invalid(state_path, driver, first_unknown):
    """H100 capture (580): 5, 6, 8, 10..16 NOT_SUPPORTED, 0x11 INVALID_ARGUMENT. R535: pynvml
    12.535/12.560 define constants up to 0x9 (COUNT 0xA), §3.0."""
    nvml = started("hgx-h100", state_path, driver)
    device = enable_mig(nvml, 0)
    not_on_h100 = {5, 6, 8} | set(range(10, first_unknown))
    for constant in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT + 1):
        expected = (pynvml.NVMLError_InvalidArgument if constant >= first_unknown else
                    pynvml.NVMLError_NotSupported if constant in not_on_h100 else None)
        if expected is None:
            assert nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, constant).sliceCount > 0
        else:
            with pytest.raises(expected):
                nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, constant)


@pytest.mark.parametrize(("driver", "nvl_error"), [(R535, pynvml.NVMLError_InvalidArgument),
                                                    (R580, pynvml.NVMLError_NotSupported)])
def test_every_compute_instance_profile_constant_answers_by_branch(state_path, driver, nvl_error):
    """Offered in the GI -> info, else NOT_SUPPORTED; unknown to the branch -> INVALID_ARGUMENT.
    7_SLICE_NVL (8) is in the 13.x header only (§4.1)."""
    nvml = started("dgx-a100", state_path, driver)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(enable_mig(nvml, 0), 0)  # 7g.40gb
    offered = {0: 7, 1: 3, 2: 2, 3: 1, 4: 1}  # §4.2: 1c, 2c, 3c, 4c, 7c in a 7g GI
    for constant in range(8):
        if constant in offered:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, constant, 0)
            assert (info.id, info.instanceCount) == (constant, offered[constant])
            assert nvml.nvmlGpuInstanceGetComputeInstanceProfileInfoV(gpu_instance, constant, 0, 1).id == constant
        else:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, constant, 0)
    profile_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo
    with pytest.raises(nvl_error):
        profile_info(gpu_instance, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL, 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        profile_info(gpu_instance, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT, 0)


def test_compute_instance_placements_use_the_count_then_array_convention(state_path):
    """nvml.h: a NULL array asks for the count; too small an array answers INSUFFICIENT_SIZE. The
    placements themselves are INFERRED (§4.3)."""
    nvml = started("dgx-a100", state_path)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(enable_mig(nvml, 0), 9)  # 3g.20gb
    count = ctypes.c_uint()
    nvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gpu_instance, 0, None, ctypes.byref(count))
    assert count.value == 3
    small = ctypes.c_uint(2)
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        nvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(
            gpu_instance, 0, (pynvml.c_nvmlComputeInstancePlacement_t * 2)(), ctypes.byref(small))
    array = (pynvml.c_nvmlComputeInstancePlacement_t * 3)()
    nvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gpu_instance, 0, array, ctypes.byref(count))
    assert [(p.start, p.size) for p in array] == [(0, 1), (1, 1), (2, 1)]
    with pytest.raises(pynvml.NVMLError_NotSupported):  # 4c does not fit in a 3g GI
        nvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gpu_instance, 3, None, ctypes.byref(count))


def test_instance_listings_refuse_a_null_array(state_path):
    """Unlike the placement calls (cuda-python NVML docs; NVIDIA/cuda-python#2862 on hardware)."""
    nvml = started("dgx-a100", state_path)
    device = enable_mig(nvml, 0)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, 9)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuInstances(device, 9, None, ctypes.byref(ctypes.c_uint(2)))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpuInstanceGetComputeInstances(gpu_instance, 0, None, ctypes.byref(ctypes.c_uint(3)))


@pytest.mark.parametrize(("driver", "has_it"), [("525.147.05", False), (R535, True), (R580, True)])
def test_clock_event_reasons_appeared_in_r535(state_path, driver, has_it):
    """The R535 / CUDA 12.2 header renamed "throttle reasons" to "event reasons"; the old call stays."""
    nvml = started("t4", state_path, driver)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetCurrentClocksThrottleReasons(device) == pynvml.nvmlClocksEventReasonGpuIdle
    if has_it:
        assert nvml.nvmlDeviceGetCurrentClocksEventReasons(device) == pynvml.nvmlClocksEventReasonGpuIdle
    else:
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            nvml.nvmlDeviceGetCurrentClocksEventReasons(device)


@pytest.mark.parametrize(("driver", "memory_mb"), [("570.86.15", 22528), ("570.124.06", 20992), (R580, 20992)])
def test_b200_1g_memory_depends_on_the_driver(state_path, driver, memory_mb):
    """§3.9: 22.00 GiB in the Jan-2025 lgip (NVIDIA/mig-parted#166), 20.50 GiB in the Mar-2025 one
    (NVIDIA/gpu-operator#1351); the driver cut between them is INFERRED."""
    nvml = started("B200:1", state_path, driver)
    device = enable_mig(nvml, 0)
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE).memorySizeMB \
        == memory_mb
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfoById(device, 15).memorySizeMB == 45312  # unchanged
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, 19)
    nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 0)
    mig_device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)
    assert nvml.nvmlDeviceGetMemoryInfo(mig_device).total == memory_mb * MIB
    assert nvml.nvmlDeviceGetAttributes_v2(mig_device).memorySizeMB == memory_mb


# --- memory, MIG mode activation ------------------------------------------------------------------


def test_memory_info_v1_counts_reserved_memory_as_used_and_v2_reports_it_apart(state_path):
    """H100 capture: v1 used 480 MiB; v2 reserved 480 MiB, used 0; free 81079 MiB in both."""
    nvml = started("hgx-h100", state_path, R580)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    v1, v2 = nvml.nvmlDeviceGetMemoryInfo(device), nvml.nvmlDeviceGetMemoryInfo(device, pynvml.nvmlMemory_v2)
    assert (v1.total, v1.used, v1.free) == (81559 * MIB, 480 * MIB, 81079 * MIB)
    assert (v2.version, v2.total, v2.reserved, v2.used, v2.free) == \
        (pynvml.nvmlMemory_v2, 81559 * MIB, 480 * MIB, 0, 81079 * MIB)
    nvml.sim_set_processes(0, [31])
    v1, v2 = nvml.nvmlDeviceGetMemoryInfo(device), nvml.nvmlDeviceGetMemoryInfo(device, pynvml.nvmlMemory_v2)
    assert v1.used == v2.reserved + v2.used and v2.used > 0 and v1.free == v2.free
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlDeviceGetMemoryInfo(device, 0x01000028)


def test_ampere_mig_mode_applies_at_once_on_an_idle_gpu(state_path):
    """MIG user guide transcript "Enabled MIG Mode for GPU ..."; mig-parted logs "Mode change pending:
    false" right after the call (NVIDIA/gpu-operator#351): the driver resets an idle GPU itself."""
    nvml = started("a30", state_path)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.sim_inject_ecc(0, double_bit=False)
    assert nvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(device) == [1, 1]
    assert nvml.nvmlDeviceGetTotalEccErrors(device, 0, pynvml.NVML_VOLATILE_ECC) == 0  # it was reset


def test_ampere_mig_mode_stays_pending_while_another_client_holds_the_gpu(state_path):
    """nvml.h: activationStatus NVML_ERROR_IN_USE; MIG user guide: "pending enable state ... In use
    by another client"."""
    nvml = started("dgx-a100", state_path)
    nvml.sim_add_holder(2, "nvidia-persistenced", 900)
    device = nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_IN_USE
    assert nvml.nvmlDeviceGetMigMode(device) == [0, 1]
    with pytest.raises(pynvml.NVMLError_InUse):  # and the operator's reset is refused as well
        reset_released(nvml, [2])


# --- privileges -----------------------------------------------------------------------------------


@pytest.fixture
def nobody(monkeypatch):
    """Run the simulator's calls as uid 65534 (it reads os.geteuid at call time)."""
    def become(uid):
        monkeypatch.setattr("os.geteuid", lambda: uid)
    return become


def test_non_root_reads_everything_with_mig_off(state_path, nobody):
    """H100 capture: every read above answered as uid 65534 (probe-nobody.json)."""
    nvml = started("hgx-h100", state_path, R580)
    nobody(65534)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, 0).id == 19
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 19) == 7
    assert list_gpu_instances(nvml, device, 19) == []
    assert nvml.nvmlDeviceGetMemoryInfo(device).total == 81559 * MIB


def test_non_root_cannot_change_modes_or_instances(state_path, nobody):
    """nvidia-smi manual: -mig and -c "Requires root"; nvml.h / §7.2: NO_PERMISSION."""
    nvml = started("hgx-h100", state_path)
    device = enable_mig(nvml, 0)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, 9)
    compute_instance = nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 0)
    other = nvml.nvmlDeviceGetHandleByIndex(1)
    nobody(1000)
    for change in (
        lambda: nvml.nvmlDeviceSetMigMode(other, pynvml.NVML_DEVICE_MIG_ENABLE),
        lambda: nvml.nvmlDeviceSetComputeMode(other, pynvml.NVML_COMPUTEMODE_PROHIBITED),
        lambda: nvml.nvmlDeviceCreateGpuInstance(device, 19),
        lambda: nvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, 19, pynvml.c_nvmlGpuInstancePlacement_t(4, 1)),
        lambda: nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 0),
        lambda: nvml.nvmlComputeInstanceDestroy(compute_instance),
        lambda: nvml.nvmlGpuInstanceDestroy(gpu_instance),
    ):
        with pytest.raises(pynvml.NVMLError_NoPermission):
            change()
    nobody(0)
    assert nvml.nvmlDeviceGetMigMode(other) == [0, 0]  # nothing changed
    assert nvml.nvmlComputeInstanceDestroy(compute_instance) == pynvml.NVML_SUCCESS


def test_non_root_cannot_reset_a_gpu(state_path, nobody):
    """nvidia-smi manual, -r/--gpu-reset: "Requires root". The refused reset changes nothing: a lost
    GPU stays lost until root resets it."""
    nvml = started("hgx-h100", state_path)
    nvml.sim_set_gpu_lost(0, how="is-lost")
    nvml.nvmlShutdown()
    nobody(1000)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nvml.sim_reset_gpu(0)
    nobody(0)
    nvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0))
    reset_released(nvml, [0])
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0)).startswith("GPU-")


def test_non_root_cannot_list_mig_instances_but_sees_mig_devices(state_path, nobody):
    """`nvidia-smi mig -lci`: "Failed to display compute instances: Insufficient Permissions"
    (Project-HAMi/HAMi#1044) without the MIG capabilities; `nvidia-smi -L` still lists MIG devices
    for normal users (NVIDIA/go-nvml#57)."""
    nvml = started("hgx-h100", state_path)
    device = enable_mig(nvml, 0)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, 9)
    nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 2)
    nobody(65534)
    for listing in (
        lambda: list_gpu_instances(nvml, device, 9),
        lambda: nvml.nvmlDeviceGetGpuInstanceById(device, 1),
        lambda: nvml.nvmlGpuInstanceGetComputeInstances(gpu_instance, 2, (pynvml.c_nvmlComputeInstance_t * 1)(),
                                                        ctypes.byref(ctypes.c_uint(1))),
        lambda: nvml.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, 0),
    ):
        with pytest.raises(pynvml.NVMLError_NoPermission):
            listing()
    mig_device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)
    assert nvml.nvmlDeviceGetUUID(mig_device).startswith("MIG-")


# --- the newer models -----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "name", "pci_id", "memory_mib", "arch", "cc"), [
    ("A100-PCIE-80GB:1", "NVIDIA A100 80GB PCIe", 0x20B510DE, 81920, pynvml.NVML_DEVICE_ARCH_AMPERE, (8, 0)),
    ("H100-NVL-94GB:1", "NVIDIA H100 NVL", 0x232110DE, 95830, pynvml.NVML_DEVICE_ARCH_HOPPER, (9, 0)),
    ("B200:1", "NVIDIA B200", 0x290110DE, 183359, pynvml.NVML_DEVICE_ARCH_BLACKWELL, (10, 0)),
])
def test_new_models_identify_as_nvidia_names_them(state_path, spec, name, pci_id, memory_mib, arch, cc):
    """§2 (names, PCI ids, memory totals)."""
    nvml = started(spec, state_path)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetName(device) == name
    assert nvml.nvmlDeviceGetPciInfo_v3(device).pciDeviceId == pci_id
    assert nvml.nvmlDeviceGetMemoryInfo(device).total == memory_mib * MIB
    assert nvml.nvmlDeviceGetArchitecture(device) == arch
    assert nvml.nvmlDeviceGetCudaComputeCapability(device) == cc


# name, constant, id, instances, memory MiB, SM, CE, DEC, JPEG, OFA — typed in from the reference
H100_NVL = [  # §3.5 (driver 560.35.03)
    ("1g.12gb", 0x0, 19, 7, 11008, 16, 1, 1, 1, 0), ("1g.12gb+me", 0x7, 20, 1, 11008, 16, 1, 1, 1, 1),
    ("1g.24gb", 0x9, 15, 4, 22144, 26, 1, 1, 1, 0), ("2g.24gb", 0x1, 14, 3, 22144, 32, 2, 2, 2, 0),
    ("3g.47gb", 0x2, 9, 2, 47488, 60, 3, 3, 3, 0), ("4g.47gb", 0x3, 5, 1, 47488, 64, 4, 4, 4, 0),
    ("7g.94gb", 0x4, 0, 1, 95360, 132, 8, 7, 7, 1),
]
B200_SEEN = [  # §3.9, the rows a real lgip printed (NVIDIA/mig-parted#166)
    ("1g.23gb", 0x0, 19, 7, 22528, 18, 2, 1, 1, 0), ("1g.23gb+me", 0x7, 20, 1, 22528, 18, 2, 1, 1, 1),
    ("1g.45gb", 0x9, 15, 4, 45312, 30, 2, 1, 1, 0), ("2g.45gb", 0x1, 14, 3, 45312, 36, 4, 2, 2, 0),
]
A100_80GB_PCIE = [  # §3.2 (the A100 80GB table covers SXM4 and PCIe)
    ("1g.10gb", 0x0, 19, 7, 9728, 14, 1, 0, 0, 0), ("3g.40gb", 0x2, 9, 2, 40192, 42, 3, 2, 0, 0),
    ("7g.80gb", 0x4, 0, 1, 80640, 98, 7, 5, 1, 1),
]


@pytest.mark.parametrize(("spec", "driver", "rows"), [
    ("H100-NVL-94GB:1", R580, H100_NVL), ("B200:1", "570.86.15", B200_SEEN), ("A100-PCIE-80GB:1", R580, A100_80GB_PCIE),
])
def test_new_models_mig_tables_match_the_reference(state_path, spec, driver, rows):
    nvml = started(spec, state_path, driver)
    device = enable_mig(nvml, 0)  # R550-branch drivers answer profile queries only with MIG on
    for name, constant, profile_id, instances, memory, sm, ce, dec, jpeg, ofa in rows:
        info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, constant)
        assert (info.name, info.id, info.instanceCount, info.memorySizeMB) == (f"MIG {name}", profile_id, instances,
                                                                               memory)
        assert (info.multiprocessorCount, info.copyEngineCount, info.decoderCount, info.jpegCount, info.ofaCount) == \
            (sm, ce, dec, jpeg, ofa), name


def test_b200_takes_seven_1g_instances_and_its_inferred_7g(state_path):
    """B200 instance counts and CE from the MIG user guide's B200 table; placements INFERRED (§3.0)."""
    nvml = started("B200:1", state_path)
    device = enable_mig(nvml, 0)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(device) == 7
    for _ in range(7):
        nvml.nvmlDeviceCreateGpuInstance(device, 19)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(device, 19)
    full = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    assert (full.id, full.copyEngineCount, full.sliceCount) == (0, 16, 7)


def test_h100_2g_instance_offers_two_compute_profiles_named_1c(state_path):
    """A real H100 `nvidia-smi mig -lcip` (NVIDIA/go-nvml#146): in a 2g.20gb GPU instance, CI
    profiles 0 (2 instances, 16 SMs) and 7 (1 instance, 26 SMs) are both "MIG 1c.2g.20gb"."""
    nvml = started("hgx-h100", state_path)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(enable_mig(nvml, 0), 14)
    profiles = [nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, p, 0) for p in (0, 7, 1)]
    assert [(p.name, p.id, p.instanceCount, p.multiprocessorCount) for p in profiles] == [
        ("MIG 1c.2g.20gb", 0, 2, 16), ("MIG 1c.2g.20gb", 7, 1, 26), ("MIG 2g.20gb", 1, 1, 32)]
    compute_instance = nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 7)
    assert nvml.nvmlComputeInstanceGetInfo(compute_instance).profileId == 7


# --- A30: instance counts NVML gets wrong --------------------------------------------------------


def test_a30_reports_wrong_instance_counts_but_creates_only_the_real_number(state_path):
    # mig-parted hard-codes the A30 table because NVML "reports incorrect profiles for this GPU"
    # (pkg/mig/discovery/discovery.go @ab1c1452); the real limits are the nvidia-smi ones (§3.3).
    nvml = started("a30", state_path, driver=R580)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    enable_mig(nvml, 0)
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert info.instanceCount != 4
    created = 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        for _ in range(info.instanceCount):
            nvml.nvmlDeviceCreateGpuInstance(device, info.id)
            created += 1
    assert created == 4


# --- a GPU passed through to a virtual machine ---------------------------------------------------


def test_passthrough_ampere_mig_mode_waits_for_a_reboot_and_resets_are_not_offered(state_path):
    # nvml.h, nvmlDeviceSetMigMode: on pass-through virtualization "reset functionality may not be
    # exposed directly, VM reboot is required. activationStatus would return NVML_ERROR_RESET_REQUIRED".
    nvml = started("A100-SXM4-40GB:1", state_path)
    nvml.sim_set_passthrough(True)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetVirtualizationMode(device) == pynvml.NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH
    status = nvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert status == pynvml.NVML_ERROR_RESET_REQUIRED
    assert nvml.nvmlDeviceGetMigMode(device) == [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.sim_reset_gpu(0)
    with pytest.raises(SimError, match="true or false"):
        nvml.sim_set_passthrough("yes")
    # the node stays a VM for the next simulator on the same machine
    again = started("A100-SXM4-40GB:1", state_path)
    assert again.nvmlDeviceGetVirtualizationMode(again.nvmlDeviceGetHandleByIndex(0)) == \
        pynvml.NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH
