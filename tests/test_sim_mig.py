"""GPU and compute instance behaviour of the simulator, held to the reference (§1, §5, §7)."""

import ctypes

import pynvml
import pytest

from gpud.nvml.sim.scenarios import enable_mig, reset_released, started

P = pynvml  # profile constants and errors come from pynvml itself

# A100-40GB profile ids (info.id, §3.1)
ID_1G_5GB, ID_1G_5GB_ME, ID_1G_10GB, ID_2G, ID_3G, ID_4G, ID_7G = 19, 20, 15, 14, 9, 5, 0


@pytest.fixture
def a100(tmp_path):
    nvml = started("dgx-a100", tmp_path / "state.json")
    return nvml, enable_mig(nvml, 0)


def placement(start, size):
    return pynvml.c_nvmlGpuInstancePlacement_t(start, size)


def create_at(nvml, device, profile_id, start, size):
    return nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        device, profile_id, ctypes.byref(placement(start, size))
    )


def gi_layout(nvml, gpu_instance):
    info = nvml.nvmlGpuInstanceGetInfo(gpu_instance)
    return (info.placement.start, info.placement.size, info.id)


def remaining(nvml, device, profile_ids):
    return [nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, p) for p in profile_ids]


# --- profile constants vs ids -------------------------------------------------------------------


def test_profile_constant_is_not_the_profile_id(a100):
    nvml, device = a100
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert (P.NVML_GPU_INSTANCE_PROFILE_1_SLICE, info.id) == (0, 19)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, info.id)
    assert nvml.nvmlGpuInstanceGetInfo(gpu_instance).profileId == 19
    nvml.nvmlGpuInstanceDestroy(gpu_instance)
    # Passing the constant where the id belongs is the classic bug: 0 is the 7g profile's id.
    whole = nvml.nvmlDeviceCreateGpuInstance(device, P.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert gi_layout(nvml, whole) == (0, 8, 0)


def test_bad_profile_constants_and_ids(a100):
    nvml, device = a100
    with pytest.raises(P.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, P.NVML_GPU_INSTANCE_PROFILE_COUNT)
    with pytest.raises(P.NVMLError_NotSupported):  # 8_SLICE exists in NVML, not on an A100
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, P.NVML_GPU_INSTANCE_PROFILE_8_SLICE)
    for call in (nvml.nvmlDeviceCreateGpuInstance, nvml.nvmlDeviceGetGpuInstanceRemainingCapacity):
        with pytest.raises(P.NVMLError_InvalidArgument):
            call(device, 1)  # no A100 profile has id 1


# --- placements and capacity ---------------------------------------------------------------------


def test_3g_possible_placements_are_starts_0_and_4(a100):
    nvml, device = a100
    count = ctypes.c_uint()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, ID_3G, None, ctypes.byref(count))
    assert count.value == 2
    array = (pynvml.c_nvmlGpuInstancePlacement_t * 2)()
    assert nvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, ID_3G, array, ctypes.byref(count)) == 0
    assert [(p.start, p.size) for p in array] == [(0, 4), (4, 4)]


def test_placement_array_too_small_is_insufficient_size(a100):
    nvml, device = a100
    count = ctypes.c_uint(3)
    array = (pynvml.c_nvmlGpuInstancePlacement_t * 3)()
    with pytest.raises(P.NVMLError_InsufficientSize):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, ID_1G_5GB, array, ctypes.byref(count))
    assert count.value == 7  # tells the caller how much room it needs


def test_seven_1g_5gb_fit_and_an_eighth_does_not(a100):
    nvml, device = a100
    created = [nvml.nvmlDeviceCreateGpuInstance(device, ID_1G_5GB) for _ in range(7)]
    assert sorted(gi_layout(nvml, gi)[0] for gi in created) == list(range(7))
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, ID_1G_5GB) == 0
    with pytest.raises(P.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(device, ID_1G_5GB)


def test_4g_and_3g_fit_together_but_not_a_second_4g(a100):
    nvml, device = a100
    four = nvml.nvmlDeviceCreateGpuInstance(device, ID_4G)
    three = nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    assert gi_layout(nvml, four) == (0, 4, 1)
    assert gi_layout(nvml, three) == (4, 4, 2)
    with pytest.raises(P.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(device, ID_4G)


def test_create_with_placement_errors(a100):
    nvml, device = a100
    with pytest.raises(P.NVMLError_InvalidArgument):  # size must be the memory-slice size, 4
        create_at(nvml, device, ID_3G, 0, 3)
    with pytest.raises(P.NVMLError_InvalidArgument):  # not a 3g start
        create_at(nvml, device, ID_3G, 2, 4)
    create_at(nvml, device, ID_2G, 4, 2)
    with pytest.raises(P.NVMLError_InsufficientResources):  # overlaps the 2g
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_3G, placement(4, 4))
    three = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_3G, placement(0, 4))  # struct works too
    assert gi_layout(nvml, three) == (0, 4, 1)


def test_media_extension_profile_allows_one_instance(a100):
    nvml, device = a100
    create_at(nvml, device, ID_1G_5GB_ME, 0, 1)
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, ID_1G_5GB_ME) == 0
    with pytest.raises(P.NVMLError_InsufficientResources):
        create_at(nvml, device, ID_1G_5GB_ME, 3, 1)


def test_remaining_capacity_follows_the_reference_progression(a100):
    """§5.1, A100-40GB: Free counts after each create."""
    nvml, device = a100
    order = [ID_1G_5GB, ID_1G_5GB_ME, ID_1G_10GB, ID_2G, ID_3G, ID_4G, ID_7G]
    assert remaining(nvml, device, order) == [7, 1, 4, 3, 2, 1, 1]
    create_at(nvml, device, ID_4G, 0, 4)
    assert remaining(nvml, device, order) == [3, 1, 2, 1, 1, 0, 0]
    create_at(nvml, device, ID_2G, 4, 2)
    assert remaining(nvml, device, order) == [1, 1, 1, 0, 0, 0, 0]
    create_at(nvml, device, ID_1G_5GB, 6, 1)
    assert remaining(nvml, device, order) == [0, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    ("sequence", "expected"),
    [  # §5.2, observed on A100: (start, size, GI id) per create
        ([19, 14, 5], [(6, 1, 13), (4, 2, 5), (0, 4, 1)]),
        ([9, 19, 14, 19], [(4, 4, 2), (0, 1, 7), (2, 2, 4), (1, 1, 8)]),
        ([14, 19, 19, 19, 19, 19], [(4, 2, 5), (6, 1, 13), (0, 1, 7), (1, 1, 8), (2, 1, 9), (3, 1, 10)]),
        ([19, 19, 14], [(6, 1, 13), (4, 1, 11), (0, 2, 3)]),
    ],
)
def test_auto_placement_reproduces_the_reference_transcripts(a100, sequence, expected):
    nvml, device = a100
    created = [nvml.nvmlDeviceCreateGpuInstance(device, profile_id) for profile_id in sequence]
    assert [gi_layout(nvml, gi) for gi in created] == expected


def test_3g_after_two_1g_and_a_2g_fails(a100):
    """§5.2 known issue: 19, 19, 14 leaves no room for a 3g."""
    nvml, device = a100
    for profile_id in (19, 19, 14):
        nvml.nvmlDeviceCreateGpuInstance(device, profile_id)
    with pytest.raises(P.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)


def test_gpu_instance_ids_are_the_swizzid_tree(a100):
    nvml, device = a100
    assert gi_layout(nvml, create_at(nvml, device, ID_1G_10GB, 6, 2)) == (6, 2, 6)
    assert gi_layout(nvml, create_at(nvml, device, ID_1G_5GB, 5, 1)) == (5, 1, 12)
    assert gi_layout(nvml, create_at(nvml, device, ID_2G, 0, 2)) == (0, 2, 3)


def test_a30_has_four_slots_and_ids_0_to_6(tmp_path):
    nvml = started("a30", tmp_path / "state.json")
    device = enable_mig(nvml, 0)
    # §3.3: a 1g.6gb created on an empty A30 went to 0:1 and got GI id 3
    assert gi_layout(nvml, nvml.nvmlDeviceCreateGpuInstance(device, 14)) == (0, 1, 3)
    assert gi_layout(nvml, create_at(nvml, device, 14, 1, 1)) == (1, 1, 4)
    assert gi_layout(nvml, create_at(nvml, device, 5, 2, 2)) == (2, 2, 2)
    with pytest.raises(P.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(device, 0)  # 4g.24gb needs the whole GPU


def test_h100_double_memory_1g_placements(tmp_path):
    nvml = started("hgx-h100", tmp_path / "state.json")
    device = enable_mig(nvml, 0)
    created = [create_at(nvml, device, 15, start, 2) for start in (0, 2, 4, 6)]
    assert [gi_layout(nvml, gi) for gi in created] == [(0, 2, 3), (2, 2, 4), (4, 2, 5), (6, 2, 6)]
    with pytest.raises(P.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(device, 19)


# --- MIG mode -------------------------------------------------------------------------------------


def test_instance_calls_need_mig_mode_but_r580_profile_queries_do_not(tmp_path):
    """R580 with MIG off (H100 capture): profile queries and an empty instance list answer;
    creating or finding an instance needs MIG mode (nvml.h). Other branches: test_sim_drivers.py."""
    nvml = started("dgx-a100", tmp_path / "state.json", "580.65.06")
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    not_supported_calls = [
        lambda: nvml.nvmlDeviceCreateGpuInstance(device, ID_3G),
        lambda: nvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_3G, placement(0, 4)),
        lambda: nvml.nvmlDeviceGetGpuInstanceById(device, 1),
    ]
    for call in not_supported_calls:
        with pytest.raises(P.NVMLError_NotSupported):
            call()
    count = ctypes.c_uint()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, ID_3G, None, ctypes.byref(count))
    assert count.value == 2
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, P.NVML_GPU_INSTANCE_PROFILE_3_SLICE).id == ID_3G
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, ID_3G) == 2
    instances = ctypes.c_uint(2)
    nvml.nvmlDeviceGetGpuInstances(device, ID_3G, (P.c_nvmlGpuInstance_t * 2)(), ctypes.byref(instances))
    assert instances.value == 0


def test_ampere_mig_mode_stays_pending_until_reset(tmp_path):
    """Another client on the GPU (here DCGM) keeps the change pending (MIG user guide: "pending
    enable state ... In use by another client"); the operator stops it and resets the GPU."""
    nvml = started("dgx-a100", tmp_path / "state.json")
    nvml.sim_add_holder(0, "nv-hostengine", 4242)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceSetMigMode(device, P.NVML_DEVICE_MIG_ENABLE) == P.NVML_ERROR_IN_USE
    assert nvml.nvmlDeviceGetMigMode(device) == [P.NVML_DEVICE_MIG_DISABLE, P.NVML_DEVICE_MIG_ENABLE]
    with pytest.raises(P.NVMLError_NotSupported):
        nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    nvml.sim_release_holders(0)
    reset_released(nvml, [0])
    assert nvml.nvmlDeviceGetMigMode(device) == [P.NVML_DEVICE_MIG_ENABLE, P.NVML_DEVICE_MIG_ENABLE]
    nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)


def test_ampere_pending_mode_can_be_taken_back(tmp_path):
    nvml = started("a30", tmp_path / "state.json")
    nvml.sim_set_processes(0, [77])  # a CUDA application keeps the change pending
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceSetMigMode(device, P.NVML_DEVICE_MIG_ENABLE) == P.NVML_ERROR_IN_USE
    assert nvml.nvmlDeviceSetMigMode(device, P.NVML_DEVICE_MIG_DISABLE) == P.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(device) == [0, 0]


def test_hopper_mig_mode_changes_at_once(tmp_path):
    nvml = started("hgx-h200", tmp_path / "state.json")
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceSetMigMode(device, P.NVML_DEVICE_MIG_ENABLE) == P.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(device) == [1, 1]
    assert nvml.nvmlDeviceSetMigMode(device, P.NVML_DEVICE_MIG_DISABLE) == P.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(device) == [0, 0]


def test_hopper_mig_mode_change_refused_while_processes_run(tmp_path):
    nvml = started("hgx-h100", tmp_path / "state.json")
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.sim_set_processes(0, [4242])
    with pytest.raises(P.NVMLError_InUse):
        nvml.nvmlDeviceSetMigMode(device, P.NVML_DEVICE_MIG_ENABLE)


def test_mig_mode_change_refused_while_gpu_instances_exist(a100):
    nvml, device = a100
    nvml.nvmlDeviceCreateGpuInstance(device, ID_1G_5GB)
    with pytest.raises(P.NVMLError_InUse):
        nvml.nvmlDeviceSetMigMode(device, P.NVML_DEVICE_MIG_DISABLE)
    assert nvml.nvmlDeviceSetMigMode(device, P.NVML_DEVICE_MIG_ENABLE) == P.NVML_SUCCESS  # no change


def test_invalid_mig_mode(a100):
    nvml, device = a100
    with pytest.raises(P.NVMLError_InvalidArgument):
        nvml.nvmlDeviceSetMigMode(device, 2)


# --- listing, lookup, destroy -----------------------------------------------------------------------


def test_get_gpu_instances_fills_a_handle_array(a100):
    nvml, device = a100
    first = nvml.nvmlDeviceCreateGpuInstance(device, ID_1G_5GB)
    second = nvml.nvmlDeviceCreateGpuInstance(device, ID_1G_5GB)
    nvml.nvmlDeviceCreateGpuInstance(device, ID_2G)
    count = ctypes.c_uint(7)
    array = (pynvml.c_nvmlGpuInstance_t * 7)()
    nvml.nvmlDeviceGetGpuInstances(device, ID_1G_5GB, array, ctypes.byref(count))
    assert count.value == 2
    # The array holds plain pynvml pointers; they work as handles.
    ids = [nvml.nvmlGpuInstanceGetInfo(array[i]).id for i in range(count.value)]
    assert ids == sorted(nvml.nvmlGpuInstanceGetInfo(gi).id for gi in (first, second))
    assert array[0] in (first, second)


def test_get_gpu_instance_by_id(a100):
    nvml, device = a100
    created = nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    gi_id = nvml.nvmlGpuInstanceGetInfo(created).id
    assert nvml.nvmlDeviceGetGpuInstanceById(device, gi_id) == created
    with pytest.raises(P.NVMLError_NotFound):
        nvml.nvmlDeviceGetGpuInstanceById(device, 13)


def test_gpu_instance_info_points_at_the_parent_gpu(a100):
    nvml, device = a100
    info = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceCreateGpuInstance(device, ID_2G))
    assert nvml.nvmlDeviceGetUUID(info.device) == nvml.nvmlDeviceGetUUID(device)
    assert (info.profileId, info.placement.start, info.placement.size) == (ID_2G, 4, 2)


def test_destroying_a_gpu_instance_with_a_compute_instance_is_in_use(a100):
    nvml, device = a100
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    compute_instance = nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 2)
    with pytest.raises(P.NVMLError_InUse):
        nvml.nvmlGpuInstanceDestroy(gpu_instance)
    nvml.nvmlComputeInstanceDestroy(compute_instance)
    nvml.nvmlGpuInstanceDestroy(gpu_instance)
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, ID_7G) == 1


def test_handles_of_destroyed_instances_are_not_found(a100):
    """Decision: a handle to a destroyed GI/CI raises NOT_FOUND, even when the id is reused."""
    nvml, device = a100
    old = nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    old_ci = nvml.nvmlGpuInstanceCreateComputeInstance(old, 2)
    nvml.nvmlComputeInstanceDestroy(old_ci)
    nvml.nvmlGpuInstanceDestroy(old)
    new = nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    assert nvml.nvmlGpuInstanceGetInfo(new).id == 2
    for call in (
        lambda: nvml.nvmlGpuInstanceGetInfo(old),
        lambda: nvml.nvmlGpuInstanceDestroy(old),
        lambda: nvml.nvmlComputeInstanceGetInfo(old_ci),
        lambda: nvml.nvmlComputeInstanceDestroy(old_ci),
    ):
        with pytest.raises(P.NVMLError_NotFound):
            call()


def test_wrong_kind_of_handle_is_invalid_argument(a100):
    nvml, device = a100
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    for call in (
        lambda: nvml.nvmlGpuInstanceGetInfo(device),
        lambda: nvml.nvmlDeviceGetName(gpu_instance),
        lambda: nvml.nvmlGpuInstanceGetInfo(None),
        lambda: nvml.nvmlDeviceGetName(1234),
    ):
        with pytest.raises(P.NVMLError_InvalidArgument):
            call()


# --- compute instances ----------------------------------------------------------------------------


def test_compute_instance_ids_are_lowest_free(a100):
    nvml, device = a100
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    created = [nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 0) for _ in range(3)]
    assert [nvml.nvmlComputeInstanceGetInfo(ci).id for ci in created] == [0, 1, 2]
    nvml.nvmlComputeInstanceDestroy(created[1])
    again = nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 0)
    assert nvml.nvmlComputeInstanceGetInfo(again).id == 1


def test_compute_instance_remaining_capacity_in_a_2g(a100):
    """§5.1: in a 2g GI, 1c goes 2/2 -> 1/2 and 2c 1/1 -> 0/1 after one 1c."""
    nvml, device = a100
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, ID_2G)
    capacity = nvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity
    assert (capacity(gpu_instance, 0), capacity(gpu_instance, 1)) == (2, 1)
    nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 0)
    assert (capacity(gpu_instance, 0), capacity(gpu_instance, 1)) == (1, 0)


def test_1c_then_2c_fit_in_a_3g(a100):
    """§4.3: in a 3g GI, creating 1c then 2c both succeed (the 1c goes to slot 2)."""
    nvml, device = a100
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    one = nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 0)
    two = nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 1)
    spans = [nvml.nvmlComputeInstanceGetInfo(ci).placement for ci in (one, two)]
    assert [(s.start, s.size) for s in spans] == [(2, 1), (0, 2)]


def test_compute_instance_with_placement(a100):
    nvml, device = a100
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, ID_7G)
    at = pynvml.c_nvmlComputeInstancePlacement_t
    with pytest.raises(P.NVMLError_InvalidArgument):
        nvml.nvmlGpuInstanceCreateComputeInstanceWithPlacement(gpu_instance, 2, at(3, 3))
    created = nvml.nvmlGpuInstanceCreateComputeInstanceWithPlacement(gpu_instance, 2, ctypes.byref(at(4, 3)))
    assert nvml.nvmlComputeInstanceGetInfo(created).placement.start == 4
    with pytest.raises(P.NVMLError_InsufficientResources):
        nvml.nvmlGpuInstanceCreateComputeInstanceWithPlacement(gpu_instance, 1, at(4, 2))
    with pytest.raises(P.NVMLError_InsufficientResources):
        nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 4)  # 7c needs the whole GI


def test_compute_instance_profile_errors(a100):
    nvml, device = a100
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, ID_4G)
    with pytest.raises(P.NVMLError_NotSupported):  # a 4g offers no 3c (§4.2)
        nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, P.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    with pytest.raises(P.NVMLError_InvalidArgument):
        nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, P.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
    with pytest.raises(P.NVMLError_InvalidArgument):
        nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, 0, 1)  # engine profile


def test_compute_instance_listing_and_lookup(a100):
    nvml, device = a100
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, ID_7G)
    created = [nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 1) for _ in range(2)]
    count = ctypes.c_uint(3)
    array = (pynvml.c_nvmlComputeInstance_t * 3)()
    nvml.nvmlGpuInstanceGetComputeInstances(gpu_instance, 1, array, ctypes.byref(count))
    assert count.value == 2
    assert [nvml.nvmlComputeInstanceGetInfo(array[i]).id for i in range(2)] == [0, 1]
    assert nvml.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, 1) == created[1]
    with pytest.raises(P.NVMLError_NotFound):
        nvml.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, 5)
    info = nvml.nvmlComputeInstanceGetInfo_v2(created[0])
    assert nvml.nvmlDeviceGetUUID(info.device) == nvml.nvmlDeviceGetUUID(device)  # parent GPU
    assert nvml.nvmlGpuInstanceGetInfo(info.gpuInstance).id == 0


def test_processes_block_compute_instance_destroy(a100):
    nvml, device = a100
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, ID_1G_5GB)
    compute_instance = nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 0)
    mig_uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0))
    nvml.sim_set_processes(mig_uuid, [1001])
    with pytest.raises(P.NVMLError_InUse):
        nvml.nvmlComputeInstanceDestroy(compute_instance)
    with pytest.raises(P.NVMLError_InUse):
        nvml.nvmlGpuInstanceDestroy(gpu_instance)
    nvml.sim_set_processes(mig_uuid, [])
    nvml.nvmlComputeInstanceDestroy(compute_instance)
    nvml.nvmlGpuInstanceDestroy(gpu_instance)
