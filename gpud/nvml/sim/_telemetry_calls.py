"""NVML telemetry queries: clocks, utilisation, total energy and field values (memory temperature,
NVLink throughput), with each model's values from telemetry.yaml.

Every call here is a whole-GPU query: MIG device handles answer NOT_SUPPORTED, as the simulator's other
whole-GPU queries do (DCGM reports clocks per physical GPU and no utilisation per MIG instance:
NVIDIA/dcgm-exporter#216 and #430, NVIDIA/DCGM#80). No source shows these calls differing between the
R535, R550 and R580 branches: they answer alike on all three.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

import pynvml
import yaml
from pynvml import NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED, NVML_SUCCESS, NVMLError

from ._core import SimCore, nvml_call
from ._process_calls import SAMPLE_PERIOD_US
from .state import Gpu

# nvml.h, NVLink throughput fields: "A scopeId of UINT_MAX returns aggregate value summed up across all
# links for the specified counter type in fieldId."
ALL_LINKS = 0xFFFFFFFF
_NVLINK_THROUGHPUT_FIELDS = frozenset({
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX,
})
_CLOCK_NAMES = {pynvml.NVML_CLOCK_GRAPHICS: "graphics", pynvml.NVML_CLOCK_SM: "graphics",
                pynvml.NVML_CLOCK_MEM: "memory", pynvml.NVML_CLOCK_VIDEO: "video"}


@dataclass(frozen=True)
class Telemetry:
    """One model's row of telemetry.yaml."""

    idle_clocks_mhz: Mapping[str, int]  # "graphics" | "memory" | "video" -> MHz
    busy_clocks_mhz: Mapping[str, int]
    memory_c: int | None  # None: no memory temperature sensor reported
    energy_counter: bool


@functools.cache
def telemetry() -> Mapping[str, Telemetry]:
    """telemetry.yaml by model key (models.yaml's keys)."""
    text = resources.files(__package__).joinpath("telemetry.yaml").read_text(encoding="utf-8")
    return {key: Telemetry(idle_clocks_mhz=row["clocks_mhz"]["idle"], busy_clocks_mhz=row["clocks_mhz"]["max"],
                           memory_c=row["memory_c"], energy_counter=row["energy_counter"])
            for key, row in yaml.safe_load(text)["models"].items()}


def seconds_since_boot() -> float:
    """CLOCK_BOOTTIME: the driver loads at boot, and its energy counter counts from there."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _busy(gpu: Gpu) -> bool:
    """A GPU with compute processes runs at its boost clocks (its clock-event reasons say "none")."""
    return bool(gpu.running_processes())


def _sm_percent(gpu: Gpu) -> int:
    """GPU utilisation: the SM shares of its processes (what nvmlDeviceGetProcessUtilization samples), at
    most 100. No source gives a process's memory traffic, so memory utilisation stays 0."""
    return min(100, sum(process.sm_percent or 0 for process, _, _ in gpu.running_process_table()))


class TelemetryCalls(SimCore):
    @nvml_call
    def nvmlDeviceGetClockInfo(self, handle, type: int) -> int:  # `type`: pynvml's parameter name
        """NVML_CLOCK_GRAPHICS and NVML_CLOCK_SM are the same clock on these GPUs (H100 capture: both 405
        MHz idle, both 1980 MHz max); an unknown clock type is INVALID_ARGUMENT."""
        gpu = self._gpu(handle)
        if type not in _CLOCK_NAMES:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        model = telemetry()[gpu.model.key]
        clocks = model.busy_clocks_mhz if _busy(gpu) else model.idle_clocks_mhz
        return clocks[_CLOCK_NAMES[type]]

    @nvml_call
    def nvmlDeviceGetTotalEnergyConsumption(self, handle) -> int:
        """Millijoules since the driver loaded (nvml.h): the power draw integrated since boot. The
        simulated draw is constant (nvmlDeviceGetPowerUsage), so mW x s = mJ."""
        gpu = self._gpu(handle)
        if not telemetry()[gpu.model.key].energy_counter:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return int(gpu.model.idle_power_mw * seconds_since_boot())

    @nvml_call
    def nvmlDeviceGetUtilizationRates(self, handle) -> pynvml.c_nvmlUtilization_t:
        """nvml.h: "On MIG-enabled GPUs, querying device utilization rates is not currently supported":
        NOT_SUPPORTED on a GPU in MIG mode, not only on its MIG device handles. Idle: 0 and 0 (H100
        capture)."""
        gpu = self._gpu_without_mig(handle)
        return pynvml.c_nvmlUtilization_t(gpu=_sm_percent(gpu), memory=0)

    @nvml_call
    def nvmlDeviceGetEncoderUtilization(self, handle) -> list[int]:
        """[percent, sampling period in us]. 0 on every model: no simulated process encodes video (the
        H100 capture, whose board has no NVENC, answers 0 too). Under MIG: NOT_SUPPORTED, as the
        utilisation rates (no source for the encoder itself: the strictest plausible answer)."""
        self._gpu_without_mig(handle)
        return [0, SAMPLE_PERIOD_US]

    @nvml_call
    def nvmlDeviceGetDecoderUtilization(self, handle) -> list[int]:
        """As the encoder: 0 (H100 capture), NOT_SUPPORTED under MIG."""
        self._gpu_without_mig(handle)
        return [0, SAMPLE_PERIOD_US]

    @nvml_call
    def nvmlDeviceGetFieldValues(self, handle, fieldIds: list) -> ctypes.Array:
        """pynvml's shape: one c_nvmlFieldValue_t per requested field, each with its own nvmlReturn; a
        field is an id or an (id, scopeId) tuple. Answered: NVML_FI_DEV_MEMORY_TEMP (unsigned int,
        NOT_SUPPORTED where the board reports none) and the NVLink throughput counters (KiB, unsigned
        long long; NOT_SUPPORTED on a board without NVLink, INVALID_ARGUMENT for a link it lacks). The
        simulated processes exchange no peer-to-peer data, so the throughput counters stay at 0. Any
        other field answers NOT_SUPPORTED, as one the board lacks.

        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230, unsigned int, NVML_GPU_RECOVERY_ACTION_*): the GPU's
        recovery action from R565 on (models.yaml fields_added_in); older drivers do not know the id and
        answer it NOT_SUPPORTED. Every model answers it: a driver field, no hardware counter (our H100 and
        H200 captures on 580: "GPU Recovery Action : None"; nvml.h names no architecture for it)."""
        gpu = self._gpu(handle)
        if not isinstance(fieldIds, (list, tuple)) or not fieldIds:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        now_us = time.time_ns() // 1000
        for value, requested in zip(values, fieldIds):
            value.fieldId, value.scopeId = requested if isinstance(requested, tuple) else (requested, 0)
            value.timestamp = now_us
            self._field_value(gpu, value)
        return values

    def _field_value(self, gpu: Gpu, value: pynvml.c_nvmlFieldValue_t) -> None:
        value.nvmlReturn = NVML_SUCCESS
        if not self._driver.has_field(value.fieldId):
            value.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        elif value.fieldId == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
            value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            value.value.uiVal = gpu.recovery_action
        elif value.fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP and telemetry()[gpu.model.key].memory_c is not None:
            value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            value.value.uiVal = telemetry()[gpu.model.key].memory_c
        elif value.fieldId in _NVLINK_THROUGHPUT_FIELDS and gpu.model.nvlinks:
            if value.scopeId != ALL_LINKS and value.scopeId >= gpu.model.nvlinks:
                value.nvmlReturn = NVML_ERROR_INVALID_ARGUMENT
            value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            value.value.ullVal = 0
        else:
            value.nvmlReturn = NVML_ERROR_NOT_SUPPORTED

    def _gpu_without_mig(self, handle) -> Gpu:
        gpu = self._gpu(handle)
        if gpu.mig_enabled:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu
