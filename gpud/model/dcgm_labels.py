"""dcgm-exporter's labels of GPUs and GPU instances, for every part of gpud that writes series about
them: dashboards written for the exporter join and filter on these exact names and values."""

from __future__ import annotations

import math
import socket

from gpud.model.inventory import Gpu, MigDevice

# The hostname label dcgm-exporter puts on its samples, and gpud on its own series: dashboards written for
# the exporter filter on it.
HOSTNAME = socket.gethostname()


def gpu_labels(gpu: Gpu, driver_version: str) -> dict[str, str]:
    """dcgm-exporter's labels of a GPU, in its order (internal/pkg/rendermetrics/render_metrics.go;
    `hostname` lower-case since NVIDIA/dcgm-exporter#655), and its default label counter, the driver."""
    return {"gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": gpu.pci_bus_id, "device": f"nvidia{gpu.index}",
            "modelName": gpu.name, "hostname": HOSTNAME, "DCGM_FI_DRIVER_VERSION": driver_version}


def instance_labels(labels: dict[str, str], gpu: Gpu, dev: MigDevice) -> dict[str, str]:
    """A GPU instance's labels: its GPU's, with GPU_I_PROFILE and GPU_I_ID after modelName."""
    position = list(labels).index("modelName") + 1
    items = list(labels.items())
    return dict(items[:position] + [("GPU_I_PROFILE", instance_profile(gpu, dev)), ("GPU_I_ID", str(dev.gi_id))]
                + items[position:])


def instance_profile(gpu: Gpu, dev: MigDevice) -> str:
    """The GPU instance's profile as DCGM names it, and so dcgm-exporter's GPU_I_PROFILE: "<slices>g.<memory
    in GiB, rounded up>gb" (DcgmCacheManager.cpp names GPU-instance profiles so; the exporter reads the
    name back as the instance's DCGM_FI_DEV_NAME, internal/pkg/deviceinfo/device_info.go). A "+me" profile
    has no "+me" there. Without the GPU's profile table, NVML's name of the device."""
    capabilities = gpu.mig.capabilities
    profile = capabilities.gi_profile_by_id(dev.gi_profile_id) if capabilities else None
    if profile is None:
        return dev.profile
    return f"{profile.slices}g.{math.ceil(profile.memory_mib / 1024)}gb"
