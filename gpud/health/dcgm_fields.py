"""What /metrics says of the readings, with dcgm-exporter's names, units and types (its default
counters, etc/default-counters.csv; docs/metrics.md), and which devices it says it of."""

from __future__ import annotations

from gpud.model.inventory import Gpu, MigDevice
from gpud.nvml.health import FbMemory

# (metric, help, type, reading attribute)
GPU_READINGS = (
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock (MHz).", "gauge", "sm_clock_mhz"),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock (MHz).", "gauge", "mem_clock_mhz"),
    ("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (C).", "gauge", "memory_temp_c"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (C).", "gauge", "temperature_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (W).", "gauge", "power_w"),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Energy used since the driver loaded (mJ).", "counter", "energy_mj"),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "PCIe replays.", "counter", "pcie_replays"),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilisation (%).", "gauge", "gpu_util"),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilisation (%).", "gauge", "mem_copy_util"),
    ("DCGM_FI_DEV_ENC_UTIL", "Encoder utilisation (%).", "gauge", "enc_util"),
    ("DCGM_FI_DEV_DEC_UTIL", "Decoder utilisation (%).", "gauge", "dec_util"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (MiB).", "gauge", "fb_free_mib"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (MiB).", "gauge", "fb_used_mib"),
    ("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory the driver reserves (MiB).", "gauge", "fb_reserved_mib"),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Single-bit ECC errors since the last reset.", "counter", "ecc_sbe_volatile"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Double-bit ECC errors since the last reset.", "counter", "ecc_dbe_volatile"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Rows remapped for uncorrectable errors.", "counter",
     "remapped_uncorrectable"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Rows remapped for correctable errors.", "counter",
     "remapped_correctable"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether row remapping has failed.", "gauge", "remap_failed"),
)
# The readings a MIG device has of its own: its GPU instance's memory (FbMemory's attributes).
MIG_READINGS = frozenset(FbMemory.__dataclass_fields__)


def instance_devices(gpu: Gpu) -> list[MigDevice]:
    """One MIG device per GPU instance, its first compute instance's: dcgm-exporter reports GPU instances,
    and every MIG device of an instance sees the instance's memory."""
    first: dict[int, MigDevice] = {}
    for dev in sorted(gpu.mig.devices, key=lambda dev: (dev.gi_id, dev.ci_id)):
        first.setdefault(dev.gi_id, dev)
    return list(first.values())
