"""What NVML tells about a GPU reset: how NVLink joins the GPUs (which decides the GPUs that must be
reset together) and the compute processes that would block it. The reads run on the NVML thread.

The rule is nvidia-smi(1), -r/--gpu-reset (docs.nvidia.com/deploy/nvidia-smi): GPUs with NVLink
connections to a GPU being reset must be reset in the same command when they are older than
Ampere, or, on an NVSwitch system, when Fabric Manager is not running (Ampere needs it for a
reset of one GPU; from Hopper on the dependency is gone). Ampere and later GPUs on direct
GPU-to-GPU NVLink are reset one at a time. When a GPU cannot be reset on its own, no compute
process may run on any GPU of the system. (NVIDIA's mig-parted resets every GPU in one command,
cmd/nvidia-mig-parted/apply/mode.go, because GPUs "connected by an NVLINK must be reset together or
else the reset fails": NVIDIA/mig-parted commit 362e7aa6 of 2021. The manual's tables are the later
and finer word.)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from gpud.model.inventory import normal_bus_id
from gpud.nvml.reader import active_nvlinks



@dataclass(frozen=True)
class NvlinkTopology:
    direct: Mapping[int, frozenset[int]]  # GPU -> GPUs it reaches over an active GPU-to-GPU link
    switched: frozenset[int]  # GPUs with an active link to an NVSwitch
    pre_ampere: frozenset[int]  # their NVLink peers are always reset with them
    needs_fabric_manager: frozenset[int]  # Ampere: reset alone on NVSwitches only while Fabric Manager runs

    def company(self, index: int, fabric_manager_running: bool) -> frozenset[int]:
        """The GPUs that must be in the same reset command as this one."""
        found = {peer for peer in self.direct.get(index, ()) if {index, peer} & self.pre_ampere}
        if index in self.switched and (index in self.pre_ampere or
                                       (index in self.needs_fabric_manager and not fabric_manager_running)):
            found |= self.switched
        return frozenset(found - {index})

    def group(self, targets: Collection[int], fabric_manager_running: bool) -> frozenset[int]:
        """The targets and, transitively, the GPUs each GPU in the command brings with it."""
        group, todo = set(), list(targets)
        while todo:
            index = todo.pop()
            if index not in group:
                group.add(index)
                todo.extend(self.company(index, fabric_manager_running))
        return frozenset(group)

    def individually(self, group: Collection[int], fabric_manager_running: bool) -> bool:
        """Whether every GPU of the group could be reset on its own: if not, compute processes on
        any GPU of the system block the reset (nvidia-smi(1))."""
        return not any(self.company(index, fabric_manager_running) for index in group)

    def asks_fabric_manager(self) -> bool:
        return bool(self.switched & self.needs_fabric_manager)


def read_topology(nvml: Any, gpus: Mapping[int, tuple[str, str]]) -> NvlinkTopology:
    """gpus: index -> (PCI bus id, architecture name) as gpud last knew them. A lost GPU cannot be
    asked, but its peers still name it by bus id, and its architecture is the one last read."""
    index_of = {normal_bus_id(bus_id): index for index, (bus_id, _) in gpus.items()}
    direct: dict[int, set[int]] = {index: set() for index in gpus}
    switched, generations = set(), {}
    for index, (_bus_id, architecture) in gpus.items():
        handle = _handle(nvml, index)
        generations[index] = _generation(nvml, handle, architecture)
        for remote_type, remote_bus_id in active_nvlinks(nvml, handle):
            if remote_type == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                switched.add(index)
            other = index_of.get(normal_bus_id(remote_bus_id)) if remote_type == nvml.NVML_NVLINK_DEVICE_TYPE_GPU \
                else None
            if other is not None and other != index:
                direct[index].add(other)
                direct.setdefault(other, set()).add(index)  # seen from the other end too (a lost peer)
    ampere, hopper = nvml.NVML_DEVICE_ARCH_AMPERE, nvml.NVML_DEVICE_ARCH_HOPPER
    return NvlinkTopology(
        direct={index: frozenset(found) for index, found in direct.items()}, switched=frozenset(switched),
        pre_ampere=frozenset(i for i, generation in generations.items() if generation < ampere),
        needs_fabric_manager=frozenset(i for i, generation in generations.items() if ampere <= generation < hopper))


def _handle(nvml: Any, index: int) -> Any:
    try:
        return nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError:
        return None  # lost or unreadable: its peers report the links from their side


def _generation(nvml: Any, handle: Any, architecture: str) -> int:
    """NVML's architecture number (NVML_DEVICE_ARCH_*, in generation order up to Blackwell); from
    the last known name for a GPU that cannot be asked; 0 (older than any: the strictest rule)
    when neither tells."""
    try:
        if handle is not None:
            return nvml.nvmlDeviceGetArchitecture(handle)
    except nvml.NVMLError:
        pass
    return getattr(nvml, f"NVML_DEVICE_ARCH_{architecture.upper()}", 0)


def compute_pids(nvml: Any, index: int) -> tuple[int, ...] | None:
    """The compute processes on a GPU (with MIG on, the parent's handle answers for all its MIG
    devices: nvml.h, nvmlDeviceGetComputeRunningProcesses). None when the GPU cannot be asked."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        return tuple(sorted({p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}))
    except nvml.NVMLError:
        return None
