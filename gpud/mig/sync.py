"""What a layout wants of each GPU, and whether a GPU has it: pure, nothing is read or changed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from gpud.mig.desired import GpuDesired
from gpud.mig.layouts import Layout, LayoutEntry, NodeGpu
from gpud.model.inventory import Gpu, Inventory
from gpud.model.mig import GpuInstanceState, GpuMigState, GpuPlan
from gpud.nvml.privileges import not_root_because, running_as_root


def root_needed(plans: dict[str, GpuPlan]) -> str | None:
    """Why applying these plans will fail for lack of privilege, said before anything is tried;
    None when nothing changes or gpud runs as root."""
    if not plans or running_as_root():
        return None
    return f"{not_root_because('mig')}: applying it {fails_without_root(plan.index for plan in plans.values())}; " \
           "run gpud as root"


def fails_without_root(indexes: Iterable[int]) -> str:
    """What the driver would answer gpud's MIG changes of these GPUs, gpud not being root."""
    return f"would change GPU {', '.join(map(str, sorted(indexes)))} and fail with Insufficient Permissions"


def mig_state_of(gpu: Gpu) -> GpuMigState:
    return GpuMigState(index=gpu.index, uuid=gpu.uuid, pci_device_id=gpu.pci_device_id, capable=gpu.mig.capable,
                       mode_enabled=gpu.mig.mode == "enabled", capabilities=gpu.mig.capabilities,
                       instances=gpu.mig.instances)


def actual_of(gpu: Gpu) -> dict:
    return {"mig_enabled": gpu.mig.mode == "enabled",
            "devices": dict(sorted(Counter(d.profile for d in gpu.mig.devices).items()))}


def in_sync(gpu: Gpu, desired: GpuDesired) -> bool:
    """Mode, pending mode and device counts as desired, and no GPU instance left without a compute instance."""
    leftovers = any(not gi.compute_instances for gi in gpu.mig.instances)
    pending_ok = gpu.mig.pending_mode == gpu.mig.mode
    return actual_of(gpu) == desired.as_dict() and not leftovers and pending_ok


def changes_mode(gpu: Gpu, desired: GpuDesired) -> bool:
    """Whether applying desired sets the GPU's MIG mode (or takes back a pending one)."""
    wanted = "enabled" if desired.mig_enabled else "disabled"
    return gpu.mig.capable and (gpu.mig.mode != wanted or gpu.mig.pending_mode != wanted)


def mode_change_needs_reset(gpu: Gpu, desired: GpuDesired) -> bool:
    """Whether applying desired changes the GPU's MIG mode on a GPU that needs a reset for it.

    Ampere GPUs (A100, A30) apply a MIG mode change at a GPU reset; Hopper and later switch at
    once (NVIDIA MIG user guide, "Enable MIG Mode":
    https://docs.nvidia.com/datacenter/tesla/mig-user-guide/). mig-parted tells them apart by
    compute capability below 9.0 (NVIDIA/mig-parted deployments/systemd/utils.sh).
    """
    wanted = "enabled" if desired.mig_enabled else "disabled"
    return gpu.mig.capable and gpu.mig.mode != wanted and resets_to_change_mode(gpu)


def resets_to_change_mode(gpu: Gpu) -> bool:
    """Whether the GPU applies a MIG mode change at a GPU reset (Ampere: compute capability below 9)."""
    try:
        return int(gpu.cuda_compute_capability.split(".")[0]) < 9
    except ValueError:
        return True  # unknown: assume the stricter older GPU


def resolve_layout(layout: Layout, inventory: Inventory) -> dict[str, GpuDesired]:
    """GPU UUID -> what the layout wants of it; GPUs the layout does not select are absent (left alone)."""
    desired = {}
    for gpu in inventory.gpus:
        entry: LayoutEntry | None = layout.for_gpu(gpu.index, gpu.pci_device_id, gpu.mig.capable)
        if entry is not None:
            desired[gpu.uuid] = GpuDesired(entry.mig_enabled, dict(entry.mig_devices) if entry.mig_enabled else {})
    return desired


def node_gpus(inventory: Inventory) -> list[NodeGpu]:
    """The node's GPUs as a layout's entries select them."""
    return [NodeGpu(gpu.index, gpu.pci_device_id, gpu.mig.capable) for gpu in inventory.gpus]


def all_cis(instances: tuple[GpuInstanceState, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((gi.gi_id, ci.ci_id) for gi in instances for ci in gi.compute_instances)


def doomed_compute_instances(gpu: Gpu, desired: GpuDesired, plan: GpuPlan | None) -> set[tuple[int, int]]:
    mode_change = (gpu.mig.mode == "enabled") != desired.mig_enabled or gpu.mig.mode != "enabled"
    if mode_change:
        return set(all_cis(gpu.mig.instances))
    return set(plan.destroy_cis) if plan else set()
