"""Reads the whole node through NVML into an immutable Inventory. Runs on the NVML thread."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from gpud.inventory import Gpu, Inventory, MigDevice, MigInfo, Placement, unknown_gpu

MIB = 1 << 20
_ARCHITECTURES = ("kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell")
_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
# GPU-instance profile constants whose instances carry a media-engine attribute in their name.
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


def text(value: Any) -> str:
    """NVML strings arrive as str or bytes depending on the call and the binding's version."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NodeReader:
    """Reads snapshots. Keeps each GPU's GPU-instance profile table, which NVML fixes per MIG mode."""

    def __init__(self) -> None:
        self._profile_tables: dict[str, dict[int, tuple[str, Any]]] = {}

    def read(self, nvml: Any, known: dict[int, Gpu]) -> Inventory:
        """known: the last good description of each GPU, used for a GPU NVML cannot describe now."""
        gpus = tuple(self._read_gpu(nvml, index, known) for index in range(nvml.nvmlDeviceGetCount()))
        return Inventory(
            driver_version=text(nvml.nvmlSystemGetDriverVersion()),
            cuda_version=_cuda_version(nvml.nvmlSystemGetCudaDriverVersion_v2()),
            nvml_version=text(nvml.nvmlSystemGetNVMLVersion()),
            gpus=gpus,
        )

    def _read_gpu(self, nvml: Any, index: int, known: dict[int, Gpu]) -> Gpu:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            return self._describe_gpu(nvml, index, handle)
        except nvml.NVMLError as exc:
            last = known.get(index) or unknown_gpu(index)
            return replace(last, lost=isinstance(exc, nvml.NVMLError_GpuIsLost), error=f"{exc} (NVML error {exc.value})")

    def _describe_gpu(self, nvml: Any, index: int, handle: Any) -> Gpu:
        pci = nvml.nvmlDeviceGetPciInfo_v3(handle)
        memory_mib = nvml.nvmlDeviceGetMemoryInfo(handle).total // MIB
        uuid = text(nvml.nvmlDeviceGetUUID(handle))
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        return Gpu(
            index=index,
            uuid=uuid,
            name=text(nvml.nvmlDeviceGetName(handle)),
            pci_bus_id=text(pci.busId),
            pci_device_id=f"0x{pci.pciDeviceId:08X}",
            memory_total_mib=memory_mib,
            compute_mode=_COMPUTE_MODES.get(nvml.nvmlDeviceGetComputeMode(handle), "unknown"),
            architecture=_architecture(nvml, nvml.nvmlDeviceGetArchitecture(handle)),
            cuda_compute_capability=f"{major}.{minor}",
            serial=_optional(nvml, lambda: text(nvml.nvmlDeviceGetSerial(handle))),
            mig=self._read_mig(nvml, handle, uuid, memory_mib),
        )

    def _read_mig(self, nvml: Any, handle: Any, uuid: str, device_mib: int) -> MigInfo:
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError_NotSupported:
            return MigInfo(capable=False, mode=None, pending_mode=None)
        mode = lambda value: "enabled" if value == nvml.NVML_DEVICE_MIG_ENABLE else "disabled"  # noqa: E731
        devices: tuple[MigDevice, ...] = ()
        if current == nvml.NVML_DEVICE_MIG_ENABLE:
            profiles = self._profile_table(nvml, handle, uuid)
            devices = tuple(self._read_mig_devices(nvml, handle, profiles, device_mib))
        return MigInfo(capable=True, mode=mode(current), pending_mode=mode(pending), devices=devices)

    def _profile_table(self, nvml: Any, handle: Any, uuid: str) -> dict[int, tuple[str, Any]]:
        """profile id -> (name suffix, profile info), from every profile constant the GPU supports."""
        table = self._profile_tables.get(uuid)
        if table is None:
            suffix_by_constant = {getattr(nvml, name): suffix for name, suffix in _PROFILE_SUFFIXES.items()
                                  if hasattr(nvml, name)}
            table = {}
            for constant in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
                try:
                    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant)
                except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
                    continue
                table[info.id] = (suffix_by_constant.get(constant, ""), info)
            self._profile_tables[uuid] = table
        return table

    def _read_mig_devices(self, nvml: Any, handle: Any, profiles: dict, device_mib: int):
        for mig_index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
            except (nvml.NVMLError_NotFound, nvml.NVMLError_InvalidArgument):
                continue  # NVML allows holes in the MIG device index range
            gi_id = nvml.nvmlDeviceGetGpuInstanceId(mig)
            ci_id = nvml.nvmlDeviceGetComputeInstanceId(mig)
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            gi_info = nvml.nvmlGpuInstanceGetInfo(gi)
            ci_info = nvml.nvmlComputeInstanceGetInfo(nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id))
            attrs = nvml.nvmlDeviceGetAttributes(mig)
            suffix, gi_profile = profiles[gi_info.profileId]
            yield MigDevice(
                uuid=text(nvml.nvmlDeviceGetUUID(mig)),
                index=mig_index,
                profile=mig_profile_name(attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount,
                                         gi_profile.memorySizeMB, device_mib, suffix),
                gi_id=gi_id,
                ci_id=ci_id,
                gi_profile_id=gi_info.profileId,
                ci_profile_id=ci_info.profileId,
                placement=Placement(gi_info.placement.start, gi_info.placement.size),
                memory_total_mib=attrs.memorySizeMB,
                sm_count=attrs.multiprocessorCount,
            )


def _optional(nvml: Any, read):
    try:
        return read()
    except nvml.NVMLError_NotSupported:
        return None


def _cuda_version(value: int) -> str:
    return f"{value // 1000}.{value % 1000 // 10}"


def _architecture(nvml: Any, value: int) -> str:
    for name in _ARCHITECTURES:
        if getattr(nvml, f"NVML_DEVICE_ARCH_{name.upper()}", None) == value:
            return name
    return "unknown"
