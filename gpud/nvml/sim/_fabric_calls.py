"""NVML's NVLink fabric calls: nvmlDeviceGetGpuFabricInfo (v1) and nvmlDeviceGetGpuFabricInfoV (v2, v3).

nvml.h, nvmlDeviceGetGpuFabricInfo: "For Hopper or newer fully supported devices. On Hopper + NVSwitch
systems, GPU is registered with the NVIDIA Fabric Manager. Upon successful registration, the GPU is
added to the NVLink fabric to enable peer-to-peer communication"; NVML_ERROR_NOT_SUPPORTED "If device
doesn't support gpu fabric". So the simulator answers only for Hopper and later GPUs whose NVLinks reach
NVSwitches, on more than one GPU (leptonai/gpud#1140: "if it's set up with a single GPU, the NVML returns
Not Supported for fabric state"), outside a VM. Where a Hopper or later GPU has no fabric (one GPU, no
NVSwitch, passed through to a VM) the call succeeds with state NOT_SUPPORTED: our H100, a single SXM5
passed through to a VM on 580.159.04, answered so on 2026-11-26 (docs/hardware.md; its nvidia-smi shows
every Fabric row N/A). Older GPUs answer NOT_SUPPORTED (a p4d DGX A100 with Fabric Manager running shows
"State: N/A, Status: N/A": bottlerocket-os/bottlerocket#3873).

The state: COMPLETED with status SUCCESS once Fabric Manager has registered the GPU; IN_PROGRESS until
then: with Fabric Manager dead since boot, "fabric.state stays 'In Progress' indefinitely"
(NVIDIA/NVSentinel#889; #883 node 1), and it does not revert when the daemon exits after registering
(NVSentinel ADR discussion, #1380). The health mask of a registered GPU says every condition is false
(NVML_GPU_FABRIC_HEALTH_MASK_*_FALSE, incorrect configuration NONE): a healthy fabric, as NVIDIA's mock
NVML encodes a healthy one (engine/fabric_health.go). Cluster UUID and clique id are zero on an HGX
board (the cluster UUID names a multi-node NVLink domain, GB200 NVL72). sim_set_fabric injects another
state, status or mask.
"""

from __future__ import annotations

import ctypes

import pynvml
from pynvml import NVML_ERROR_ARGUMENT_VERSION_MISMATCH, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED, NVMLError

from ._core import SimCore, nvml_call
from .state import Gpu
from .topology import reaches_switches


def _field(mask: int, name: str, value: str) -> int:
    return mask | getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_{name}_{value}") << getattr(
        pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{name}")


HEALTHY_MASK = 0
for _name in ("DEGRADED_BW", "ROUTE_RECOVERY", "ROUTE_UNHEALTHY", "ACCESS_TIMEOUT_RECOVERY"):
    HEALTHY_MASK = _field(HEALTHY_MASK, _name, "FALSE")
HEALTHY_MASK = _field(HEALTHY_MASK, "INCORRECT_CONFIGURATION", "NONE")
# A degraded-bandwidth mask: what sim_set_fabric callers usually inject.
DEGRADED_BW_MASK = (HEALTHY_MASK & ~(pynvml.NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW
                                     << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW)) | (
    pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW)

_VERSIONS = {getattr(pynvml, "nvmlGpuFabricInfo_v2", None): 2, getattr(pynvml, "nvmlGpuFabricInfo_v3", None): 3}


class FabricCalls(SimCore):
    def _fabric_supported(self, gpu: Gpu) -> bool:
        return (gpu.model.architecture >= pynvml.NVML_DEVICE_ARCH_HOPPER and reaches_switches(gpu.links)
                and len(self._gpus) > 1 and not self._node.passthrough)

    def _fabric(self, gpu: Gpu) -> tuple[int, int, int]:
        """(state, status, health mask) of a GPU whose fabric NVML reports."""
        if not self._fabric_supported(gpu):  # Hopper or later without a fabric: the state says so
            state, status, mask = pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, pynvml.NVML_SUCCESS, 0
        elif gpu.fabric_registered:
            state, status, mask = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_SUCCESS, HEALTHY_MASK
        else:
            # nvml.h: status "Must be checked only if state returns complete"; nothing to say before then.
            state, status, mask = pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, pynvml.NVML_SUCCESS, 0
        fault = gpu.fabric_fault or {}
        return fault.get("state", state), fault.get("status", status), fault.get("health_mask", mask)

    def _fabric_gpu(self, handle) -> Gpu:
        gpu = self._gpu(handle)
        if gpu.model.architecture < pynvml.NVML_DEVICE_ARCH_HOPPER:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    @nvml_call
    def nvmlDeviceGetGpuFabricInfo(self, device, gpuFabricInfo) -> int:
        """pynvml's shape: fills the caller's c_nvmlGpuFabricInfo_t (v1: no version, no health mask),
        given as pynvml passes it on to the C function: byref(struct), a pointer, or the struct."""
        gpuFabricInfo = _struct(gpuFabricInfo)
        if not isinstance(gpuFabricInfo, pynvml.c_nvmlGpuFabricInfo_t):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._fabric_gpu(device)
        self._fill(gpuFabricInfo, *self._fabric(gpu))
        return pynvml.NVML_SUCCESS

    @nvml_call
    def nvmlDeviceGetGpuFabricInfoV(self, device, gpuFabricInfo) -> int:
        """The versioned call: the caller sets `version` (nvmlGpuFabricInfo_v2 or _v3) in a struct of
        that version. An unknown version, or one newer than the driver's, is ARGUMENT_VERSION_MISMATCH
        (nvml.h's versioned-struct convention; NVIDIA's mock answers so too, bridge/fabric.go)."""
        gpuFabricInfo = _struct(gpuFabricInfo)
        version = _VERSIONS.get(getattr(gpuFabricInfo, "version", None))
        if version is None or not self._driver.takes_fabric_info_version(version):
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if ctypes.sizeof(gpuFabricInfo) < ctypes.sizeof(
                pynvml.c_nvmlGpuFabricInfo_v3_t if version == 3 else pynvml.c_nvmlGpuFabricInfo_v2_t):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._fabric_gpu(device)
        state, status, mask = self._fabric(gpu)
        self._fill(gpuFabricInfo, state, status, mask)
        gpuFabricInfo.healthMask = mask
        if version == 3:
            gpuFabricInfo.healthSummary = _summary(mask)
        return pynvml.NVML_SUCCESS

    @staticmethod
    def _fill(info, state: int, status: int, mask: int) -> None:
        info.clusterUuid[:] = bytes(pynvml.NVML_GPU_FABRIC_UUID_LEN)
        info.status = status
        info.cliqueId = 0
        info.state = state


def _struct(argument):
    """The structure behind what a pynvml caller passes: byref(struct), pointer(struct) or the struct."""
    if type(argument).__name__ == "CArgObject":
        return argument._obj
    if isinstance(argument, ctypes._Pointer):
        return argument.contents if argument else None
    return argument


def _summary(mask: int) -> int:
    """NVML_GPU_FABRIC_HEALTH_SUMMARY_* for a mask, as NVIDIA's mock derives it (engine/fabric_health.go,
    deriveFabricHealthSummary): a routing or configuration fault is UNHEALTHY, degraded bandwidth alone
    LIMITED_CAPACITY, a mask of nothing NOT_SUPPORTED."""
    def get(name: str) -> int:
        return (mask >> getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{name}")) & getattr(
            pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_{name}")
    if not mask:
        return pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED
    if any(get(name) == 1 for name in ("ROUTE_RECOVERY", "ROUTE_UNHEALTHY", "ACCESS_TIMEOUT_RECOVERY")) or \
            get("INCORRECT_CONFIGURATION") > pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE:
        return pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY
    if get("DEGRADED_BW") == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE:
        return pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY
    return pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
