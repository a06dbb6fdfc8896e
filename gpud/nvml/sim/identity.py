"""Deterministic identities: UUIDs, serial numbers and PCI bus ids, stable across restarts."""

from __future__ import annotations

import uuid

# Fixed namespace for every simulated UUID; the value itself is arbitrary.
_NAMESPACE = uuid.UUID("5a1d0c3e-6d5b-4c1e-9f0b-2f6e8c1a7d42")

# Bus numbers of the eight GPUs in a DGX A100, in NVML index order.
_DGX_BUSES = (0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD)


def gpu_uuid(preset: str, index: int, model_key: str) -> str:
    return "GPU-" + str(uuid.uuid5(_NAMESPACE, f"{preset}/{index}/{model_key}"))


def mig_uuid(parent_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> str:
    """Like the driver's: a version-5 UUID of the place, so re-creating it gives the same UUID
    (NVIDIA/open-gpu-kernel-modules src/nvidia/src/kernel/gpu/gpu_uuid.c)."""
    return "MIG-" + str(uuid.uuid5(_NAMESPACE, f"{parent_uuid}/{gpu_instance_id}/{compute_instance_id}"))


def serial_number(gpu_uuid_text: str) -> str:
    """A 13-digit board serial like "1562720017390"."""
    return "1" + f"{uuid.UUID(gpu_uuid_text[4:]).int % 10**12:012d}"


def pci_buses(count: int) -> list[int]:
    return list(_DGX_BUSES) if count == len(_DGX_BUSES) else list(range(1, count + 1))


def pci_bus_id(bus: int) -> str:
    """NVML's busId format: domain:bus:device.function, upper-case hex."""
    return f"{0:08X}:{bus:02X}:00.0"


def pci_bus_id_legacy(bus: int) -> str:
    return f"{0:04X}:{bus:02X}:00.0"
