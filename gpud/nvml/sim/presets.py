"""Named machine presets and custom "MODEL:COUNT,..." specs."""

from __future__ import annotations

import re
from typing import NamedTuple

from .models import GpuModel, catalog
from .topology import Fabric

MAX_GPUS = 64


class PresetError(ValueError):
    """A preset name or custom spec that cannot be used."""


class Preset(NamedTuple):
    spec: str
    description: str
    fabric: Fabric | None = None  # how NVLink connects the GPUs; None: as each model's default
    # The NUMA node of each GPU's PCI device, in index order, as the board's firmware reports it
    # (sysfs numa_node); None where no capture of the board says: -1, as a kernel without the
    # firmware's proximity information reports.
    numa_nodes: tuple[int, ...] | None = None


# A DGX A100 (two AMD EPYC 7742 in NPS4: 8 NUMA nodes) puts its GPU pairs on nodes 3, 1, 7 and 5:
# `nvidia-smi topo -m` of a DGX A100 40GB, NUMA Affinity column (NVIDIA/nccl issue #1505,
# https://github.com/NVIDIA/nccl/issues/1505): GPU0-1 3, GPU2-3 1, GPU4-5 7, GPU6-7 5.
DGX_A100_NUMA_NODES = (3, 3, 1, 1, 7, 7, 5, 5)


PRESETS: dict[str, Preset] = {
    "dgx-a100": Preset("A100-SXM4-40GB:8", "NVIDIA DGX A100: 8x A100-SXM4-40GB", numa_nodes=DGX_A100_NUMA_NODES),
    "hgx-a100-4gpu": Preset(
        "A100-SXM4-40GB:4", "HGX A100 4-GPU: 4x A100-SXM4-40GB, NVLink GPU to GPU, no NVSwitch", Fabric.DIRECT
    ),
    "dgx-a100-80gb": Preset("A100-SXM4-80GB:8", "NVIDIA DGX A100 640GB: 8x A100-SXM4-80GB"),
    "hgx-h100": Preset("H100-SXM5-80GB:8", "HGX H100 8-GPU: 8x H100 80GB HBM3"),
    "hgx-h200": Preset("H200-SXM5-141GB:8", "HGX H200 8-GPU: 8x H200 141GB"),
    "a30": Preset("A30:4", "Server with 4x A30 24GB"),
    "t4": Preset("T4:1", "Server with 1x T4 16GB (no MIG)"),
    "rtx-2080ti": Preset("RTX-2080-TI:1", "Workstation with 1x GeForce RTX 2080 Ti (no MIG, no ECC)"),
}

_ENTRY = re.compile(r"^\s*([^:\s]+)\s*:\s*(\S+)\s*$")


def parse_preset(spec: str) -> list[GpuModel]:
    """The GPUs of a preset name or custom spec, in index order."""
    models = catalog().models
    return [models[key] for key, count in _entries(spec) for _ in range(count)]


def preset_fabric(spec: str) -> Fabric | None:
    """The NVLink fabric a named preset sets; custom specs use each model's own."""
    name = _preset_name(spec)
    return PRESETS[name].fabric if name else None


def preset_numa_nodes(spec: str) -> tuple[int, ...] | None:
    """The NUMA node of each GPU of a named preset; None where no source says (custom specs too)."""
    name = _preset_name(spec)
    return PRESETS[name].numa_nodes if name else None


def canonical_preset(spec: str) -> str:
    """One spelling per preset: the lower-case name, or the spec with canonical model keys."""
    name = _preset_name(spec)
    if name is not None:
        return name
    return ",".join(f"{key}:{count}" for key, count in _entries(spec))


def _preset_name(spec: str) -> str | None:
    name = spec.strip().lower() if isinstance(spec, str) else None
    return name if name in PRESETS else None


def _entries(spec: str) -> list[tuple[str, int]]:
    if not isinstance(spec, str):
        raise _error(spec, "a preset must be a string")
    name = _preset_name(spec)
    entries = [_entry(spec, item) for item in (PRESETS[name].spec if name else spec).split(",")]
    if sum(count for _, count in entries) > MAX_GPUS:
        raise _error(spec, f"more than {MAX_GPUS} GPUs")
    return entries


def _entry(spec: str, item: str) -> tuple[str, int]:
    match = _ENTRY.match(item)
    if match is None:
        raise _error(spec, f"{item.strip()!r} is not MODEL:COUNT")
    key_text, count_text = match.groups()
    keys = {key.lower(): key for key in catalog().models}
    key = keys.get(key_text.lower())
    if key is None:
        raise _error(spec, f"unknown GPU model {key_text!r}")
    if not re.fullmatch("[0-9]+", count_text) or int(count_text) == 0:
        raise _error(spec, f"count {count_text!r} for {key} is not a positive integer")
    return key, int(count_text)


def _error(spec: object, reason: str) -> PresetError:
    presets = ", ".join(PRESETS)
    keys = ", ".join(catalog().models)
    return PresetError(
        f"invalid GPU preset {spec!r}: {reason}. Valid presets: {presets}; "
        f"or a custom spec MODEL:COUNT[,MODEL:COUNT...] with MODEL one of: {keys} (case-insensitive)"
    )
