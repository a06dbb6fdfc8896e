"""The simulator's MIG profile tables, checked against /work/shared/reference/mig-profiles.md.

Every expected value below is typed in from the reference tables, not taken from the simulator.
The simulators run driver R580, which answers profile queries with MIG mode off (H100 capture);
R535/R550 answer them only with MIG on (tests/test_sim_drivers.py).
"""

import ctypes

import pynvml
import pytest

from gpud.nvml.sim.scenarios import enable_mig, started

ALL_1_SLOTS = [0, 1, 2, 3, 4, 5, 6]
R580 = "580.65.06"

# name, constant, id, instances, slices, memory MiB, SM, CE, DEC, ENC, JPEG, OFA, starts, size
A100_40GB = [  # §3.1, S5 memory column
    ("1g.5gb", 0x0, 19, 7, 1, 4864, 14, 1, 0, 0, 0, 0, ALL_1_SLOTS, 1),
    ("1g.5gb+me", 0x7, 20, 1, 1, 4864, 14, 1, 1, 0, 1, 1, ALL_1_SLOTS, 1),
    ("1g.10gb", 0x9, 15, 4, 1, 9856, 14, 1, 1, 0, 0, 0, [0, 2, 4, 6], 2),
    ("2g.10gb", 0x1, 14, 3, 2, 9856, 28, 2, 1, 0, 0, 0, [0, 2, 4], 2),
    ("3g.20gb", 0x2, 9, 2, 3, 19968, 42, 3, 2, 0, 0, 0, [0, 4], 4),
    ("4g.20gb", 0x3, 5, 1, 4, 19968, 56, 4, 2, 0, 0, 0, [0], 4),
    ("7g.40gb", 0x4, 0, 1, 7, 40192, 98, 7, 5, 0, 1, 1, [0], 8),
]
A100_80GB = [  # §3.2
    ("1g.10gb", 0x0, 19, 7, 1, 9728, 14, 1, 0, 0, 0, 0, ALL_1_SLOTS, 1),
    ("1g.10gb+me", 0x7, 20, 1, 1, 9728, 14, 1, 1, 0, 1, 1, ALL_1_SLOTS, 1),
    ("1g.20gb", 0x9, 15, 4, 1, 19968, 14, 1, 1, 0, 0, 0, [0, 2, 4, 6], 2),
    ("2g.20gb", 0x1, 14, 3, 2, 19968, 28, 2, 1, 0, 0, 0, [0, 2, 4], 2),
    ("3g.40gb", 0x2, 9, 2, 3, 40192, 42, 3, 2, 0, 0, 0, [0, 4], 4),
    ("4g.40gb", 0x3, 5, 1, 4, 40192, 56, 4, 2, 0, 0, 0, [0], 4),
    ("7g.80gb", 0x4, 0, 1, 7, 80640, 98, 7, 5, 0, 1, 1, [0], 8),
]
A30 = [  # §3.3: 4 memory slices
    ("1g.6gb", 0x0, 14, 4, 1, 5952, 14, 1, 1, 0, 0, 0, [0, 1, 2, 3], 1),
    ("1g.6gb+me", 0x7, 21, 1, 1, 5952, 14, 1, 1, 0, 1, 1, [0, 1, 2, 3], 1),
    ("2g.12gb", 0x1, 5, 2, 2, 11968, 28, 2, 2, 0, 0, 0, [0, 2], 2),
    ("2g.12gb+me", 0x8, 6, 1, 2, 11968, 28, 2, 2, 0, 1, 1, [0, 2], 2),
    ("4g.24gb", 0x3, 0, 1, 4, 24064, 56, 4, 4, 0, 1, 1, [0], 4),
]
H100_80GB = [  # §3.4
    ("1g.10gb", 0x0, 19, 7, 1, 9984, 16, 1, 1, 0, 1, 0, ALL_1_SLOTS, 1),
    ("1g.10gb+me", 0x7, 20, 1, 1, 9984, 16, 1, 1, 0, 1, 1, ALL_1_SLOTS, 1),
    ("1g.20gb", 0x9, 15, 4, 1, 20096, 26, 1, 1, 0, 1, 0, [0, 2, 4, 6], 2),
    ("2g.20gb", 0x1, 14, 3, 2, 20096, 32, 2, 2, 0, 2, 0, [0, 2, 4], 2),
    ("3g.40gb", 0x2, 9, 2, 3, 40448, 60, 3, 3, 0, 3, 0, [0, 4], 4),
    ("4g.40gb", 0x3, 5, 1, 4, 40448, 64, 4, 4, 0, 4, 0, [0], 4),
    ("7g.80gb", 0x4, 0, 1, 7, 81152, 132, 8, 7, 0, 7, 1, [0], 8),
]
# §3.8, with the memory R580 reports: the real lgip on 580.159.04 (docs/hardware.md, 2026-11-26) shows
# 32.50/69.75/140.00 GiB where §3.8's older-driver lgip (NVIDIA/mig-parted#120) shows 32.25/69.50/139.75.
H200 = [
    ("1g.18gb", 0x0, 19, 7, 1, 16384, 16, 1, 1, 0, 1, 0, ALL_1_SLOTS, 1),
    ("1g.18gb+me", 0x7, 20, 1, 1, 16384, 16, 1, 1, 0, 1, 1, ALL_1_SLOTS, 1),
    ("1g.35gb", 0x9, 15, 4, 1, 33280, 26, 1, 1, 0, 1, 0, [0, 2, 4, 6], 2),
    ("2g.35gb", 0x1, 14, 3, 2, 33280, 32, 2, 2, 0, 2, 0, [0, 2, 4], 2),
    ("3g.71gb", 0x2, 9, 2, 3, 71424, 60, 3, 3, 0, 3, 0, [0, 4], 4),
    ("4g.71gb", 0x3, 5, 1, 4, 71424, 64, 4, 4, 0, 4, 0, [0], 4),
    ("7g.141gb", 0x4, 0, 1, 7, 143360, 132, 8, 7, 0, 7, 1, [0], 8),
]

# preset, profile table, NVML name, PCI device id, memory MiB (§2), max MIG devices (§6)
MODELS = [
    ("dgx-a100", A100_40GB, "NVIDIA A100-SXM4-40GB", 0x20B010DE, 40960, 7),
    ("dgx-a100-80gb", A100_80GB, "NVIDIA A100-SXM4-80GB", 0x20B210DE, 81920, 7),
    ("a30", A30, "NVIDIA A30", 0x20B710DE, 24576, 4),
    ("hgx-h100", H100_80GB, "NVIDIA H100 80GB HBM3", 0x233010DE, 81559, 7),
    ("hgx-h200", H200, "NVIDIA H200", 0x233510DE, 143771, 7),
]
MODEL_IDS = [model[0] for model in MODELS]


def gi_placements(nvml, device, profile_id):
    count = ctypes.c_uint()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, None, ctypes.byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, array, ctypes.byref(count))
    return [(p.start, p.size) for p in array[: count.value]]


def ci_placements(nvml, gpu_instance, profile_id):
    count = ctypes.c_uint()
    nvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(
        gpu_instance, profile_id, None, ctypes.byref(count)
    )
    array = (pynvml.c_nvmlComputeInstancePlacement_t * count.value)()
    nvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(
        gpu_instance, profile_id, array, ctypes.byref(count)
    )
    return [(p.start, p.size) for p in array[: count.value]]


@pytest.mark.parametrize(
    ("preset", "table", "name", "pci_id", "memory_mib", "max_mig"), MODELS, ids=MODEL_IDS
)
def test_gpu_identity_matches_reference(tmp_path, preset, table, name, pci_id, memory_mib, max_mig):
    nvml = started(preset, tmp_path / "state.json", R580)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetName(device) == name
    assert nvml.nvmlDeviceGetPciInfo(device).pciDeviceId == pci_id
    assert nvml.nvmlDeviceGetMemoryInfo(device).total == memory_mib * 2**20
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(device) == 0  # MIG off
    enable_mig(nvml, 0)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(device) == max_mig


@pytest.mark.parametrize(("preset", "table"), [model[:2] for model in MODELS], ids=MODEL_IDS)
def test_gpu_instance_profiles_match_reference(tmp_path, preset, table):
    nvml = started(preset, tmp_path / "state.json", R580)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    for (
        name,
        constant,
        profile_id,
        instances,
        slices,
        memory,
        sm,
        ce,
        dec,
        enc,
        jpeg,
        ofa,
        starts,
        size,
    ) in table:
        info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, constant)
        assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
        assert (info.id, info.sliceCount, info.memorySizeMB) == (profile_id, slices, memory), name
        # A30: NVML misreports instanceCount (mig-parted hard-codes the A30 table); the real limit is
        # what creation allows (tests/test_sim_drivers.py checks it)
        if preset != "a30":
            assert info.instanceCount == instances, name
        assert (info.multiprocessorCount, info.copyEngineCount, info.decoderCount) == (sm, ce, dec), name
        assert (info.encoderCount, info.jpegCount, info.ofaCount, info.isP2pSupported) == (
            enc,
            jpeg,
            ofa,
            0,
        ), name
        assert info.name == f"MIG {name}"
        assert gi_placements(nvml, device, profile_id) == [(start, size) for start in starts], name


@pytest.mark.parametrize(("preset", "table"), [model[:2] for model in MODELS], ids=MODEL_IDS)
def test_constants_missing_from_the_table_are_not_supported(tmp_path, preset, table):
    nvml = started(preset, tmp_path / "state.json", R580)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    supported = {row[1] for row in table}
    for constant in set(range(pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX)) - supported:  # 0x11: unknown to R580
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, constant)


def test_profile_info_version_1_and_by_id(tmp_path):
    nvml = started("dgx-a100", tmp_path / "state.json", R580)
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    v1 = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, version=1)
    assert isinstance(v1, pynvml.c_nvmlGpuInstanceProfileInfo_t)
    assert (v1.id, v1.memorySizeMB) == (14, 9856)
    by_id = nvml.nvmlDeviceGetGpuInstanceProfileInfoById(device, 14)
    assert by_id.name == "MIG 2g.10gb"
    by_v = nvml.nvmlDeviceGetGpuInstanceProfileInfoV(device, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE)
    assert isinstance(by_v, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
    assert (by_v.id, by_v.name) == (14, "MIG 2g.10gb")  # pynvml's V alias answers as the v2 call does


# GI constant -> [(CI profile id, instanceCount, SMs, placements)] on an A100-40GB (§4.2, §4.3)
A100_COMPUTE_PROFILES = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: [
        (0, 7, 14, [(s, 1) for s in range(7)]),
        (1, 3, 28, [(0, 2), (2, 2), (4, 2)]),
        (2, 2, 42, [(0, 3), (4, 3)]),
        (3, 1, 56, [(0, 4)]),
        (4, 1, 98, [(0, 7)]),
    ],
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: [
        (0, 4, 14, [(0, 1), (1, 1), (2, 1), (3, 1)]),
        (1, 2, 28, [(0, 2), (2, 2)]),
        (3, 1, 56, [(0, 4)]),
    ],
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: [
        (0, 3, 14, [(0, 1), (1, 1), (2, 1)]),
        (1, 1, 28, [(0, 2)]),
        (2, 1, 42, [(0, 3)]),
    ],
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: [(0, 2, 14, [(0, 1), (1, 1)]), (1, 1, 28, [(0, 2)])],
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: [(0, 1, 14, [(0, 1)])],
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: [(7, 1, 14, [(0, 1)])],
}


@pytest.mark.parametrize("gi_constant", list(A100_COMPUTE_PROFILES))
def test_compute_instance_profiles_per_gpu_instance(tmp_path, gi_constant):
    nvml = started("dgx-a100", tmp_path / "state.json", R580)
    device = enable_mig(nvml, 0)
    gi_info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, gi_constant)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, gi_info.id)
    expected = A100_COMPUTE_PROFILES[gi_constant]
    for profile_id, instances, sm, placements in expected:
        info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gpu_instance, profile_id, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        )
        assert (info.id, info.instanceCount, info.multiprocessorCount) == (profile_id, instances, sm)
        assert (info.sharedCopyEngineCount, info.sharedDecoderCount) == (
            gi_info.copyEngineCount,
            gi_info.decoderCount,
        )
        assert ci_placements(nvml, gpu_instance, profile_id) == placements
    offered = {row[0] for row in expected}
    for profile_id in set(range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)) - offered:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, profile_id, 0)


def test_compute_profile_names_follow_mig_device_naming(tmp_path):
    nvml = started("dgx-a100", tmp_path / "state.json", R580)
    device = enable_mig(nvml, 0)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, 9)  # 3g.20gb
    names = [nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, p, 0).name for p in (0, 1, 2)]
    assert names == ["MIG 1c.3g.20gb", "MIG 2c.3g.20gb", "MIG 3g.20gb"]


def test_h100_double_memory_gpu_instance_offers_ci_profile_7(tmp_path):
    nvml = started("hgx-h100", tmp_path / "state.json", R580)
    device = enable_mig(nvml, 0)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, 15)  # 1g.20gb
    compute_instance = nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 7)  # §4.2 / S18
    assert nvml.nvmlComputeInstanceGetInfo(compute_instance).profileId == 7
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, 0)
