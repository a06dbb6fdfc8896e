"""NVML MIG calls: mode, GPU instances, compute instances and MIG device handles.

Conventions (§1, §7):
* GetGpuInstanceProfileInfo takes an NVML_GPU_INSTANCE_PROFILE_* constant; every other call takes
  the info.id it returns. A GPU-instance profile id the GPU does not have -> INVALID_ARGUMENT.
* Compute-instance profile ids are the NVML_COMPUTE_INSTANCE_PROFILE_* constants: >= COUNT ->
  INVALID_ARGUMENT, valid but not offered in this GI -> NOT_SUPPORTED.
* A GPU that cannot do MIG answers NOT_SUPPORTED to all of these. With MIG mode off, profile info
  and possible placements still answer; everything that needs instances is NOT_SUPPORTED.
"""

from __future__ import annotations

import ctypes

import pynvml
from pynvml import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_SUCCESS,
    NVMLError,
)

from . import structs
from ._core import SimCore, nvml_call
from .identity import mig_uuid
from .models import ComputeInstanceProfile, GpuInstanceProfile
from .placement import Span, choose_span, gpu_instance_id, lowest_free_id, remaining_capacity
from .refs import read_span, write_array
from .state import ComputeInstance, Gpu, GpuInstance, MigDevice


class MigCalls(SimCore):
    # --- MIG mode -------------------------------------------------------------------------------

    @nvml_call
    def nvmlDeviceGetMigMode(self, device) -> list[int]:
        gpu = self._mig_capable(device)
        return [gpu.mig_current, gpu.mig_pending]

    @nvml_call
    def nvmlDeviceSetMigMode(self, device, mode: int) -> int:
        self._fault_point()
        """Request a MIG mode; returns the activation status, as pynvml does.

        Hopper and later switch at once (activation status SUCCESS). On Ampere (A100, A30) the
        new mode stays pending and the status is NVML_ERROR_IN_USE until `sim_reset_gpu`: on a
        real DGX, nvidia-persistenced and DCGM hold the GPU open, so the driver cannot reset it
        by itself and the operator runs `nvidia-smi -r` (§7.2). Raises IN_USE while GPU
        instances exist (they must be destroyed first) and, on Hopper, while processes run.
        """
        gpu = self._mig_capable(device)
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if mode == gpu.mig_current == gpu.mig_pending:
            return NVML_SUCCESS
        if gpu.gpu_instances:
            raise NVMLError(NVML_ERROR_IN_USE)
        if gpu.model.mig.needs_reset:
            gpu.mig_pending = mode  # the next reset applies it
        else:
            if gpu.processes:
                raise NVMLError(NVML_ERROR_IN_USE)
            gpu.mig_current = gpu.mig_pending = mode
        self._commit()
        return NVML_SUCCESS if gpu.mig_current == mode else NVML_ERROR_IN_USE

    # --- GPU instance profiles ------------------------------------------------------------------

    @nvml_call
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device, profile: int, version: int = 2):
        mig = self._mig_capable(device).model.mig
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        found = mig.by_constant(profile)
        if found is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return structs.gpu_instance_profile_info(found, version)

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    @nvml_call
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device, profileId: int):
        gpu = self._mig_capable(device)
        return structs.gpu_instance_profile_info(self._gpu_instance_profile(gpu, profileId), 2)

    nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById

    @nvml_call
    def nvmlDeviceGetGpuInstancePossiblePlacements(self, device, profileId, placementsRef, countRef):
        profile = self._gpu_instance_profile(self._mig_capable(device), profileId)
        placements = [pynvml.c_nvmlGpuInstancePlacement_t(*span) for span in profile.spans]
        write_array(placements, placementsRef, countRef)
        return NVML_SUCCESS

    @nvml_call
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device, profileId: int) -> int:
        gpu = self._mig_enabled(device)
        profile = self._gpu_instance_profile(gpu, profileId)
        return remaining_capacity(profile, list(gpu.gpu_instances.values()))

    # --- GPU instances --------------------------------------------------------------------------

    @nvml_call
    def nvmlDeviceCreateGpuInstance(self, device, profileId: int):
        return self._create_gpu_instance(device, profileId, None)

    @nvml_call
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device, profileId: int, placement):
        return self._create_gpu_instance(device, profileId, read_span(placement))

    @nvml_call
    def nvmlDeviceGetGpuInstances(self, device, profileId: int, gpuInstancesRef, countRef):
        gpu = self._mig_enabled(device)
        profile = self._gpu_instance_profile(gpu, profileId)
        handles = [
            self._gpu_instance_handle(gpu, gi)
            for _, gi in sorted(gpu.gpu_instances.items())
            if gi.profile is profile
        ]
        write_array(handles, gpuInstancesRef, countRef)
        return NVML_SUCCESS

    @nvml_call
    def nvmlDeviceGetGpuInstanceById(self, device, gpuInstanceId: int):
        gpu = self._mig_enabled(device)
        gi = gpu.gpu_instances.get(gpuInstanceId)
        if gi is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return self._gpu_instance_handle(gpu, gi)

    @nvml_call
    def nvmlGpuInstanceGetInfo(self, gpuInstance) -> pynvml.c_nvmlGpuInstanceInfo_t:
        gpu, gi = self._gpu_instance(gpuInstance)
        return structs.gpu_instance_info(self._gpu_handle(gpu), gi)

    @nvml_call
    def nvmlGpuInstanceDestroy(self, gpuInstance) -> int:
        self._fault_point()
        gpu, gi = self._gpu_instance(gpuInstance)
        if gi.compute_instances:  # CIs go first; processes live in CIs
            raise NVMLError(NVML_ERROR_IN_USE)
        del gpu.gpu_instances[gi.id]
        self._commit()
        return NVML_SUCCESS

    # --- compute instances ----------------------------------------------------------------------

    @nvml_call
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device, profile: int, engProfile: int, version: int = 2
    ):
        _, gi = self._gpu_instance(device)  # pynvml names the GI handle "device" here
        found = self._compute_instance_profile(gi, profile)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return structs.compute_instance_profile_info(found, gi.profile, version)

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    @nvml_call
    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpuInstance, profileId: int) -> int:
        _, gi = self._gpu_instance(gpuInstance)
        profile = self._compute_instance_profile(gi, profileId)
        return remaining_capacity(profile, list(gi.compute_instances.values()))

    @nvml_call
    def nvmlGpuInstanceGetComputeInstancePossiblePlacements(
        self, gpuInstance, profileId: int, placementsRef, countRef
    ):
        _, gi = self._gpu_instance(gpuInstance)
        profile = self._compute_instance_profile(gi, profileId)
        placements = [pynvml.c_nvmlComputeInstancePlacement_t(*span) for span in profile.spans]
        write_array(placements, placementsRef, countRef)
        return NVML_SUCCESS

    @nvml_call
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance, profileId: int):
        return self._create_compute_instance(gpuInstance, profileId, None)

    @nvml_call
    def nvmlGpuInstanceCreateComputeInstanceWithPlacement(self, gpuInstance, profileId: int, placement):
        return self._create_compute_instance(gpuInstance, profileId, read_span(placement))

    @nvml_call
    def nvmlGpuInstanceGetComputeInstances(self, gpuInstance, profileId: int, computeInstancesRef, countRef):
        gpu, gi = self._gpu_instance(gpuInstance)
        profile = self._compute_instance_profile(gi, profileId)
        handles = [
            self._compute_instance_handle(gpu, gi, ci)
            for _, ci in sorted(gi.compute_instances.items())
            if ci.profile is profile
        ]
        write_array(handles, computeInstancesRef, countRef)
        return NVML_SUCCESS

    @nvml_call
    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance, computeInstanceId: int):
        gpu, gi = self._gpu_instance(gpuInstance)
        ci = gi.compute_instances.get(computeInstanceId)
        if ci is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return self._compute_instance_handle(gpu, gi, ci)

    @nvml_call
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance) -> pynvml.c_nvmlComputeInstanceInfo_t:
        """info.device is the parent GPU, as the NVML header documents it."""
        gpu, (gi, ci) = self._compute_instance(computeInstance)
        return structs.compute_instance_info(self._gpu_handle(gpu), self._gpu_instance_handle(gpu, gi), ci)

    nvmlComputeInstanceGetInfo = nvmlComputeInstanceGetInfo_v2

    @nvml_call
    def nvmlComputeInstanceDestroy(self, computeInstance) -> int:
        self._fault_point()
        _, (gi, ci) = self._compute_instance(computeInstance)
        if ci.processes:
            raise NVMLError(NVML_ERROR_IN_USE)
        del gi.compute_instances[ci.id]
        self._commit()
        return NVML_SUCCESS

    # --- MIG device handles ---------------------------------------------------------------------

    @nvml_call
    def nvmlDeviceGetMaxMigDeviceCount(self, device) -> int:
        gpu = self._gpu(device, on_mig_handle=NVML_ERROR_INVALID_ARGUMENT)
        return gpu.model.mig.max_devices if gpu.mig_enabled else 0

    @nvml_call
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index: int):
        gpu = self._mig_capable(device)
        mig_devices = gpu.mig_devices()
        if not 0 <= index < len(mig_devices):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return self._mig_handle(gpu, *mig_devices[index])

    @nvml_call
    def nvmlDeviceIsMigDeviceHandle(self, device) -> ctypes.c_uint:
        _, mig_device = self._device(device)
        return ctypes.c_uint(mig_device is not None)  # pynvml returns the c_uint itself

    @nvml_call
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice):
        gpu, mig_device = self._device(migDevice)
        if mig_device is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu_handle(gpu)

    @nvml_call
    def nvmlDeviceGetGpuInstanceId(self, device) -> int:
        return self._mig_device(device).gpu_instance.id

    @nvml_call
    def nvmlDeviceGetComputeInstanceId(self, device) -> int:
        return self._mig_device(device).compute_instance.id

    @nvml_call
    def nvmlDeviceGetAttributes_v2(self, device) -> pynvml.c_nvmlDeviceAttributes:
        """MIG device handles only, as the NVML header notes."""
        return structs.mig_attributes(*self._mig_device(device))

    nvmlDeviceGetAttributes = nvmlDeviceGetAttributes_v2

    # --- helpers --------------------------------------------------------------------------------

    def _mig_capable(self, device) -> Gpu:
        gpu = self._gpu(device, on_mig_handle=NVML_ERROR_INVALID_ARGUMENT)
        if gpu.model.mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_enabled(self, device) -> Gpu:
        gpu = self._mig_capable(device)
        if not gpu.mig_enabled:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_device(self, device) -> MigDevice:
        _, mig_device = self._device(device)
        if mig_device is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return mig_device

    @staticmethod
    def _gpu_instance_profile(gpu: Gpu, profile_id: int) -> GpuInstanceProfile:
        profile = gpu.model.mig.by_id(profile_id)
        if profile is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return profile

    @staticmethod
    def _compute_instance_profile(gi: GpuInstance, profile_id: int) -> ComputeInstanceProfile:
        if not 0 <= profile_id < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        profile = gi.profile.compute_profile(profile_id)
        if profile is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return profile

    def _create_gpu_instance(self, device, profile_id: int, requested: Span | None):
        self._fault_point()
        gpu = self._mig_enabled(device)
        mig = gpu.model.mig
        profile = self._gpu_instance_profile(gpu, profile_id)
        span = choose_span(profile, mig.gpu_instance_profiles, list(gpu.gpu_instances.values()), requested)
        gi = GpuInstance(
            id=gpu_instance_id(span, mig.memory_slices),
            profile=profile,
            span=span,
            serial=self._next_serial(),
        )
        gpu.gpu_instances[gi.id] = gi
        self._commit()
        return self._gpu_instance_handle(gpu, gi)

    def _create_compute_instance(self, gpu_instance, profile_id: int, requested: Span | None):
        self._fault_point()
        gpu, gi = self._gpu_instance(gpu_instance)
        profile = self._compute_instance_profile(gi, profile_id)
        existing = list(gi.compute_instances.values())
        span = choose_span(profile, gi.profile.compute_profiles, existing, requested)
        ci_id = lowest_free_id(gi.compute_instances)
        ci = ComputeInstance(
            id=ci_id,
            profile=profile,
            span=span,
            uuid=mig_uuid(gpu.uuid, gi.id, ci_id),
            serial=self._next_serial(),
        )
        gi.compute_instances[ci_id] = ci
        self._commit()
        return self._compute_instance_handle(gpu, gi, ci)
