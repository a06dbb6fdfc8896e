"""MIG through NVML: read a GPU's profile table and instance tree, and change them.

Every function here runs on the NVML thread and takes the backend module (real pynvml or the
simulator) as its first argument.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import signal
import subprocess
import time
from typing import Any

from gpud.mig.capabilities import derive_ci_profiles
from gpud.mig.model import ComputeInstanceState, GiProfile, GpuInstanceState, MigCapabilities, Placement

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
}


def mig_memory_gb(instance_mib: int, device_mib: int) -> int:
    """The 'Ngb' of a MIG profile name, as NVIDIA's tools derive it.

    The instance's share of the device, rounded up to an eighth, times the device size in GiB
    rounded up: names stay the same across drivers whose exact sizes differ by a few MiB.
    """
    eighths = math.ceil(instance_mib * 8 / device_mib - 1e-9)
    return math.floor(eighths / 8 * math.ceil(device_mib / 1024) + 0.5)  # half away from zero, not to even


def mig_profile_name(gi_slices: int, ci_slices: int, instance_mib: int, device_mib: int, suffix: str = "") -> str:
    base = f"{gi_slices}g.{mig_memory_gb(instance_mib, device_mib)}gb{suffix}"
    return base if ci_slices >= gi_slices else f"{ci_slices}c.{base}"


_CI_SLICE_CONSTANTS = {1: "1_SLICE", 2: "2_SLICE", 3: "3_SLICE", 4: "4_SLICE", 6: "6_SLICE", 7: "7_SLICE",
                       8: "8_SLICE"}


def read_capabilities(nvml: Any, handle: Any, device_mib: int) -> MigCapabilities:
    """The GPU's MIG profile table. NVML answers it with MIG off too, and it never changes for a GPU."""
    suffixes = {getattr(nvml, name): suffix for name, suffix in _PROFILE_SUFFIXES.items() if hasattr(nvml, name)}
    ci_constants = {slices: getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{name}")
                    for slices, name in _CI_SLICE_CONSTANTS.items()
                    if hasattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{name}")}
    double_memory = getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2", None)
    profiles = []
    for constant in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            continue
        whole_ci = nvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1 if constant == double_memory else None
        profiles.append(GiProfile(
            id=info.id, constant=constant,
            name=mig_profile_name(info.sliceCount, info.sliceCount, info.memorySizeMB, device_mib, suffixes.get(constant, "")),
            slices=info.sliceCount, memory_mib=info.memorySizeMB, instance_count=info.instanceCount,
            placements=_gi_placements(nvml, handle, info.id),
            ci_profiles=derive_ci_profiles(info.sliceCount, ci_constants, whole_ci),
        ))
    memory_slices = max((p.start + p.size for g in profiles for p in g.placements), default=0)
    return MigCapabilities(memory_slices=memory_slices, gi_profiles=tuple(profiles))


def _gi_placements(nvml: Any, handle: Any, profile_id: int) -> tuple[Placement, ...]:
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    array = (nvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
    return tuple(Placement(p.start, p.size) for p in array[:count.value])


def read_instances(nvml: Any, handle: Any, capabilities: MigCapabilities,
                   mig_devices: dict[tuple[int, int], tuple[str, tuple[int, ...]]]) -> tuple[GpuInstanceState, ...]:
    """The GPU's GPU instances with their compute instances, empty ones included (a MIG device list
    shows only GIs that have a compute instance). mig_devices: (gi_id, ci_id) -> (MIG UUID, PIDs)."""
    instances = []
    for profile in capabilities.gi_profiles:
        for gi in _gpu_instances(nvml, handle, profile):
            info = nvml.nvmlGpuInstanceGetInfo(gi)
            cis = tuple(sorted(
                (_compute_instance_state(nvml, ci, info.id, mig_devices)
                 for ci_profile in profile.ci_profiles for ci in _compute_instances(nvml, gi, ci_profile.constant)),
                key=lambda c: c.ci_id))
            instances.append(GpuInstanceState(gi_id=info.id, profile_id=info.profileId,
                                              placement=Placement(info.placement.start, info.placement.size),
                                              compute_instances=cis))
    return tuple(sorted(instances, key=lambda gi: gi.gi_id))


def _gpu_instances(nvml: Any, handle: Any, profile: GiProfile) -> list:
    count = ctypes.c_uint(profile.instance_count)
    array = (nvml.c_nvmlGpuInstance_t * profile.instance_count)()
    nvml.nvmlDeviceGetGpuInstances(handle, profile.id, array, ctypes.byref(count))
    return list(array[:count.value])


def _compute_instances(nvml: Any, gi: Any, constant: int) -> list:
    try:
        profile = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, constant, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
        return []
    count = ctypes.c_uint(profile.instanceCount)
    array = (nvml.c_nvmlComputeInstance_t * max(profile.instanceCount, 1))()
    nvml.nvmlGpuInstanceGetComputeInstances(gi, profile.id, array, ctypes.byref(count))
    return list(array[:count.value])


def _compute_instance_state(nvml: Any, ci: Any, gi_id: int, mig_devices: dict) -> ComputeInstanceState:
    info = nvml.nvmlComputeInstanceGetInfo(ci)
    uuid, pids = mig_devices.get((gi_id, info.id), ("", ()))
    return ComputeInstanceState(ci_id=info.id, profile_id=info.profileId, start=info.placement.start,
                                slices=info.placement.size, uuid=uuid, pids=pids)


# -- changes ---------------------------------------------------------------------------------


def set_mig_mode(nvml: Any, index: int, enabled: bool) -> bool:
    """Requests the MIG mode. True when it is active now; False when it waits for a GPU reset (Ampere)."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    nvml.nvmlDeviceSetMigMode(handle, nvml.NVML_DEVICE_MIG_ENABLE if enabled else nvml.NVML_DEVICE_MIG_DISABLE)
    current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    return (current == nvml.NVML_DEVICE_MIG_ENABLE) == enabled


def reset_gpu(nvml: Any, index: int) -> None:
    """What `nvidia-smi -r` does: needed on Ampere for a MIG mode change to take effect."""
    if hasattr(nvml, "sim_reset_gpu"):
        nvml.sim_reset_gpu(index)
        return
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise RuntimeError("nvidia-smi is not installed: cannot reset the GPU")
    bus_id = nvml.nvmlDeviceGetPciInfo_v3(nvml.nvmlDeviceGetHandleByIndex(index)).busId
    bus_id = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    result = subprocess.run([smi, "-r", "-i", bus_id], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"nvidia-smi -r -i {bus_id} failed: {(result.stdout + result.stderr).strip()}")


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


def end_processes(nvml: Any, mig_uuid: str, pids: tuple[int, ...], grace_s: float = 10.0) -> None:
    """Ends the compute processes on a MIG device that a forced apply destroys: SIGTERM, then SIGKILL."""
    if hasattr(nvml, "sim_set_processes"):
        nvml.sim_set_processes(mig_uuid, [])  # simulated processes are not host processes: never signal them
        return
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
