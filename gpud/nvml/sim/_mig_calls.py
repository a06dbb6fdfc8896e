"""NVML MIG calls: mode, GPU instances, compute instances and MIG device handles.

Conventions (nvml.h, the MIG user guide, and what is named beside each):
* GetGpuInstanceProfileInfo takes an NVML_GPU_INSTANCE_PROFILE_* constant; every other call takes
  the info.id it returns. A GPU-instance profile id the GPU does not have -> INVALID_ARGUMENT.
  Constants the driver branch does not know -> INVALID_ARGUMENT; known but not on this GPU ->
  NOT_SUPPORTED (H100 capture on 580: 5, 6, 8, 10..16 NOT_SUPPORTED, 0x11 INVALID_ARGUMENT).
* Compute-instance profile ids are the NVML_COMPUTE_INSTANCE_PROFILE_* constants: unknown to the
  branch -> INVALID_ARGUMENT, valid but not offered in this GI -> NOT_SUPPORTED.
* A GPU that cannot do MIG answers NOT_SUPPORTED to all of these.
* With MIG mode off, by driver branch (models.yaml drivers): R580 answers profile info, possible
  placements, remaining capacity and an empty nvmlDeviceGetGpuInstances (H100 capture); R535 answers
  NOT_SUPPORTED to all of them (mig-parted commit 219e780d), R550 too (no evidence: the strictest).
  Creating instances or looking one up by id needs MIG mode on (NOT_SUPPORTED, nvml.h).
* Privileges (os.geteuid() read per call): changing the MIG mode, creating and destroying GPU and
  compute instances need root (nvidia-smi manual: "-mig ... Requires root"). Listing GPU and
  compute instances with MIG on needs the MIG config/monitor capability: NO_PERMISSION otherwise
  (`nvidia-smi mig -lci` "Failed to display compute instances: Insufficient Permissions",
  Project-HAMi/HAMi#1044; non-root MIG UUID mapping, NVIDIA/go-nvml#57). With MIG off every read
  answers as uid 65534 too (H100 capture, probe-nobody.json).
"""

from __future__ import annotations

import ctypes

import pynvml
from pynvml import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_SUCCESS,
    NVMLError,
)

from . import structs
from ._core import SimCore, nvml_call, require_root
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
        """Request a MIG mode; returns the activation status (an nvmlReturn_t), as pynvml does.

        Hopper and later switch at once: status NVML_SUCCESS. Ampere (A100, A30) needs a GPU reset,
        which the driver does by itself when nothing else uses the GPU (MIG user guide transcript
        "Enabled MIG Mode for GPU ..."; mig-parted logs "Mode change pending: false" right after the
        call, NVIDIA/gpu-operator#351): status NVML_SUCCESS. When another process holds or computes
        on the GPU the new mode stays pending until a reset and the status is NVML_ERROR_IN_USE
        (nvml.h's example; the user guide's "pending enable state ... In use by another client").
        Raises IN_USE while GPU instances exist (destroy them first) and, on Hopper, while
        processes run; NO_PERMISSION for non-root.
        """
        self._fault_point()
        gpu = self._mig_capable(device)
        require_root()
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if mode == gpu.mig_current == gpu.mig_pending:
            return NVML_SUCCESS
        if gpu.gpu_instances:
            raise NVMLError(NVML_ERROR_IN_USE)
        if not gpu.model.mig.needs_reset:
            if gpu.processes:
                raise NVMLError(NVML_ERROR_IN_USE)
            gpu.mig_current = gpu.mig_pending = mode
        elif mode == gpu.mig_current:
            gpu.mig_pending = mode  # taking a pending change back needs no reset
        else:
            gpu.mig_pending = mode
            if self._node.passthrough:
                # nvml.h: where the platform does not expose a reset (pass-through virtualization) a
                # VM reboot is required, "activationStatus would return NVML_ERROR_RESET_REQUIRED".
                self._commit()
                return NVML_ERROR_RESET_REQUIRED
            if not gpu.in_use():
                gpu.reset()  # the driver resets the idle GPU itself
        self._commit()
        return NVML_SUCCESS if gpu.mig_current == mode else NVML_ERROR_IN_USE

    # --- GPU instance profiles ------------------------------------------------------------------

    @nvml_call
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device, profile: int, version: int = 2):
        gpu = self._mig_capable(device)
        if not 0 <= profile < self._driver.branch.gpu_instance_profile_constants:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # the library checks its argument first
        self._require_profiles(gpu)
        found = gpu.model.mig.by_constant(profile)
        if found is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self._profile_info(gpu, found, version)

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    @nvml_call
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device, profileId: int):
        gpu = self._profiles_answer(device)
        return self._profile_info(gpu, self._gpu_instance_profile(gpu, profileId), 2)

    nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById

    @nvml_call
    def nvmlDeviceGetGpuInstancePossiblePlacements(self, device, profileId, placementsRef, countRef):
        """Binds the _v2 symbol; a NULL array asks for the count (nvml.h)."""
        profile = self._gpu_instance_profile(self._profiles_answer(device), profileId)
        placements = [pynvml.c_nvmlGpuInstancePlacement_t(*span) for span in profile.spans]
        write_array(placements, placementsRef, countRef)
        return NVML_SUCCESS

    @nvml_call
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device, profileId: int) -> int:
        gpu = self._profiles_answer(device)
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
        """Unlike the placement calls, a NULL array is INVALID_ARGUMENT: size it from the profile's
        instanceCount (cuda-python NVML docs; NVIDIA/cuda-python#2862 on real hardware)."""
        gpu = self._mig_capable(device)
        if not gpu.mig_enabled and not self._driver.branch.instances_with_mig_off:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        self._require_instance_listing(gpu)
        profile = self._gpu_instance_profile(gpu, profileId)
        handles = [
            self._gpu_instance_handle(gpu, gi)
            for _, gi in sorted(gpu.gpu_instances.items())
            if gi.profile is profile
        ]
        write_array(handles, gpuInstancesRef, countRef, null_array_allowed=False)
        return NVML_SUCCESS

    @nvml_call
    def nvmlDeviceGetGpuInstanceById(self, device, gpuInstanceId: int):
        gpu = self._mig_enabled(device)
        self._require_instance_listing(gpu)
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
        require_root()
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
        """Every constant the branch knows: offered in this GI -> its info, else NOT_SUPPORTED (nvml.h)."""
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
        """In compute slices inside the GI; a NULL array asks for the count (nvml.h). The placement
        table itself is INFERRED (NVIDIA/go-nvml pkg/nvml/mock/gpus/: no real -lcipp output was found)."""
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
        """A NULL array is INVALID_ARGUMENT, as for nvmlDeviceGetGpuInstances."""
        gpu, gi = self._gpu_instance(gpuInstance)
        self._require_instance_listing(gpu)
        profile = self._compute_instance_profile(gi, profileId)
        handles = [
            self._compute_instance_handle(gpu, gi, ci)
            for _, ci in sorted(gi.compute_instances.items())
            if ci.profile is profile
        ]
        write_array(handles, computeInstancesRef, countRef, null_array_allowed=False)
        return NVML_SUCCESS

    @nvml_call
    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance, computeInstanceId: int):
        gpu, gi = self._gpu_instance(gpuInstance)
        self._require_instance_listing(gpu)
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
        require_root()
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
        gpu, mig_device = self._device(device)
        if mig_device is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return structs.mig_attributes(*mig_device, self._gi_memory_mb(gpu, mig_device.gpu_instance))

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

    def _profiles_answer(self, device) -> Gpu:
        """A MIG-capable GPU whose driver answers GI profile queries now."""
        gpu = self._mig_capable(device)
        self._require_profiles(gpu)
        return gpu

    def _require_profiles(self, gpu: Gpu) -> None:
        """GI profile queries answer with MIG on, or with MIG off on a branch that answers them then."""
        if not gpu.mig_enabled and not self._driver.branch.profiles_with_mig_off:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    @staticmethod
    def _require_instance_listing(gpu: Gpu) -> None:
        """Listing the instances of a MIG-enabled GPU needs the MIG capabilities (module docstring)."""
        if gpu.mig_enabled:
            require_root()

    def _profile_info(self, gpu: Gpu, profile: GpuInstanceProfile, version: int):
        memory_mb = gpu.model.mig.memory_mb(profile, self._driver.version_tuple)
        return structs.gpu_instance_profile_info(profile, memory_mb, version)

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

    def _compute_instance_profile(self, gi: GpuInstance, profile_id: int) -> ComputeInstanceProfile:
        if not 0 <= profile_id < self._driver.branch.compute_instance_profile_constants:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        profile = gi.profile.compute_profile(profile_id)
        if profile is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return profile

    def _create_gpu_instance(self, device, profile_id: int, requested: Span | None):
        self._fault_point()
        gpu = self._mig_capable(device)
        require_root()
        if not gpu.mig_enabled:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
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
        require_root()
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
