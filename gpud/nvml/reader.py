"""Reads the whole node through NVML into an immutable Inventory. Runs on the NVML thread."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpud.inventory import Gpu, Inventory, MigDevice, MigInfo, unknown_gpu
from gpud.mig.model import MigCapabilities
from gpud.nvml import mig

MIB = 1 << 20
_ARCHITECTURES = ("kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell")
_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
def text(value: Any) -> str:
    """NVML strings arrive as str or bytes depending on the call and the binding's version."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NodeReader:
    """Reads snapshots. Keeps each GPU's MIG profile table, which never changes for a GPU."""

    def __init__(self) -> None:
        self._capabilities: dict[str, MigCapabilities] = {}

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
            return replace(last, lost=isinstance(exc, nvml.NVMLError_GpuIsLost),
                           error=f"{exc} (NVML error {exc.value})")

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
        capabilities = self._capabilities.get(uuid)
        if capabilities is None:
            capabilities = self._capabilities[uuid] = mig.read_capabilities(nvml, handle, device_mib)
        mode = lambda value: "enabled" if value == nvml.NVML_DEVICE_MIG_ENABLE else "disabled"  # noqa: E731
        devices: tuple[MigDevice, ...] = ()
        instances: tuple = ()
        if current == nvml.NVML_DEVICE_MIG_ENABLE:
            handles = _read_mig_handles(nvml, handle)
            instances = mig.read_instances(nvml, handle, capabilities,
                                           {ids: (h["uuid"], h["pids"]) for ids, h in handles.items()})
            devices = _mig_devices(instances, handles, capabilities)
        return MigInfo(capable=True, mode=mode(current), pending_mode=mode(pending), devices=devices,
                       capabilities=capabilities, instances=instances)


def _read_mig_handles(nvml: Any, handle: Any) -> dict[tuple[int, int], dict]:
    """What only a MIG device handle tells, by (GI id, CI id): its index, UUID, size and processes."""
    found = {}
    for mig_index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
        except (nvml.NVMLError_NotFound, nvml.NVMLError_InvalidArgument):
            continue  # NVML allows holes in the MIG device index range
        attrs = nvml.nvmlDeviceGetAttributes(device)
        ids = (nvml.nvmlDeviceGetGpuInstanceId(device), nvml.nvmlDeviceGetComputeInstanceId(device))
        found[ids] = {"index": mig_index, "uuid": text(nvml.nvmlDeviceGetUUID(device)), "attrs": attrs,
                      "pids": tuple(sorted(p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(device)))}
    return found


def _mig_devices(instances: tuple, handles: dict[tuple[int, int], dict], capabilities: MigCapabilities):
    """The MIG devices for the API: the instance tree (already read) joined with their handles."""
    devices = []
    for gi in instances:
        gi_name = capabilities.gi_profile_by_id(gi.profile_id).name
        for ci in gi.compute_instances:
            found = handles.get((gi.gi_id, ci.ci_id))
            if found is None:
                continue  # being created or destroyed right now: the next read shows it
            attrs = found["attrs"]
            ci_slices, gi_slices = attrs.computeInstanceSliceCount, attrs.gpuInstanceSliceCount
            devices.append(MigDevice(
                uuid=found["uuid"], index=found["index"],
                profile=gi_name if ci_slices >= gi_slices else f"{ci_slices}c.{gi_name}",
                gi_id=gi.gi_id, ci_id=ci.ci_id, gi_profile_id=gi.profile_id, ci_profile_id=ci.profile_id,
                placement=gi.placement, memory_total_mib=attrs.memorySizeMB, sm_count=attrs.multiprocessorCount,
                pids=found["pids"]))
    return tuple(sorted(devices, key=lambda d: d.index))


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
