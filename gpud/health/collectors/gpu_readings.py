"""The GPUs' readings (and their GPU instances' memory) under dcgm-exporter's names, and the NVLink
bandwidth between the last two readings."""

from __future__ import annotations

from typing import Iterator

from gpud.base.samples import Family
from gpud.health.collectors import LabelledGpus, add_known
from gpud.health.dcgm_fields import GPU_READINGS, MIG_READINGS, instance_devices
from gpud.health.sources.gpu_checks import GpuChecks
from gpud.model.dcgm_labels import instance_labels


def collect(gpus: LabelledGpus, checks: GpuChecks) -> Iterator[Family]:
    for name, help_text, kind, attribute in GPU_READINGS:
        family = Family(name, help_text, kind)
        for gpu, labels in gpus:
            add_known(family, labels, getattr(checks.readings.get(gpu.uuid), attribute, None))
            if attribute in MIG_READINGS:
                for dev in instance_devices(gpu):
                    add_known(family, instance_labels(labels, gpu, dev),
                              getattr(checks.mig_memory.get(dev.uuid), attribute, None))
        yield family
    bandwidth = Family("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
                       "NVLink data received and sent over all links, as DCGM rates it (KiB/s / 1000).", "gauge")
    for gpu, labels in gpus:
        add_known(bandwidth, labels, checks.nvlink_bandwidth.get(gpu.uuid))
    yield bandwidth
