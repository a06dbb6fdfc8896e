"""Builders for the pynvml structs the simulator returns."""

from __future__ import annotations

import pynvml
from pynvml import NVML_ERROR_FUNCTION_NOT_FOUND, NVMLError

from .events import Event
from .identity import pci_bus_id, pci_bus_id_legacy
from .models import ComputeInstanceProfile, GpuInstanceProfile
from .state import MIB, ComputeInstance, Gpu, GpuInstance, SimProcess


def _profile_struct(version: int, v1_type: type, v2_type: type):
    # pynvml's version argument picks the struct; anything else is a missing C symbol there too.
    if version == 1:
        return v1_type()
    if version == 2:
        return v2_type()
    raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)


def _profile_name(name: str) -> str:
    return f"MIG {name}"  # as nvidia-smi -lgip / -lcip print it


def gpu_instance_profile_info(profile: GpuInstanceProfile, memory_mb: int, version: int):
    """memory_mb: the profile's memorySizeMB as the running driver reports it."""
    info = _profile_struct(
        version, pynvml.c_nvmlGpuInstanceProfileInfo_t, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t
    )
    info.id = profile.id
    info.isP2pSupported = 0  # nvidia-smi shows P2P "No" for every profile (MIG user guide; H100 capture)
    info.sliceCount = profile.slice_count
    info.instanceCount = profile.reported_instance_count
    info.multiprocessorCount = profile.multiprocessor_count
    info.copyEngineCount = profile.copy_engines
    info.decoderCount = profile.decoders
    info.encoderCount = profile.encoders
    info.jpegCount = profile.jpegs
    info.ofaCount = profile.ofas
    info.memorySizeMB = memory_mb
    if version == 2:
        info.version = 0  # H100 capture (580): the driver hands the v2 struct back with version 0
        info.name = _profile_name(profile.name)
    return info


def compute_instance_profile_info(
    profile: ComputeInstanceProfile, gi_profile: GpuInstanceProfile, version: int
):
    info = _profile_struct(
        version,
        pynvml.c_nvmlComputeInstanceProfileInfo_t,
        pynvml.c_nvmlComputeInstanceProfileInfo_v2_t,
    )
    info.id = profile.id
    info.sliceCount = profile.slice_count
    info.instanceCount = profile.instance_count
    info.multiprocessorCount = profile.multiprocessor_count
    # A CI shares its GI's engines (nvml.h: nvmlComputeInstanceProfileInfo_t's shared* counts).
    info.sharedCopyEngineCount = gi_profile.copy_engines
    info.sharedDecoderCount = gi_profile.decoders
    info.sharedEncoderCount = gi_profile.encoders
    info.sharedJpegCount = gi_profile.jpegs
    info.sharedOfaCount = gi_profile.ofas
    if version == 2:
        info.name = _profile_name(profile.name)
    return info


def gpu_instance_info(device, gi: GpuInstance) -> pynvml.c_nvmlGpuInstanceInfo_t:
    return pynvml.c_nvmlGpuInstanceInfo_t(
        device=device,
        id=gi.id,
        profileId=gi.profile.id,
        placement=pynvml.c_nvmlGpuInstancePlacement_t(*gi.span),
    )


def compute_instance_info(device, gpu_instance, ci: ComputeInstance):
    return pynvml.c_nvmlComputeInstanceInfo_t(
        device=device,
        gpuInstance=gpu_instance,
        id=ci.id,
        profileId=ci.profile.id,
        placement=pynvml.c_nvmlComputeInstancePlacement_t(*ci.span),
    )


def mig_attributes(gi: GpuInstance, ci: ComputeInstance, memory_mb: int) -> pynvml.c_nvmlDeviceAttributes:
    return pynvml.c_nvmlDeviceAttributes(
        multiprocessorCount=ci.profile.multiprocessor_count,
        sharedCopyEngineCount=gi.profile.copy_engines,
        sharedDecoderCount=gi.profile.decoders,
        sharedEncoderCount=gi.profile.encoders,
        sharedJpegCount=gi.profile.jpegs,
        sharedOfaCount=gi.profile.ofas,
        gpuInstanceSliceCount=gi.profile.slice_count,
        computeInstanceSliceCount=ci.profile.slice_count,
        memorySizeMB=memory_mb,
    )


def pci_info(gpu: Gpu) -> pynvml.nvmlPciInfo_t:
    info = pynvml.nvmlPciInfo_t()
    info.busIdLegacy = pci_bus_id_legacy(gpu.bus)
    info.busId = pci_bus_id(gpu.bus)
    info.domain = 0
    info.bus = gpu.bus
    info.device = 0
    info.pciDeviceId = gpu.model.pci_device_id
    info.pciSubSystemId = gpu.model.pci_subsystem_id
    return info


def memory_info(total_mib: int, reserved_mib: float, process_bytes: int, version: int | None):
    """v1 counts the driver's reserved memory as used; v2 reports it apart and `used` without it
    (H100 capture on 580: v1 used 480 MiB, v2 reserved 480 MiB and used 0, free equal in both).
    A v2 version other than nvmlMemory_v2 is a struct the driver does not know."""
    total, reserved = total_mib * MIB, round(reserved_mib * MIB)
    used = min(total - reserved, process_bytes)  # what the compute processes hold
    free = total - reserved - used
    if not version:
        return pynvml.c_nvmlMemory_t(total=total, free=free, used=reserved + used)
    if version != pynvml.nvmlMemory_v2:
        raise NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved, free=free, used=used)


def process_info(process: SimProcess, gpu_instance_id: int, compute_instance_id: int):
    """The object pynvml's nvmlDeviceGetComputeRunningProcesses returns for one process (v3 struct:
    GI/CI ids 0xFFFFFFFF without MIG, nvml.h nvmlProcessInfo_v2_t)."""
    struct = pynvml.c_nvmlProcessInfo_t(
        pid=process.pid,
        usedGpuMemory=process.used_memory_bytes,
        gpuInstanceId=gpu_instance_id,
        computeInstanceId=compute_instance_id,
    )
    return pynvml.nvmlStructToFriendlyObject(struct)


def process_utilization_sample(process: SimProcess, timestamp_us: int):
    """One entry of nvmlDeviceGetProcessUtilization (pynvml returns the structs themselves)."""
    return pynvml.c_nvmlProcessUtilizationSample_t(
        pid=process.pid, timeStamp=timestamp_us, smUtil=process.sm_percent or 0, memUtil=0, encUtil=0, decUtil=0
    )


def event_data(device, event: Event) -> pynvml.c_nvmlEventData_t:
    return pynvml.c_nvmlEventData_t(
        device=device,
        eventType=event.event_type,
        eventData=event.data,
        gpuInstanceId=event.gpu_instance_id,
        computeInstanceId=event.compute_instance_id,
    )
