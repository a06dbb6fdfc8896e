"""Reads the compute processes of GPUs and their MIG devices, with SM utilisation where NVML gives it.
Runs on the NVML thread.

What the driver answers (nvml.h):
- nvmlDeviceGetComputeRunningProcesses lists the processes with a compute context ("CUDA application
  which have active context"): PID, usedGpuMemory ("all of the memory used by the application";
  NVML_VALUE_NOT_AVAILABLE under Windows WDDM, which pynvml turns into None), and in the v2+ struct
  the GPU/compute instance ids (0xFFFFFFFF without MIG). On a MIG-enabled GPU the parent's handle gives
  "aggregate information, only if the caller has appropriate privileges": gpud asks each MIG device's
  handle instead, which answers for that device alone.
- PIDs are the host's: "the nvidia-driver itself does not support pid-namespaces ... you will always
  get the host pids, not the container pids" (NVIDIA/nvidia-docker#1483).
- nvmlDeviceGetProcessUtilization gives SM utilisation samples newer than a timestamp (microseconds);
  NOT_FOUND "if sample entries are not found"; "On MIG-enabled GPUs, querying process utilization is
  not currently supported".
A device the driver will not tell about (NOT_SUPPORTED, NO_PERMISSION, a lost GPU, a call the driver
lacks) lists no processes and says why; nothing here raises for one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gpud.nvml.reader import is_lost_error, nvml_error_text, text

MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE


@dataclass(frozen=True)
class ComputeProcess:
    pid: int
    used_memory_bytes: int | None  # None: the driver does not know (NVML_VALUE_NOT_AVAILABLE)
    sm_percent: int | None = None  # None: no sample (none since last time, or not supported)


@dataclass(frozen=True)
class DeviceProcesses:
    """The compute processes of one GPU (MIG off) or one MIG device."""

    gpu_uuid: str
    uuid: str  # the GPU's UUID, or the MIG device's
    gi_id: int | None = None  # MIG devices only
    ci_id: int | None = None
    processes: tuple[ComputeProcess, ...] = ()
    unavailable: str | None = None  # why no processes are listed: the driver would not tell
    sm_unavailable: str | None = None  # why no SM utilisation is given


class _Unavailable(Exception):
    """A device's processes cannot be read; the message says why."""


def read_processes(nvml: Any, gpu_uuids: list[str], since_us: int) -> list[DeviceProcesses]:
    """The processes of each GPU and of each MIG device on it; SM samples newer than since_us."""
    found: list[DeviceProcesses] = []
    for uuid in gpu_uuids:
        found += _read_gpu(nvml, uuid, since_us)
    return found


def _read_gpu(nvml: Any, uuid: str, since_us: int) -> list[DeviceProcesses]:
    try:
        handle = _guarded(nvml, lambda: nvml.nvmlDeviceGetHandleByUUID(uuid))
        mig_enabled = _mig_enabled(nvml, handle)
        if mig_enabled:
            return [_read_mig_device(nvml, uuid, device) for device in _mig_handles(nvml, handle)]
        processes = _guarded(nvml, lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except _Unavailable as why:
        return [DeviceProcesses(uuid, uuid, unavailable=str(why))]
    samples, sm_unavailable = _sm_samples(nvml, handle, since_us)
    listed = tuple(ComputeProcess(p.pid, p.usedGpuMemory, samples.get(p.pid)) for p in _unique(processes))
    return [DeviceProcesses(uuid, uuid, processes=listed, sm_unavailable=sm_unavailable)]


def _read_mig_device(nvml: Any, gpu_uuid: str, device: Any) -> DeviceProcesses:
    try:
        uuid = text(_guarded(nvml, lambda: nvml.nvmlDeviceGetUUID(device)))
        ids = _guarded(nvml, lambda: (nvml.nvmlDeviceGetGpuInstanceId(device),
                                      nvml.nvmlDeviceGetComputeInstanceId(device)))
    except _Unavailable as why:
        return DeviceProcesses(gpu_uuid, gpu_uuid, unavailable=f"a MIG device could not be read: {why}")
    try:
        processes = _guarded(nvml, lambda: nvml.nvmlDeviceGetComputeRunningProcesses(device))
    except _Unavailable as why:
        return DeviceProcesses(gpu_uuid, uuid, *ids, unavailable=str(why))
    listed = tuple(ComputeProcess(p.pid, p.usedGpuMemory) for p in _unique(processes))
    return DeviceProcesses(gpu_uuid, uuid, *ids, processes=listed,
                           sm_unavailable="NVML gives no per-process utilisation on MIG devices")


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        current, _ = nvml.nvmlDeviceGetMigMode(handle)
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
        return False  # not a MIG-capable GPU
    except nvml.NVMLError as exc:
        raise _Unavailable(_why(nvml, exc)) from None
    return current == MIG_ENABLED


def _mig_handles(nvml: Any, handle: Any) -> list[Any]:
    devices = []
    for index in range(_guarded(nvml, lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            devices.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index))
        except (nvml.NVMLError_NotFound, nvml.NVMLError_InvalidArgument):
            continue  # NVML allows holes in the MIG device index range
        except nvml.NVMLError as exc:
            raise _Unavailable(_why(nvml, exc)) from None
    return devices


def _sm_samples(nvml: Any, handle: Any, since_us: int) -> tuple[dict[int, int], str | None]:
    """PID -> SM utilisation (the newest sample per PID), and why there are none where that is known."""
    try:
        samples = nvml.nvmlDeviceGetProcessUtilization(handle, since_us)
    except nvml.NVMLError_NotFound:
        return {}, None  # no process used the SMs since since_us
    except nvml.NVMLError as exc:
        return {}, _why(nvml, exc)
    except nvml.NVMLLibraryMismatchError as exc:
        return {}, str(exc)
    newest: dict[int, Any] = {}
    for sample in samples:
        if sample.pid not in newest or sample.timeStamp > newest[sample.pid].timeStamp:
            newest[sample.pid] = sample
    return {pid: int(sample.smUtil) for pid, sample in newest.items()}, None


def _unique(processes: list) -> list:
    """One entry per PID: a process can be listed twice (several contexts); the larger memory counts."""
    by_pid: dict[int, Any] = {}
    for process in processes:
        known = by_pid.get(process.pid)
        if known is None or (process.usedGpuMemory or 0) > (known.usedGpuMemory or 0):
            by_pid[process.pid] = process
    return sorted(by_pid.values(), key=lambda p: p.pid)


def _guarded(nvml: Any, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except nvml.NVMLError as exc:
        raise _Unavailable(_why(nvml, exc)) from None
    except nvml.NVMLLibraryMismatchError as exc:  # pynvml's, for a struct version the driver lacks
        raise _Unavailable(str(exc)) from None


def _why(nvml: Any, exc: BaseException) -> str:
    if is_lost_error(nvml, exc):
        return f"the GPU is lost: {nvml_error_text(exc)}"
    if isinstance(exc, nvml.NVMLError_NoPermission):
        return f"the driver tells only root: {nvml_error_text(exc)}"
    return f"the driver does not tell: {nvml_error_text(exc)}"
