"""MIG through NVML: read a GPU's profile table and instance tree, and change them.

Every function here runs on the NVML thread and takes the backend module (real pynvml or the
simulator) as its first argument.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import replace
from typing import Any

from gpud.model.mig import (
    CiProfile,
    ComputeInstanceState,
    GiProfile,
    GpuInstanceState,
    MigCapabilities,
    Placement,
)
from gpud.nvml.mig_tables import derive_ci_profiles

# GPU-instance profile constants whose instances carry an attribute in their name.
_PROFILE_SUFFIXES = {
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1": "+me",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1": "+me",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME": "+me.all",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME": "+me.all",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME": "-me",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME": "-me",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX": "+gfx",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX": "+gfx",
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX": "+gfx",
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX": "+gfx",  # 0x11, nvml.h 13.x (pynvml 13.615 has it)
}


def mig_memory_gb(instance_mib: int, device_mib: int) -> int:
    """The 'Ngb' of a MIG profile name, as NVIDIA's tools derive it.

    The instance's share of the device, rounded up to an eighth, times the device size in GiB
    rounded up: names stay the same across drivers whose exact sizes differ by a few MiB.
    """
    eighths = math.ceil(instance_mib * 8 / device_mib - 1e-9)
    return math.floor(eighths / 8 * math.ceil(device_mib / 1024) + 0.5)  # half away from zero, not to even


def gi_profile_name(slices: int, instance_mib: int, device_mib: int, suffix: str = "") -> str:
    """A GPU-instance profile's name, e.g. "3g.20gb" or "1g.5gb+me"."""
    return f"{slices}g.{mig_memory_gb(instance_mib, device_mib)}gb{suffix}"


_CI_SLICE_CONSTANTS = {1: "1_SLICE", 2: "2_SLICE", 3: "3_SLICE", 4: "4_SLICE", 6: "6_SLICE", 7: "7_SLICE",
                       8: "8_SLICE"}


def read_capabilities(nvml: Any, handle: Any, device_mib: int) -> MigCapabilities:
    """The GPU's MIG profile table as the driver answers it under the current MIG mode.

    nvml.h fixes the table only for the lifetime of a MIG mode, and R535 answers NOT_SUPPORTED for
    every profile while MIG is disabled (NVIDIA/mig-parted commit 219e780d: "Older drivers such as
    R535 does not support querying MIG profiles when MIG mode is disabled"), R580 answers (our H100
    capture): an empty table means "not answered now".
    Constants the GPU lacks answer NOT_SUPPORTED, past the last one INVALID_ARGUMENT (our capture:
    0x11 on H100). Compute-instance profiles are derived here; `read_instances` replaces them with
    NVML's once a GPU instance of the profile exists.
    """
    suffixes = {getattr(nvml, name): suffix for name, suffix in _PROFILE_SUFFIXES.items() if hasattr(nvml, name)}
    ci_constants = {slices: getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{name}")
                    for slices, name in _CI_SLICE_CONSTANTS.items()
                    if hasattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{name}")}
    profiles = []
    for constant in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            continue
        profiles.append(GiProfile(
            id=info.id, constant=constant,
            name=gi_profile_name(info.sliceCount, info.memorySizeMB, device_mib, suffixes.get(constant, "")),
            slices=info.sliceCount, memory_mib=info.memorySizeMB, instance_count=info.instanceCount,
            placements=_gi_placements(nvml, handle, info.id),
            ci_profiles=derive_ci_profiles(info.sliceCount, ci_constants, _whole_ci_constant(nvml, constant)),
            multiprocessors=info.multiprocessorCount, copy_engines=info.copyEngineCount, decoders=info.decoderCount,
            encoders=info.encoderCount, jpeg_engines=info.jpegCount, ofa_engines=info.ofaCount,
        ))
    memory_slices = max((p.start + p.size for g in profiles for p in g.placements), default=0)
    return MigCapabilities(memory_slices=memory_slices, gi_profiles=tuple(profiles))


def _whole_ci_constant(nvml: Any, gi_constant: int) -> int | None:
    """A double-memory 1g GI (REV2) offers its single slice as CI profile 1_SLICE_REV1 (seen once:
    `nvidia-smi mig -cgi 15 -C` on an H100 made CI profile ID 7)."""
    if gi_constant == getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2", None):
        return nvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1
    return None


def _gi_placements(nvml: Any, handle: Any, profile_id: int) -> tuple[Placement, ...]:
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    array = (nvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
    return tuple(Placement(p.start, p.size) for p in array[:count.value])


def read_ci_profiles(nvml: Any, gi: Any, profile: GiProfile) -> tuple[CiProfile, ...] | None:
    """The compute-instance profiles a GPU instance offers, as NVML answers through it: every
    constant is asked (nvml.h: NOT_SUPPORTED for one the GI does not offer, INVALID_ARGUMENT past
    the last), with its placements. Smallest first; of the profiles that take the whole GI, the
    one nvidia-smi creates by default last (1_SLICE_REV1 in a REV2 GI). None when the driver
    cannot answer (an older one without the calls): the derived profiles stay."""
    whole = profile.whole_ci.constant
    found = []
    try:
        for constant in range(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, constant, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
                continue
            found.append(CiProfile(constant=constant, slices=info.sliceCount,
                                   starts=_ci_starts(nvml, gi, info.id, profile.slices)))
    except nvml.NVMLError_FunctionNotFound:
        return None
    found = [ci for ci in found if ci.starts]
    if not any(ci.slices == profile.slices for ci in found):
        return None  # no profile takes the whole GI: not a table gpud can plan with
    return tuple(sorted(found, key=lambda ci: (ci.slices, ci.constant == whole)))


def _ci_starts(nvml: Any, gi: Any, profile_id: int, gi_slices: int) -> tuple[int, ...]:
    count = ctypes.c_uint(0)
    nvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi, profile_id, None, ctypes.byref(count))
    array = (nvml.c_nvmlComputeInstancePlacement_t * max(count.value, gi_slices, 1))()
    nvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi, profile_id, array, ctypes.byref(count))
    return tuple(sorted(p.start for p in array[:count.value]))


def read_instances(nvml: Any, handle: Any, capabilities: MigCapabilities,
                   mig_devices: dict[tuple[int, int], tuple[str, tuple[int, ...]]]
                   ) -> tuple[tuple[GpuInstanceState, ...], MigCapabilities]:
    """The GPU's GPU instances with their compute instances, empty ones included (a MIG device list
    shows only GIs that have a compute instance). mig_devices: (gi_id, ci_id) -> (MIG UUID, PIDs).

    Also the table completed with what only a GPU instance tells: the compute-instance profiles of
    every GI profile that has an instance now, read from NVML (the others keep derived ones)."""
    instances, profiles = [], []
    for profile in capabilities.gi_profiles:
        gis = _gpu_instances(nvml, handle, profile, capabilities.memory_slices)
        if gis and profile.ci_source != "nvml":
            read = read_ci_profiles(nvml, gis[0], profile)
            profile = replace(profile, ci_profiles=read, ci_source="nvml") if read else profile
        profiles.append(profile)
        instances += [_gpu_instance_state(nvml, gi, profile, mig_devices) for gi in gis]
    return (tuple(sorted(instances, key=lambda gi: gi.gi_id)),
            replace(capabilities, gi_profiles=tuple(profiles)))


def _gpu_instance_state(nvml: Any, gi: Any, profile: GiProfile, mig_devices: dict) -> GpuInstanceState:
    info = nvml.nvmlGpuInstanceGetInfo(gi)
    cis = tuple(sorted((_compute_instance_state(nvml, ci, info.id, mig_devices)
                        for ci_profile in profile.ci_profiles
                        for ci in _compute_instances(nvml, gi, ci_profile.constant, profile.slices)),
                       key=lambda c: c.ci_id))
    return GpuInstanceState(gi_id=info.id, profile_id=info.profileId,
                            placement=Placement(info.placement.start, info.placement.size), compute_instances=cis)


def _gpu_instances(nvml: Any, handle: Any, profile: GiProfile, memory_slices: int) -> list:
    # Sized for as many GIs as memory slices: the count NVML reports can be wrong (A30: NVIDIA/mig-parted
    # pkg/mig/discovery/discovery.go).
    size = max(profile.instance_count, memory_slices, 1)
    count = ctypes.c_uint(size)
    array = (nvml.c_nvmlGpuInstance_t * size)()
    nvml.nvmlDeviceGetGpuInstances(handle, profile.id, array, ctypes.byref(count))
    return list(array[:count.value])


def _compute_instances(nvml: Any, gi: Any, constant: int, gi_slices: int) -> list:
    try:
        profile = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, constant, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
        return []
    size = max(profile.instanceCount, gi_slices, 1)
    count = ctypes.c_uint(size)
    array = (nvml.c_nvmlComputeInstance_t * size)()
    nvml.nvmlGpuInstanceGetComputeInstances(gi, profile.id, array, ctypes.byref(count))
    return list(array[:count.value])


def _compute_instance_state(nvml: Any, ci: Any, gi_id: int, mig_devices: dict) -> ComputeInstanceState:
    info = nvml.nvmlComputeInstanceGetInfo(ci)
    uuid, pids = mig_devices.get((gi_id, info.id), ("", ()))
    return ComputeInstanceState(ci_id=info.id, profile_id=info.profileId, start=info.placement.start,
                                slices=info.placement.size, uuid=uuid, pids=pids)


# -- changes ---------------------------------------------------------------------------------


def set_mig_mode(nvml: Any, index: int, enabled: bool) -> str:
    """Requests the MIG mode: "active" when it took effect, "needs-reset" when it waits for a GPU
    reset, "needs-reboot" when only a reboot can apply it.

    The activation status SetMigMode returns says which (nvml.h, nvmlDeviceSetMigMode): the driver
    resets the GPU itself when it is idle; IN_USE when it is not (other clients hold it: NVIDIA's
    DRA driver logs it as "in use by another client"); RESET_REQUIRED where the platform does not
    expose a reset (pass-through VMs), which needs a reboot. GetMigMode confirms it, as mig-parted
    does (NVIDIA/mig-parted cmd/nvidia-mig-parted/apply/mode.go, IsMigModeChangePending).
    """
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    wanted = nvml.NVML_DEVICE_MIG_ENABLE if enabled else nvml.NVML_DEVICE_MIG_DISABLE
    status = nvml.nvmlDeviceSetMigMode(handle, wanted)
    current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    if status == nvml.NVML_SUCCESS and current == wanted:
        return "active"
    return "needs-reboot" if status == nvml.NVML_ERROR_RESET_REQUIRED else "needs-reset"


def _gpu_instance(nvml: Any, index: int, gi_id: int) -> Any:
    return nvml.nvmlDeviceGetGpuInstanceById(nvml.nvmlDeviceGetHandleByIndex(index), gi_id)


def destroy_compute_instance(nvml: Any, index: int, gi_id: int, ci_id: int) -> None:
    nvml.nvmlComputeInstanceDestroy(nvml.nvmlGpuInstanceGetComputeInstanceById(_gpu_instance(nvml, index, gi_id),
                                                                                ci_id))


def destroy_gpu_instance(nvml: Any, index: int, gi_id: int) -> None:
    nvml.nvmlGpuInstanceDestroy(_gpu_instance(nvml, index, gi_id))


def create_gpu_instance(nvml: Any, index: int, profile_id: int, placement: Placement) -> int:
    """Creates the GPU instance at exactly that placement; returns its id."""
    where = nvml.c_nvmlGpuInstancePlacement_t()
    where.start, where.size = placement.start, placement.size
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(nvml.nvmlDeviceGetHandleByIndex(index), profile_id,
                                                       ctypes.byref(where))
    return nvml.nvmlGpuInstanceGetInfo(gi).id


def create_compute_instance(nvml: Any, index: int, gi_id: int, constant: int, start: int, slices: int) -> int:
    """Creates the compute instance at exactly that start inside the GPU instance; returns its id."""
    gi = _gpu_instance(nvml, index, gi_id)
    profile = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, constant,
                                                                nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    where = nvml.c_nvmlComputeInstancePlacement_t()
    where.start, where.size = start, slices
    ci = nvml.nvmlGpuInstanceCreateComputeInstanceWithPlacement(gi, profile.id, ctypes.byref(where))
    return nvml.nvmlComputeInstanceGetInfo(ci).id
