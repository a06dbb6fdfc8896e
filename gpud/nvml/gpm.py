"""Profiling metrics from NVML's GPM interface (Hopper and later), as DCGM reads them for its
DCGM_FI_PROF_* fields on those GPUs ("Hopper and Newer GPUs (GPM Module): GPM metrics are obtained from
NVML's GPM APIs", https://docs.nvidia.com/datacenter/dcgm/latest/reference/dcgm-api/dcgm-api-profiling.html).

One sample per device is kept from one pass to the next: each pass reads a new sample, computes the
metrics between the kept one and it (nvmlGpmMetricsGet), frees the kept one and keeps the new one. So the
metrics of a pass cover the whole time since the last, at one nvmlGpmSampleGet and one nvmlGpmMetricsGet
per device, as DCGM computes them between its latest sample and one a watch interval older
(dcgmlib/src/DcgmGpmManager.cpp GetLatestSample). Everything here runs on the NVML session's thread.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, fields
from typing import Any

from gpud.base.logs import get_logger
from gpud.nvml.reader import is_lost_error, nvml_error_text

log = get_logger("nvml")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Profile:
    """One device's profiling metrics between two samples, in DCGM's units: ratios 0-1 (DCGM divides
    GPM's percentages by 100, DcgmGpmManager.cpp GetLatestSample) and bytes per second (DCGM multiplies
    GPM's MiB/s by 1024 x 1024, DcgmCacheManager.cpp DCGM_FIELD_ID_IS_GPM_MIB_BANDWIDTH). None: NVML gave
    no value (the metric's own nvmlReturn, or NaN, which DCGM blanks too)."""

    gr_engine_active: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    pipe_tensor_active: float | None = None
    dram_active: float | None = None
    pipe_fp64_active: float | None = None
    pipe_fp32_active: float | None = None
    pipe_fp16_active: float | None = None
    pcie_tx_bytes: float | None = None
    pcie_rx_bytes: float | None = None
    nvlink_tx_bytes: float | None = None
    nvlink_rx_bytes: float | None = None


# Profile attribute -> (NVML_GPM_METRIC_<name>, the factor to DCGM's unit), as DCGM maps its fields to GPM
# metrics (dcgmlib/src/dcgm_fields.cpp DcgmFieldIdToNvmlGpmMetricId).
_METRICS = {
    "gr_engine_active": ("GRAPHICS_UTIL", 1 / 100),
    "sm_active": ("SM_UTIL", 1 / 100),
    "sm_occupancy": ("SM_OCCUPANCY", 1 / 100),
    "pipe_tensor_active": ("ANY_TENSOR_UTIL", 1 / 100),
    "dram_active": ("DRAM_BW_UTIL", 1 / 100),
    "pipe_fp64_active": ("FP64_UTIL", 1 / 100),
    "pipe_fp32_active": ("FP32_UTIL", 1 / 100),
    "pipe_fp16_active": ("FP16_UTIL", 1 / 100),
    "pcie_tx_bytes": ("PCIE_TX_PER_SEC", MIB),
    "pcie_rx_bytes": ("PCIE_RX_PER_SEC", MIB),
    "nvlink_tx_bytes": ("NVLINK_TOTAL_TX_PER_SEC", MIB),
    "nvlink_rx_bytes": ("NVLINK_TOTAL_RX_PER_SEC", MIB),
}
# What a GPU instance has of its own: DCGM gives the utilisation fields the entity level of a GPU or
# compute instance (DCGM_FE_GPU_CI, DRAM DCGM_FE_GPU_I) and PCIe and NVLink that of the GPU (DCGM_FE_GPU),
# so it reads no PCIe or NVLink for an instance (dcgm_fields.cpp; DcgmGpmManager.cpp GetLatestSample).
INSTANCE_METRICS = tuple(name for name in _METRICS if not name.startswith(("pcie", "nvlink")))
assert set(_METRICS) == {f.name for f in fields(Profile)}


@dataclass(frozen=True)
class GpmTarget:
    """A device to profile: a GPU (gi_id None), or one of its GPU instances, named by the MIG device that
    stands for it (the instance's first, as the framebuffer series)."""

    uuid: str  # the GPU's, or the MIG device's
    gpu_uuid: str
    gi_id: int | None = None


class GpmSampler:
    """The samples kept between passes, and which GPUs have no GPM (each said once in the log)."""

    def __init__(self) -> None:
        self._kept: dict[str, Any] = {}  # target UUID -> its last sample
        self.unsupported: dict[str, str] = {}  # GPU UUID -> why it has no GPM
        self._supported_gpus: set[str] = set()
        self._newly_unsupported: dict[str, str] = {}  # found in this pass: logged at its end
        self._failing: dict[str, str] = {}  # target UUID -> the error its sampling answered (said once)
        # sample() runs on the NVML thread, free_all() also on a worker thread when NVML is released
        self._lock = threading.Lock()

    def sample(self, nvml: Any, targets: list[GpmTarget]) -> dict[str, Profile]:
        """A new sample of every target, and its metrics since the kept one (a target first sampled has
        none yet). Samples of targets that are gone are freed."""
        with self._lock:
            profiles, handles = {}, {}
            for target in targets:
                if target.gpu_uuid not in handles:
                    handles[target.gpu_uuid] = self._gpu_handle(nvml, target.gpu_uuid)
                handle = handles[target.gpu_uuid]
                profile = self._sample_one(nvml, handle, target) if handle is not None else None
                if handle is None:
                    self._drop(nvml, target.uuid)
                if profile is not None:
                    profiles[target.uuid] = profile
            for uuid in set(self._kept) - {target.uuid for target in targets}:
                self._drop(nvml, uuid)
            if self._newly_unsupported:  # said once: one line for the GPUs found without GPM in this pass
                log.info("gpm_not_supported", gpus=self._newly_unsupported, profiling_series="none for these GPUs")
                self._newly_unsupported = {}
            return profiles

    def free_all(self, nvml: Any) -> None:
        """Frees every kept sample (before NVML shuts down: a GPU reset, gpud stopping)."""
        with self._lock:
            for uuid in list(self._kept):
                self._drop(nvml, uuid)

    # -- one target --------------------------------------------------------------------------------

    def _gpu_handle(self, nvml: Any, gpu_uuid: str) -> Any:
        """The GPU's handle, if it answers and has GPM."""
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        except nvml.NVMLError:
            return None  # lost: the inventory says so
        return handle if self._supported(nvml, handle, gpu_uuid) else None

    def _supported(self, nvml: Any, handle: Any, gpu_uuid: str) -> bool:
        """nvmlGpmQueryDeviceSupport, asked once per GPU as DCGM asks it at discovery (DcgmGpmManager.cpp
        DoesNvmlDeviceSupportGpm): an error (FUNCTION_NOT_FOUND on a driver without GPM) or
        isSupportedDevice 0 is no GPM."""
        if gpu_uuid in self._supported_gpus or gpu_uuid in self.unsupported:
            return gpu_uuid in self._supported_gpus
        try:
            supported = bool(nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except nvml.NVMLError as exc:
            if is_lost_error(nvml, exc):
                return False  # asked again once it answers
            self._no_gpm(gpu_uuid, f"nvmlGpmQueryDeviceSupport answered {nvml_error_text(exc)}")
            return False
        if supported:
            self._supported_gpus.add(gpu_uuid)
        else:
            self._no_gpm(gpu_uuid, "nvmlGpmQueryDeviceSupport: no GPM on this GPU (GPM is for Hopper and later)")
        return supported

    def _no_gpm(self, gpu_uuid: str, why: str) -> None:
        self.unsupported[gpu_uuid] = self._newly_unsupported[gpu_uuid] = why

    def _sample_one(self, nvml: Any, handle: Any, target: GpmTarget) -> Profile | None:
        sample = nvml.nvmlGpmSampleAlloc()
        try:
            if target.gi_id is None:
                nvml.nvmlGpmSampleGet(handle, sample)
            else:
                nvml.nvmlGpmMigSampleGet(handle, target.gi_id, sample)
        except nvml.NVMLError as exc:
            nvml.nvmlGpmSampleFree(sample)
            self._drop(nvml, target.uuid)
            self._failed(nvml, target, "nvmlGpmSampleGet", exc)
            return None
        kept = self._kept.get(target.uuid)
        self._kept[target.uuid] = sample
        if kept is None:
            return None
        names = INSTANCE_METRICS if target.gi_id is not None else tuple(_METRICS)
        try:
            profile = self._metrics(nvml, kept, sample, names)
        except nvml.NVMLError as exc:
            self._failed(nvml, target, "nvmlGpmMetricsGet", exc)
            return None
        finally:
            nvml.nvmlGpmSampleFree(kept)
        self._failing.pop(target.uuid, None)
        return profile

    def _failed(self, nvml: Any, target: GpmTarget, call: str, exc: Exception) -> None:
        """A GPU whose sampling answers NOT_SUPPORTED has no GPM after all (nvml.h's GPM note: a vGPU
        without all of its instance's memory); any other error is said once per device until it passes, a
        lost GPU's not at all (the inventory says so)."""
        error = f"{call} answered {nvml_error_text(exc)}"
        if target.gi_id is None and exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
            self._supported_gpus.discard(target.gpu_uuid)
            self._no_gpm(target.gpu_uuid, error)
        elif self._failing.get(target.uuid) != error and not is_lost_error(nvml, exc):
            self._failing[target.uuid] = error
            log.warning("gpm_failed", device=target.uuid, gpu=target.gpu_uuid, gi=target.gi_id, error=error)

    @staticmethod
    def _metrics(nvml: Any, first: Any, second: Any, names: tuple[str, ...]) -> Profile:
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(names)
        request.sample1, request.sample2 = first, second
        for slot, name in zip(request.metrics, names):
            slot.metricId = getattr(nvml, f"NVML_GPM_METRIC_{_METRICS[name][0]}")
        nvml.nvmlGpmMetricsGet(request)
        values = {}
        for slot, name in zip(request.metrics, names):
            if slot.nvmlReturn == nvml.NVML_SUCCESS and not math.isnan(slot.value):
                values[name] = slot.value * _METRICS[name][1]
        return Profile(**values)

    def _drop(self, nvml: Any, uuid: str) -> None:
        sample = self._kept.pop(uuid, None)
        if sample is not None:
            try:
                nvml.nvmlGpmSampleFree(sample)
            except nvml.NVMLError as exc:  # NVML already gone: the sample went with it
                log.debug("gpm_sample_free_failed", device=uuid, error=nvml_error_text(exc))
