"""DCGM's profiling fields (DCGM_FI_PROF_*) from GPM, per GPU and per GPU instance, under dcgm-exporter's
names and types (its etc/default-counters.csv and etc/dcp-metrics-included.csv: gauges; ratios 0-1 and
bytes per second) and with its labels. A GPU without GPM has no series."""

from __future__ import annotations

from typing import Iterator, Mapping

from gpud.base.samples import Family
from gpud.health.collectors import LabelledGpus, add_known
from gpud.health.dcgm_fields import instance_devices
from gpud.model.dcgm_labels import instance_labels
from gpud.nvml.gpm import Profile

# (metric, help, Profile attribute)
PROFILING_FIELDS = (
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active (GPM).", "gr_engine_active"),
    ("DCGM_FI_PROF_SM_ACTIVE", "Ratio of cycles an SM has at least one warp assigned (GPM).", "sm_active"),
    ("DCGM_FI_PROF_SM_OCCUPANCY", "Ratio of warps resident on an SM to its maximum (GPM).", "sm_occupancy"),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles any tensor pipe is active (GPM).", "pipe_tensor_active"),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "Ratio of cycles the memory interface sends or receives data (GPM).",
     "dram_active"),
    ("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "Ratio of cycles the FP64 pipe is active (GPM).", "pipe_fp64_active"),
    ("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "Ratio of cycles the FP32 pipe is active (GPM).", "pipe_fp32_active"),
    ("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "Ratio of cycles the FP16 pipe is active (GPM).", "pipe_fp16_active"),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "PCIe data sent by the GPU, headers included (bytes per second, GPM).",
     "pcie_tx_bytes"),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "PCIe data received by the GPU, headers included (bytes per second, GPM).",
     "pcie_rx_bytes"),
    ("DCGM_FI_PROF_NVLINK_TX_BYTES", "NVLink data sent over all links, headers included (bytes per second, GPM).",
     "nvlink_tx_bytes"),
    ("DCGM_FI_PROF_NVLINK_RX_BYTES", "NVLink data received over all links, headers included (bytes per second, "
     "GPM).", "nvlink_rx_bytes"),
)


def collect(gpus: LabelledGpus, profiles: Mapping[str, Profile]) -> Iterator[Family]:
    """Only families with samples: on a node without GPM nothing at all."""
    for name, help_text, attribute in PROFILING_FIELDS:
        family = Family(name, help_text, "gauge")
        for gpu, labels in gpus:
            add_known(family, labels, getattr(profiles.get(gpu.uuid), attribute, None))
            for dev in instance_devices(gpu):
                add_known(family, instance_labels(labels, gpu, dev), getattr(profiles.get(dev.uuid), attribute, None))
        if family.samples:
            yield family
