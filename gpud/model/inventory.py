"""The node as gpud last read it: an immutable snapshot of its GPUs and MIG devices.

Only gpud.nvml reads NVML; these types hold what it read. A snapshot is never changed after it is
made: a refresh (gpud.inventory) builds a new one and swaps it in, so readers never see half an update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from gpud.model.mig import GpuInstanceState, MigCapabilities, Placement


@dataclass(frozen=True)
class MigEngines:
    """The engines a MIG device's compute instance shares with its GPU instance (nvmlDeviceGetAttributes)."""

    copy: int = 0
    decoder: int = 0
    encoder: int = 0
    jpeg: int = 0
    ofa: int = 0


@dataclass(frozen=True)
class MigDevice:
    uuid: str
    index: int  # the MIG device index NVML enumerates it at on its parent
    profile: str  # "1g.5gb", "1c.3g.20gb", "1g.5gb+me"
    gi_id: int
    ci_id: int
    gi_profile_id: int
    ci_profile_id: int
    placement: Placement
    memory_total_mib: int
    sm_count: int
    pids: tuple[int, ...] = ()  # compute processes running on it
    # Its GPU and compute instances' sizes in compute slices, and its engines (nvmlDeviceGetAttributes),
    # for GPU feature discovery's per-profile labels.
    gi_slices: int = 0
    ci_slices: int = 0
    engines: MigEngines = MigEngines()


@dataclass(frozen=True)
class MigInfo:
    capable: bool
    mode: str | None  # "enabled" | "disabled"; None when not capable
    pending_mode: str | None
    devices: tuple[MigDevice, ...] = ()
    # Where the profile table comes from: "nvml" (read now), "last-read" (the driver does not answer
    # it under this MIG mode: the table gpud read before on this GPU), "shipped" (gpud's own table
    # for this GPU model), None (no table: not capable, or nothing to go by).
    profiles_source: str | None = None
    # For the MIG planner, not the GPU views: the GPU's profile table and its GPU/compute-instance tree.
    capabilities: MigCapabilities | None = field(default=None, compare=False)
    instances: tuple[GpuInstanceState, ...] = ()


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    pci_device_id: str  # "0x20B010DE"
    memory_total_mib: int
    compute_mode: str  # "default" | "exclusive_process" | "prohibited"
    architecture: str
    cuda_compute_capability: str
    serial: str | None
    mig: MigInfo
    minor_number: int | None = None  # /dev/nvidia<minor>; None where NVML does not tell
    numa_node: int | None = None  # its PCI device's NUMA node (sysfs numa_node); None where unknown (-1)
    # The GPUs it reaches over active NVLink, directly or through NVSwitches, by index.
    nvlink_peers: tuple[int, ...] = ()
    # The CPUs ideal for it (nvmlDeviceGetCpuAffinity), sorted OS CPU ids, as Slurm's NVML autodetection
    # reads them for gres.conf Cores=; () where NVML does not answer; a lost GPU keeps its last answer.
    cpu_affinity: tuple[int, ...] = ()
    # (peer GPU index, its active NVLinks whose far end is that GPU), direct GPU-to-GPU links only (links
    # to NVSwitches count nothing), sorted by peer: Slurm's gres.conf Links=.
    nvlink_counts: tuple[tuple[int, int], ...] = ()
    lost: bool = False
    error: str | None = None  # what went wrong reading this GPU, if anything
    # Fields NVML refused to this user (NO_PERMISSION), each "field: why"; the rest is read.
    unreadable: tuple[str, ...] = ()
    # Memory the driver keeps for itself (memory info v2 `reserved`, rounded up to whole MiB): no
    # process can allocate it. None where the driver has no memory info v2.
    memory_reserved_mib: int | None = None
    # nvmlDeviceGetBrand as go-nvlib's GetBrandAsString words it ("Nvidia", "GeForce", "Tesla", ...: what
    # NVIDIA's DRA driver publishes as `brand`); None where NVML does not answer or answers a brand go-nvlib
    # has no word for. A lost GPU keeps the brand it was last read with.
    brand: str | None = None


@dataclass(frozen=True)
class Inventory:
    driver_version: str
    cuda_version: str
    nvml_version: str
    gpus: tuple[Gpu, ...]
    read_at: float = field(default_factory=time.time)  # wall clock, for people

    def find_gpu(self, ident: str) -> Gpu | None:
        """A GPU by index, GPU UUID or PCI bus id (any form), or the GPU a MIG device UUID lives on."""
        bus_id = normal_bus_id(ident) if ":" in ident else None
        for gpu in self.gpus:
            if ident in (str(gpu.index), gpu.uuid) or (bus_id and bus_id == normal_bus_id(gpu.pci_bus_id)) or \
                    any(dev.uuid == ident for dev in gpu.mig.devices):
                return gpu
        return None


def normal_bus_id(bus_id: str) -> str | None:
    """'0000:07:00.0', '00000000:07:00.0' and '07:00.0' name the same device; None if not a bus id."""
    parts = bus_id.lower().split(":")
    if len(parts) not in (2, 3):
        return None
    try:
        domain = int(parts[0], 16) if len(parts) == 3 else 0
    except ValueError:
        return None
    return f"{domain:08x}:{':'.join(parts[-2:])}"


def sysfs_pci_device(sysfs: Path, bus_id: str) -> Path | None:
    """The kernel's directory of a PCI device, <sysfs>/bus/pci/devices/<dddd:bb:dd.f>: sysfs names it with
    a 4-digit domain, NVML with 8. None if bus_id is not a bus id."""
    normal = normal_bus_id(bus_id)
    return None if normal is None else sysfs / "bus" / "pci" / "devices" / normal[4:]


def format_cpulist(cpus: tuple[int, ...] | list[int]) -> str:
    """CPU ids as a Linux cpulist, "0-27,56-83" (the format of sysfs cpulist files, lib/bitmap-str.c
    bitmap_print_to_pagebuf); "" for none."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in ranges)


IDENTITY_FIELDS = ("uuid", "name", "pci_bus_id", "pci_device_id", "memory_total_mib", "architecture",
                   "cuda_compute_capability", "serial", "minor_number", "brand")


UNKNOWN = "unknown"  # each identity field of a GPU NVML has not described since gpud started


def unknown_gpu(index: int, **identity) -> Gpu:
    """A GPU NVML cannot describe now (lost), with whatever identity gpud knew of it."""
    fields = {name: UNKNOWN for name in IDENTITY_FIELDS} | {"memory_total_mib": 0, "serial": None,
                                                              "minor_number": None, "brand": None}
    fields.update(identity)
    return Gpu(index=index, compute_mode="unknown", mig=MigInfo(capable=False, mode=None, pending_mode=None),
               **fields)
