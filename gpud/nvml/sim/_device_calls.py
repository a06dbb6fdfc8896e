"""NVML system and device queries (identity, health)."""

from __future__ import annotations

import ctypes
import re

import pynvml
from pynvml import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVMLError,
)

from . import structs
from ._core import SimCore, nvml_call, require_root
from .identity import pci_bus_id, pci_bus_id_legacy, serial_number
from .presets import preset_numa_nodes
from .state import Gpu
from .sysfs import UNKNOWN_NODE, local_cpus
from .topology import Link

_PCI_BUS_ID = re.compile(r"^(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])$")
_SETTABLE_COMPUTE_MODES = (
    pynvml.NVML_COMPUTEMODE_DEFAULT,
    pynvml.NVML_COMPUTEMODE_PROHIBITED,
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _clock_reasons(gpu: Gpu) -> int:
    """GPU idle (0x1) on an idle GPU, as the H100 capture shows; none while processes run."""
    busy = bool(gpu.running_processes())
    return pynvml.nvmlClocksEventReasonNone if busy else pynvml.nvmlClocksEventReasonGpuIdle


def _require(supported: bool) -> None:
    if not supported:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)


class DeviceCalls(SimCore):
    # --- system ---------------------------------------------------------------------------------

    @nvml_call
    def nvmlSystemGetDriverVersion(self) -> str:
        return self._driver.version

    @nvml_call
    def nvmlSystemGetNVMLVersion(self) -> str:
        return self._driver.nvml_version

    @nvml_call
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._driver.branch.cuda_version

    nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion

    # --- finding devices ------------------------------------------------------------------------

    @nvml_call
    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    @nvml_call
    def nvmlDeviceGetHandleByIndex(self, index: int):
        return self._gpu_handle(self._gpu_at(index))

    @nvml_call
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes):
        """A lost GPU's own UUIDs fail like its index does (no source says otherwise)."""
        wanted = _text(uuid)
        for gpu in self._gpus:
            if gpu.uuid == wanted:
                return self._gpu_handle(self._found(gpu))
            for gi, ci in gpu.mig_devices():
                if ci.uuid == wanted:
                    return self._mig_handle(self._found(gpu), gi, ci)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    @nvml_call
    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes):
        match = _PCI_BUS_ID.match(_text(pciBusId).strip().lower())
        if match is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        domain, bus, device, function = (int(part or "0", 16) for part in match.groups())
        for gpu in self._gpus:
            if (domain, bus, device, function) == (0, gpu.bus, 0, 0):
                return self._gpu_handle(self._found(gpu))
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    # --- identity -------------------------------------------------------------------------------

    @nvml_call
    def nvmlDeviceGetIndex(self, handle) -> int:
        return self._gpu(handle).index

    @nvml_call
    def nvmlDeviceGetName(self, handle) -> str:
        gpu, mig_device = self._device(handle)
        if mig_device is None:
            return gpu.model.name
        return f"{gpu.model.name} MIG {mig_device.compute_instance.profile.name}"

    @nvml_call
    def nvmlDeviceGetUUID(self, handle) -> str:
        gpu, mig_device = self._device(handle)
        return gpu.uuid if mig_device is None else mig_device.compute_instance.uuid

    @nvml_call
    def nvmlDeviceGetSerial(self, handle) -> str:
        gpu = self._gpu(handle)
        _require(gpu.model.has_serial)
        return serial_number(gpu.uuid)

    @nvml_call
    def nvmlDeviceGetMinorNumber(self, handle) -> int:
        return self._gpu(handle).index

    @nvml_call
    def nvmlDeviceGetPciInfo_v3(self, handle) -> pynvml.nvmlPciInfo_t:
        return structs.pci_info(self._gpu(handle))

    nvmlDeviceGetPciInfo = nvmlDeviceGetPciInfo_v3

    @nvml_call
    def nvmlDeviceGetArchitecture(self, device) -> int:
        return self._device(device)[0].model.architecture

    @nvml_call
    def nvmlDeviceGetBrand(self, device) -> int:
        """The model's NVML_BRAND_* (models.yaml `brand`, with its sources). A MIG device handle answers its
        GPU's, as nvmlDeviceGetArchitecture does here: no source says what the driver answers for one."""
        return self._device(device)[0].model.brand

    @nvml_call
    def nvmlDeviceGetCudaComputeCapability(self, handle) -> tuple[int, int]:
        return self._device(handle)[0].model.compute_capability

    @nvml_call
    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        """version=pynvml.nvmlMemory_v2 calls nvmlDeviceGetMemoryInfo_v2 (`reserved` apart)."""
        gpu, mig_device = self._device(handle)
        if mig_device is None:
            held = sum(process.used_memory_bytes for process, _, _ in gpu.running_process_table())
            return structs.memory_info(gpu.model.memory_mib, gpu.model.reserved_mib, held, version)
        gi = mig_device.gpu_instance  # a MIG device sees its GI's memory, shared by the GI's CIs
        # No source for a MIG device's reserved memory: none, its GI memory is already net.
        return structs.memory_info(self._gi_memory_mb(gpu, gi), 0, gi.process_memory_bytes(), version)

    @nvml_call
    def nvmlDeviceGetCpuAffinity(self, handle, cpuSetSize: int):
        """pynvml's shape: an array of cpuSetSize 64-bit words, bit j of word i set for ideal CPU i * 64 + j.
        The driver answers the CPUs local to the GPU's PCI device (nvml.h: "equivalent to calling
        nvmlDeviceGetCpuAffinityWithinScope with NVML_AFFINITY_SCOPE_NODE"), those of its NUMA node;
        INVALID_ARGUMENT for cpuSetSize 0 (nvml.h). CPUs past cpuSetSize words are left out: nvml.h calls it
        "the size of the cpuSet array that is safe to access" and lists no INSUFFICIENT_SIZE (NVIDIA's mock
        answers that). An H100 on 580.159.04 (a VM, the GPU's numa_node -1, probed with ctypes) answers 0-15:
        its local_cpulist, all online CPUs; and INVALID_ARGUMENT for cpuSetSize 0."""
        gpu = self._gpu(handle)
        if not isinstance(cpuSetSize, int) or cpuSetSize <= 0:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        numa_nodes = preset_numa_nodes(self._preset)
        mask = (ctypes.c_ulonglong * cpuSetSize)()
        for cpu in local_cpus(self.host_sysfs_root, numa_nodes[gpu.index] if numa_nodes else UNKNOWN_NODE):
            if cpu < cpuSetSize * 64:
                mask[cpu // 64] |= 1 << cpu % 64
        return mask

    # --- modes ----------------------------------------------------------------------------------

    @nvml_call
    def nvmlDeviceGetComputeMode(self, handle) -> int:
        return self._gpu(handle).compute_mode

    @nvml_call
    def nvmlDeviceSetComputeMode(self, handle, mode: int) -> None:
        """Root only (nvidia-smi manual: "-c ... Requires root")."""
        gpu = self._gpu(handle)
        require_root()
        if mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:  # removed from the driver
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if mode not in _SETTABLE_COMPUTE_MODES:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu.compute_mode = mode
        self._commit()

    @nvml_call
    def nvmlDeviceGetVirtualizationMode(self, handle) -> int:
        # What `nvidia-smi -q` prints as "Virtualization Mode" (Pass-Through on the captured H100; vGPU in
        # a vGPU guest: sim_set_vgpu).
        self._gpu(handle)
        if self._node.vgpu_host:
            return pynvml.NVML_GPU_VIRTUALIZATION_MODE_VGPU
        return (pynvml.NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH if self._node.passthrough
                else pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE)

    @nvml_call
    def nvmlDeviceGetPersistenceMode(self, handle) -> int:
        self._gpu(handle)
        return pynvml.NVML_FEATURE_ENABLED  # nvidia-persistenced runs on a managed node

    # --- health ---------------------------------------------------------------------------------

    @nvml_call
    def nvmlDeviceGetTemperature(self, handle, sensor: int) -> int:
        model = self._gpu(handle).model
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return model.idle_temperature_c

    @nvml_call
    def nvmlDeviceGetTemperatureThreshold(self, handle, threshold: int) -> int:
        thresholds = self._gpu(handle).model.temperature_thresholds
        _require(threshold in thresholds)
        return thresholds[threshold]

    @nvml_call
    def nvmlDeviceGetPowerUsage(self, handle) -> int:
        return self._gpu(handle).model.idle_power_mw

    @nvml_call
    def nvmlDeviceGetEnforcedPowerLimit(self, handle) -> int:
        return self._gpu(handle).model.power_limit_mw

    @nvml_call
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle) -> int:
        return _clock_reasons(self._gpu(handle))

    @nvml_call
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle) -> int:
        """The older name of the same reading, kept in every branch (pynvml: deprecated)."""
        return _clock_reasons(self._gpu(handle))

    @nvml_call
    def nvmlDeviceGetEccMode(self, handle) -> list[int]:
        self._ecc_gpu(handle)
        return [pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_ENABLED]

    @nvml_call
    def nvmlDeviceGetTotalEccErrors(self, handle, errorType: int, counterType: int) -> int:
        gpu = self._ecc_gpu(handle)
        if errorType not in (0, 1) or counterType not in (0, 1):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.ecc.count(errorType, counterType)

    @nvml_call
    def nvmlDeviceGetRemappedRows(self, device) -> tuple[int, int, int, int]:
        gpu = self._gpu(device)
        _require(gpu.model.row_remapping)
        rows = gpu.remapped_rows
        return (rows.correctable, rows.uncorrectable, int(rows.pending), int(rows.failure))

    @nvml_call
    def nvmlDeviceGetPcieReplayCounter(self, handle) -> int:
        return self._gpu(handle).pcie_replays

    # --- NVLink ---------------------------------------------------------------------------------
    # A board without NVLink answers NOT_SUPPORTED (as does a VM that exposes no links: H100
    # capture). Links of a PCIe board without a bridge exist and are inactive: DISABLED, no fault
    # (reference README correction). Where an inactive or failed link leads is not known: the
    # remote queries answer NOT_SUPPORTED for it (no source; the strictest plausible answer).

    @nvml_call
    def nvmlDeviceGetNvLinkState(self, handle, link: int) -> int:
        gpu = self._nvlink_gpu(handle, link)
        return pynvml.NVML_FEATURE_ENABLED if self._link_active(gpu, link) else pynvml.NVML_FEATURE_DISABLED

    @nvml_call
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link: int) -> int:
        """NVML_NVLINK_DEVICE_TYPE_SWITCH on NVSwitch systems, _GPU for GPU-to-GPU links."""
        return self._active_link(handle, link).remote_type

    @nvml_call
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device, link: int) -> pynvml.nvmlPciInfo_t:
        """pynvml's name for nvmlDeviceGetNvLinkRemotePciInfo_v2: the bus id at the far end."""
        remote = self._active_link(device, link)
        info = pynvml.nvmlPciInfo_t()
        info.busIdLegacy = pci_bus_id_legacy(remote.remote_bus)
        info.busId = pci_bus_id(remote.remote_bus)
        info.domain, info.bus, info.device = 0, remote.remote_bus, 0
        return info

    def _nvlink_gpu(self, handle, link: int) -> Gpu:
        gpu = self._gpu(handle)
        _require(gpu.model.nvlinks > 0)
        if not isinstance(link, int) or not 0 <= link < gpu.model.nvlinks:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu

    @staticmethod
    def _link_active(gpu: Gpu, link: int) -> bool:
        return bool(gpu.links) and link not in gpu.nvlinks_down

    def _active_link(self, handle, link: int) -> Link:
        gpu = self._nvlink_gpu(handle, link)
        _require(self._link_active(gpu, link))
        return gpu.links[link]

    @nvml_call
    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle) -> int:
        gpu = self._gpu(handle)
        _require(gpu.model.page_retirement)
        return pynvml.NVML_FEATURE_ENABLED if gpu.retired_pages_pending else pynvml.NVML_FEATURE_DISABLED

    def _ecc_gpu(self, handle) -> Gpu:
        gpu = self._gpu(handle)
        _require(gpu.model.ecc)
        return gpu

    # Processes: _process_calls.py.
