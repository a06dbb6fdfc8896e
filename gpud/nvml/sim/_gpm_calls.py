"""NVML's GPM (GPU Performance Monitoring) calls: sample buffers, samples of a GPU, a MIG device or a GPU
instance, and the metrics between two samples (nvml.h, "NVML GPM"; NVIDIA/go-nvml pkg/nvml/nvml.h).

What each call does, and where it comes from:
* GPM is "For Hopper or newer fully supported devices" (nvml.h, every GPM function):
  nvmlGpmQueryDeviceSupport answers SUCCESS with isSupportedDevice 0 on an older GPU (the struct's field
  says whether; NVIDIA's mock NVML answers so, NVIDIA/k8s-test-infra pkg/gpu/mocknvml/engine/device.go
  GetGpmSupport, and DCGM reads the field, dcgmlib/src/DcgmGpmManager.cpp DoesNvmlDeviceSupportGpm), while
  sampling one answers NOT_SUPPORTED (the mock's engine/gpm.go GpmSnapshotInto); so does
  nvmlGpmQueryIfStreamingEnabled (nvml.h: NOT_SUPPORTED "if this query is not supported by the device").
* A sample is an opaque handle from nvmlGpmSampleAlloc, freed with nvmlGpmSampleFree (a handle never
  allocated or freed already: INVALID_ARGUMENT, nvml.h "if an invalid pointer is provided"). Samples are
  this process's memory: they are not in the state file and go with the last nvmlShutdown.
* nvmlGpmSampleGet takes "the device handle or MIG device handle" (nvml.h); nvmlGpmMigSampleGet a GPU
  handle and a GPU instance id. nvml.h documents no error for that id: a GPU without MIG mode answers
  NOT_SUPPORTED and an id with no GPU instance NOT_FOUND, as nvmlDeviceGetGpuInstanceById documents for
  the same lookup ("If device doesn't have MIG mode enabled", "If the GPU instance is not found").
* nvmlGpmMetricsGet computes each requested metric from two samples of the same device: `version` must
  be NVML_GPM_METRICS_GET_VERSION (ARGUMENT_VERSION_MISMATCH otherwise) and numMetrics between 1 and
  NVML_GPM_METRIC_MAX (INVALID_ARGUMENT), and each metric has its own nvmlReturn ("If this is nonzero,
  then value is not valid"): NOT_SUPPORTED for one the device does not give (the mock's engine/gpm.go
  gpmMetricValue answers unknown ids so). Samples of two devices are INVALID_ARGUMENT: the difference
  means nothing (inferred: nvml.h does not say).

A sample holds counters that grow with the device's activity (activity x seconds for utilisations, MiB
for rates), so two samples' difference over the time between them is the metric: percent 0-100 for the
utilisations, MiB/s for PCIe and NVLink (nvml.h's units per NVML_GPM_METRIC_*). The activity in force
when a device is sampled counts from its previous sample on (the simulated processes change only
between calls). The simulator gives the metrics telemetry.yaml `gpm` lists; PCIe and NVLink only on
whole-GPU samples (DCGM reads them per GPU only: dcgmlib/src/dcgm_fields.cpp gives DCGM_FI_PROF_PCIE_*
and _NVLINK_* the entity level DCGM_FE_GPU), NVLink only on a board with NVLink.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

import pynvml
import yaml
from pynvml import (
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_SUCCESS,
    NVMLError,
)

from ._core import SimCore, nvml_call
from ._telemetry_calls import _sm_percent
from .handles import HandleRef, Kind, decode, make_handle
from .state import ComputeInstance, Gpu, GpuInstance

_NVLINK_METRICS = (pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC)


@dataclass(frozen=True)
class GpmModel:
    """telemetry.yaml `gpm`: metric id -> share of the activity, and metric id -> MiB/s at full activity."""

    shares: Mapping[int, float]
    full_activity_mib_per_s: Mapping[int, float]


@functools.cache
def gpm_model() -> GpmModel:
    text = resources.files(__package__).joinpath("telemetry.yaml").read_text(encoding="utf-8")
    section = yaml.safe_load(text)["gpm"]

    def by_id(rows: dict) -> dict[int, float]:
        return {getattr(pynvml, f"NVML_GPM_METRIC_{name}"): float(value) for name, value in rows.items()}

    return GpmModel(by_id(section["shares"]), by_id(section["full_activity_mib_per_s"]))


@dataclass(frozen=True)
class GpmSnapshot:
    """What one nvmlGpmSampleGet read into a sample."""

    device: tuple  # what was sampled: (GPU UUID, GI serial, CI serial), None for a level not sampled
    at: float  # time.monotonic()
    counters: Mapping[int, float]  # metric id -> its counter


class GpmCalls(SimCore):
    @nvml_call
    def nvmlGpmQueryDeviceSupport(self, device) -> pynvml.c_nvmlGpmSupport_t:
        gpu, _ = self._device(device)
        return pynvml.c_nvmlGpmSupport_t(version=pynvml.NVML_GPM_SUPPORT_VERSION,
                                         isSupportedDevice=int(_has_gpm(gpu)))

    @nvml_call
    def nvmlGpmQueryIfStreamingEnabled(self, device) -> int:
        """NVML_FEATURE_DISABLED: nothing here turns GPM streaming on (nvmlGpmSetStreamingEnabled is not
        simulated)."""
        self._gpm_device(device)
        return pynvml.NVML_FEATURE_DISABLED

    @nvml_call
    def nvmlGpmSampleAlloc(self):
        serial = next(self._gpm_serials)
        self._gpm_samples[serial] = None
        return make_handle(HandleRef(Kind.GPM_SAMPLE, serial=serial))

    @nvml_call
    def nvmlGpmSampleFree(self, gpmSample) -> None:
        self._gpm_samples.pop(self._gpm_sample_serial(gpmSample))

    @nvml_call
    def nvmlGpmSampleGet(self, device, gpmSample):
        serial = self._gpm_sample_serial(gpmSample)
        gpu, mig_device = self._gpm_device(device)
        if mig_device is None:
            self._take(serial, gpu, None, None)
        else:
            self._take(serial, gpu, mig_device.gpu_instance, mig_device.compute_instance)
        return gpmSample

    @nvml_call
    def nvmlGpmMigSampleGet(self, device, gpuInstanceId: int, gpmSample):
        serial = self._gpm_sample_serial(gpmSample)
        gpu = self._gpm_device(device, on_mig_handle=NVML_ERROR_INVALID_ARGUMENT)[0]
        if not gpu.mig_enabled:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        gi = gpu.gpu_instances.get(gpuInstanceId)
        if gi is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        self._take(serial, gpu, gi, None)
        return gpmSample

    @nvml_call
    def nvmlGpmMetricsGet(self, metricsGet: pynvml.c_nvmlGpmMetricsGet_t) -> pynvml.c_nvmlGpmMetricsGet_t:
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if not 1 <= metricsGet.numMetrics <= pynvml.NVML_GPM_METRIC_MAX:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        first, second = (self._gpm_samples.get(self._gpm_sample_serial(sample))
                         for sample in (metricsGet.sample1, metricsGet.sample2))
        if first is None or second is None or first.device != second.device:  # not taken, or two devices
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        seconds = abs(second.at - first.at)
        for metric in metricsGet.metrics[:metricsGet.numMetrics]:
            grown = abs(second.counters.get(metric.metricId, math.nan) - first.counters.get(metric.metricId, math.nan))
            if math.isnan(grown):
                metric.nvmlReturn, metric.value = NVML_ERROR_NOT_SUPPORTED, 0.0
            else:
                metric.nvmlReturn, metric.value = NVML_SUCCESS, grown / seconds if seconds else 0.0
        return metricsGet

    # -- the samples --------------------------------------------------------------------------------

    def _gpm_sample_serial(self, sample) -> int:
        ref = decode(sample)
        if ref is None or ref.kind is not Kind.GPM_SAMPLE or ref.serial not in self._gpm_samples:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return ref.serial

    def _gpm_device(self, device, on_mig_handle: int | None = None):
        """The GPU (and MIG device) of a handle GPM can sample: NOT_SUPPORTED before Hopper."""
        gpu, mig_device = self._device(device)
        if not _has_gpm(gpu):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if mig_device is not None and on_mig_handle is not None:
            raise NVMLError(on_mig_handle)
        return gpu, mig_device

    def _take(self, serial: int, gpu: Gpu, gi: GpuInstance | None, ci: ComputeInstance | None) -> None:
        """The device's counters now: the last sample's (of any buffer) grown at the activity now."""
        device = (gpu.uuid, gi.serial if gi else None, ci.serial if ci else None)
        now, rates = time.monotonic(), self._gpm_rates(gpu, gi, ci)
        last = self._gpm_last.get(device)
        counters = {metric: (last.counters[metric] + rate * (now - last.at) if last else 0.0)
                    for metric, rate in rates.items()}
        self._gpm_last[device] = self._gpm_samples[serial] = GpmSnapshot(device, now, counters)

    def _gpm_rates(self, gpu: Gpu, gi: GpuInstance | None, ci: ComputeInstance | None) -> dict[int, float]:
        """Metric id -> what it reads now on this device: percent for utilisations, MiB/s for rates."""
        model = gpm_model()
        activity = (_ci_activity(ci) if ci else _gi_activity(gi) if gi else _gpu_activity(gpu))
        rates = {metric: share * activity for metric, share in model.shares.items()}
        if gi is None:  # PCIe and NVLink are the whole GPU's
            rates.update({metric: mib_s * activity / 100 for metric, mib_s in model.full_activity_mib_per_s.items()})
            if gpu.model.nvlinks:
                rates.update(dict.fromkeys(_NVLINK_METRICS, 0.0))
        return rates


def _has_gpm(gpu: Gpu) -> bool:
    return gpu.model.architecture >= pynvml.NVML_DEVICE_ARCH_HOPPER


def _ci_activity(ci: ComputeInstance) -> float:
    """A MIG device's processes' SM percentages, of its own SMs, at most 100."""
    return min(100.0, sum(process.sm_percent or 0 for process in ci.running_process_table()))


def _gi_activity(gi: GpuInstance) -> float:
    """A GPU instance's: its compute instances', each weighed by its share of the instance's slices."""
    return min(100.0, sum(_ci_activity(ci) * ci.profile.slice_count / gi.profile.slice_count
                          for ci in gi.compute_instances.values()))


def _gpu_activity(gpu: Gpu) -> float:
    """A whole GPU's: as its utilisation rates (MIG off); in MIG mode its GPU instances', each weighed by
    its share of the GPU's slices."""
    if not gpu.mig_enabled:
        return float(_sm_percent(gpu))
    slices = max(profile.slice_count for profile in gpu.model.mig.gpu_instance_profiles)
    return min(100.0, sum(_gi_activity(gi) * gi.profile.slice_count / slices for gi in gpu.gpu_instances.values()))

