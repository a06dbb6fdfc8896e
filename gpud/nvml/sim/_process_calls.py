"""NVML process queries: the compute processes of a GPU or MIG device and their SM utilisation."""

from __future__ import annotations

import time

import pynvml
from pynvml import NVML_ERROR_NOT_FOUND, NVML_ERROR_NOT_SUPPORTED, NVMLError

from . import structs
from ._core import SimCore, nvml_call

# nvml.h, nvmlUtilization_t: "Each sample period may be between 1 second and 1/6 second, depending on
# the product being queried": the simulator samples every 1/6 second.
SAMPLE_PERIOD_US = 1_000_000 // 6


def _last_sample_us() -> int:
    """The newest sample's timestamp: CLOCK_REALTIME in microseconds, as real samples carry (pynvml's
    c_nvmlProcessUtilizationSample_t.timeStamp; e.g. 1653167163586231 in a published V100 run)."""
    now_us = time.time_ns() // 1000
    return now_us - now_us % SAMPLE_PERIOD_US


class ProcessCalls(SimCore):
    @nvml_call
    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle) -> list:
        """All processes of a GPU (with their GI/CI ids under MIG), or those of one MIG device.

        nvml.h: "In MIG mode, if device handle is provided, the API returns aggregate information, only
        if the caller has appropriate privileges. Per-instance information can be queried by using
        specific MIG device handles." No source says what a caller without them gets (an error or an
        empty list): not modelled, the aggregate is answered to everyone (gpud reads MIG device handles).
        A process is listed while it has a context, so not after it exited (SimProcess.running).
        """
        gpu, mig_device = self._device(handle)
        if mig_device is None:
            return [structs.process_info(*entry) for entry in gpu.running_process_table()]
        gi, ci = mig_device
        return [structs.process_info(process, gi.id, ci.id) for process in ci.running_process_table()]

    nvmlDeviceGetComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses_v3
    nvmlDeviceGetComputeRunningProcesses_v2 = nvmlDeviceGetComputeRunningProcesses_v3

    @nvml_call
    def nvmlDeviceGetProcessUtilization(self, handle, timeStamp: int) -> list:
        """SM utilisation samples of the GPU's processes newer than `timeStamp` (microseconds).

        nvml.h: NOT_FOUND "if sample entries are not found"; only processes that used the SMs are
        sampled (a process with no SM use has no entry). "On MIG-enabled GPUs, querying process
        utilization is not currently supported" (nvml.h; SchedMD Slurm's gpu_nvml.c logs the same
        words): NOT_SUPPORTED for MIG device handles and for a GPU in MIG mode. No source gives the
        per-process memory, encoder and decoder figures a compute process shows: 0.
        """
        gpu, mig_device = self._device(handle)
        if mig_device is not None or gpu.mig_enabled:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not isinstance(timeStamp, int) or timeStamp < 0:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        sampled_at = _last_sample_us()
        busy = [process for process, _, _ in gpu.running_process_table() if process.sm_percent]
        if not busy or timeStamp >= sampled_at:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return [structs.process_utilization_sample(process, sampled_at) for process in busy]
