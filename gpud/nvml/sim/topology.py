"""NVLink wiring of a simulated node: where each link goes, and which GPUs are NVLink peers.

What NVML reports per link: nvmlDeviceGetNvLinkRemoteDeviceType (NVML_NVLINK_DEVICE_TYPE_GPU or
_SWITCH) and nvmlDeviceGetNvLinkRemotePciInfo (the bus id at the far end). Fabrics:
* switch: SXM boards on an NVSwitch baseboard; each link goes to one of the NVSwitch chips.
* direct: GPU-to-GPU links without NVSwitch (HGX A100 4-GPU); the links are shared out evenly over
  the other GPUs. No public per-link map was found: which link reaches which peer is plausible only.
* bridge: PCIe boards without an NVLink bridge; every link exists but is inactive and reaches nothing
  (reference README correction).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import pynvml

from .models import GpuModel

# NVSwitch chips sit on buses above every simulated GPU bus (those end at 0xBD); plausible values.
_FIRST_SWITCH_BUS = 0xC4


class Fabric(str, enum.Enum):
    SWITCH = "switch"
    DIRECT = "direct"
    BRIDGE = "bridge"


class Link(NamedTuple):
    remote_type: int  # NVML_NVLINK_DEVICE_TYPE_*
    remote_bus: int  # PCI bus number at the far end (domain 0, device 0, function 0)
    peer: int | None  # index of the GPU at the far end; None for a switch


def wire(models: Sequence[GpuModel], buses: Sequence[int], fabric: Fabric | None) -> list[tuple[Link, ...]]:
    """The links of every GPU: fabric None lets each model's own fabric decide."""
    return [
        _links(index, models, buses, Fabric(fabric or model.nvlink_fabric)) if model.nvlinks else ()
        for index, model in enumerate(models)
    ]


def _links(index: int, models: Sequence[GpuModel], buses: Sequence[int], fabric: Fabric) -> tuple[Link, ...]:
    count = models[index].nvlinks
    if fabric is Fabric.SWITCH:  # consecutive links share a switch (2 per switch on a DGX A100)
        switches = models[index].nvlink_switches
        return tuple(
            Link(pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, _FIRST_SWITCH_BUS + link * switches // count, None)
            for link in range(count)
        )
    peers = [other for other in range(len(models)) if other != index]
    if fabric is Fabric.BRIDGE or not peers:
        return ()
    shared_out = (peers[link * len(peers) // count] for link in range(count))
    return tuple(Link(pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, buses[peer], peer) for peer in shared_out)


def reaches_switches(links: Sequence[Link]) -> bool:
    return any(link.peer is None for link in links)


def on_switches(links: Sequence[tuple[Link, ...]]) -> set[int]:
    """The GPUs whose links go to NVSwitches: on such a system each is every other's NVLink peer."""
    return {index for index, own in enumerate(links) if reaches_switches(own)}
