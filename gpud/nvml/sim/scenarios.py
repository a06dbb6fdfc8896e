"""Stages a simulated node through the NVML calls themselves, as an admin with nvidia-smi would.

Tests and benchmarks use it to put MIG devices on the simulated GPUs before gpud looks at them.
"""

from __future__ import annotations

import os
from typing import Any

from .simulator import SimulatedNvml


def started(preset: str, state_path: str | os.PathLike, driver: str | None = None) -> SimulatedNvml:
    """A simulator on `state_path`, already initialized."""
    nvml = SimulatedNvml(preset, state_path, driver)
    nvml.nvmlInit()
    return nvml


def enable_mig(nvml: Any, index: int) -> Any:
    """Turns MIG mode on for one GPU; when the change stays pending (Ampere, GPU in use) resets it
    as an admin would: NVML released first, since this process's own session blocks a reset."""
    device = nvml.nvmlDeviceGetHandleByIndex(index)
    if nvml.nvmlDeviceSetMigMode(device, nvml.NVML_DEVICE_MIG_ENABLE) != nvml.NVML_SUCCESS:
        reset_released(nvml, [index])
    return device


def reset_released(nvml: Any, indices: list[int]) -> None:
    """`nvidia-smi -r -i <indices>` from this process: shut NVML down, reset, initialise again."""
    nvml.nvmlShutdown()
    try:
        nvml.sim_reset_gpu(indices)
    finally:
        nvml.nvmlInit()


def fill_with_gpu_instances(nvml: Any, profile_constant: int) -> int:
    """Enables MIG on every MIG-capable GPU and fills it with as many instances of the profile as fit,
    each with one compute instance spanning it. Returns the number of MIG devices created."""
    created = 0
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError_NotSupported:
            continue
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            enable_mig(nvml, index)
        profile = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_constant)
        while nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, profile.id) > 0:
            gpu_instance = nvml.nvmlDeviceCreateGpuInstance(handle, profile.id)
            ci_profile = _whole_compute_profile(nvml, gpu_instance)
            nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, ci_profile.id)
            created += 1
    return created


def _whole_compute_profile(nvml: Any, gpu_instance: Any) -> Any:
    """The compute-instance profile that takes every compute slice of the GPU instance."""
    best = None
    for constant in range(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gpu_instance, constant, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            continue
        if best is None or info.sliceCount > best.sliceCount:
            best = info
    return best
