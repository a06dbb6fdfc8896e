"""Before an apply changes anything: what it changes on each GPU, and the refusals that leave every
GPU as it is (a layout that does not fit, a lost GPU, processes in the way, a reset that would be
refused, a gpud that is not root)."""

from __future__ import annotations

from dataclasses import replace

from gpud.base.errors import ErrorKind, GpudError
from gpud.base.logs import get_logger
from gpud.gpu_reset import GpuResetter, ResetBlocked
from gpud.mig.desired import GpuDesired
from gpud.mig.dynamic_gpus import SETTING, DynamicGpus
from gpud.mig.layouts import Layout, LayoutError, NodeGpu
from gpud.mig.planner import plan_gpu
from gpud.mig.sync import (changes_mode, doomed_compute_instances, fails_without_root, in_sync, mig_state_of,
                           mode_change_needs_reset, node_gpus, resolve_layout)
from gpud.model.inventory import Inventory
from gpud.model.mig import GpuPlan, PlanError
from gpud.nvml.privileges import refuse_unless_root
from gpud.nvml.reset import compute_pids
from gpud.nvml.session import NvmlSession

log = get_logger("mig")


class ApplyRefused(GpudError):
    """An apply gpud will not start: nothing was touched."""


def plan_layout(layout: Layout, inventory: Inventory, force: bool = False,
                dynamic: DynamicGpus = DynamicGpus()) -> tuple[dict, dict[str, GpuPlan]]:
    """desired per GPU and plans per GPU whose instances change; dynamic MIG GPUs left out. Raises
    ApplyRefused if it cannot apply."""
    try:
        desired = _without_dynamic_gpus(layout, inventory, resolve_layout(layout, inventory), dynamic)
    except LayoutError as exc:
        raise ApplyRefused(ErrorKind.REFUSED, "layout-invalid", str(exc)) from None
    if not desired:  # applying it would change nothing, yet say it succeeded: surely not what was meant
        raise ApplyRefused(ErrorKind.REFUSED, "layout-matches-no-gpu",
                           f"layout '{layout.name}' {layout.no_match_reason(node_gpus(inventory))}")
    plans = {}
    for gpu in inventory.gpus:
        wanted = desired.get(gpu.uuid)
        if wanted is None or in_sync(gpu, wanted):
            continue
        if gpu.lost:
            raise ApplyRefused(ErrorKind.CONFLICT, "gpu-lost",
                               f"GPU {gpu.index} ({gpu.uuid}) is lost; it cannot be changed")
        state = mig_state_of(gpu)
        if not wanted.mig_enabled or not state.mode_enabled:
            state = replace(state, mode_enabled=True, instances=())  # mode changes clear the GPU
        try:
            plans[gpu.uuid] = plan_gpu(state, wanted.devices)
        except PlanError as exc:
            raise ApplyRefused(ErrorKind.REFUSED, "layout-does-not-fit", f"layout '{layout.name}': {exc}",
                               gpu=gpu.index) from None
    if not force:
        _refuse_busy_instances(inventory, desired, plans)
    return desired, plans


def _without_dynamic_gpus(layout: Layout, inventory: Inventory, desired: dict[str, GpuDesired],
                          dynamic: DynamicGpus) -> dict[str, GpuDesired]:
    """Only DRA claims change a dynamic MIG GPU's instances: a layout naming one by index is refused, one
    for all GPUs leaves them out (said in the log, and in /v1/mig's view of each GPU)."""
    chosen = [gpu for gpu in inventory.gpus if gpu.uuid in desired and dynamic.selects(gpu)]
    for gpu in chosen:
        node_gpu = NodeGpu(gpu.index, gpu.pci_device_id, gpu.mig.capable)
        if any(entry.devices is not None and entry.selects(node_gpu) for entry in layout.entries):
            raise ApplyRefused(ErrorKind.CONFLICT, "gpu-is-dynamic",
                               f"layout '{layout.name}' names GPU {gpu.index} ({gpu.uuid}), a dynamic MIG GPU "
                               f"({SETTING}): only DRA claims change its MIG devices; nothing was changed",
                               gpu=gpu.index)
    if chosen:
        left_out = [gpu.index for gpu in chosen]
        if len(chosen) == len(desired):
            raise ApplyRefused(ErrorKind.CONFLICT, "gpu-is-dynamic",
                               f"layout '{layout.name}' selects only dynamic MIG GPUs ({SETTING}: GPUs "
                               f"{', '.join(map(str, left_out))}): only DRA claims change their MIG devices; "
                               "nothing was changed", gpus=left_out)
        log.info("mig_layout_leaves_out_dynamic_gpus", layout=layout.name, gpus=left_out, setting=SETTING)
    return {uuid: wanted for uuid, wanted in desired.items() if uuid not in {gpu.uuid for gpu in chosen}}


def _refuse_busy_instances(inventory: Inventory, desired: dict, plans: dict) -> None:
    busy = []
    for gpu in inventory.gpus:
        wanted = desired.get(gpu.uuid)
        if wanted is None or in_sync(gpu, wanted):
            continue
        doomed = doomed_compute_instances(gpu, wanted, plans.get(gpu.uuid))
        busy += [{"gpu": gpu.index, "uuid": ci.uuid, "gi_id": gi.gi_id, "ci_id": ci.ci_id, "pids": list(ci.pids)}
                 for gi in gpu.mig.instances for ci in gi.compute_instances
                 if (gi.gi_id, ci.ci_id) in doomed and ci.pids]
    if busy:
        where = "; ".join(f"GPU {b['gpu']} instance {b['uuid']} (GI {b['gi_id']}, CI {b['ci_id']}) runs PIDs "
                          f"{', '.join(map(str, b['pids']))}" for b in busy)
        raise ApplyRefused(ErrorKind.CONFLICT, "instances-in-use",
                           f"refusing to destroy MIG devices with running processes: "
                           f"{where}; stop them or apply with force", busy=busy)


async def refuse_busy_gpus(session: NvmlSession, layout: Layout, inventory: Inventory,
                           desired: dict[str, GpuDesired]) -> None:
    """Refuses, before any change, a layout that changes the MIG mode of a whole GPU processes
    compute on: the change would fail under them, or wait for them (busy MIG devices are
    _refuse_busy_instances')."""
    busy = []
    for gpu in inventory.gpus:
        if gpu.uuid in desired and gpu.mig.mode != "enabled" and changes_mode(gpu, desired[gpu.uuid]):
            pids = await session.call(compute_pids, gpu.index)
            if pids:
                busy.append({"gpu": gpu.index, "uuid": gpu.uuid, "pids": list(pids)})
    if busy:
        where = "; ".join(f"GPU {b['gpu']} ({b['uuid']}) runs PIDs {', '.join(map(str, b['pids']))}" for b in busy)
        raise ApplyRefused(ErrorKind.CONFLICT, "gpu-in-use",
                           f"layout '{layout.name}' changes the MIG mode of GPUs with running "
                           f"processes: {where}. Nothing was changed; stop them or apply "
                           "with force", busy=busy)


async def refuse_blocked_reset(resetter: GpuResetter, layout: Layout, inventory: Inventory,
                               desired: dict[str, GpuDesired], force: bool) -> None:
    """Refuses, before any change, a layout whose MIG mode change needs a GPU reset that would be
    refused: the GPU would be left half-changed, its mode pending until someone frees it."""
    needing = [g.index for g in inventory.gpus if g.uuid in desired and mode_change_needs_reset(g, desired[g.uuid])]
    if not needing:
        return
    group, blockers = await resetter.preflight(needing, inventory, force=force)
    if blockers:
        refused = ResetBlocked(blockers, tuple(g.index for g in group), tuple(needing))
        raise ApplyRefused(ErrorKind.CONFLICT, "reset-blocked",
                           f"layout '{layout.name}' changes the MIG mode of Ampere GPUs, "
                           f"which may take a GPU reset, and {refused}. Nothing was "
                           "changed; free the GPU and apply again, or set "
                           "mig.allow_gpu_reset: false to leave the reset to you",
                           blockers=[b.as_dict() for b in blockers], reset_gpus=list(refused.group))


def refuse_without_root(layout: Layout, plans: dict[str, GpuPlan]) -> None:
    """Refuses, before any change and after what the operator must free either way (busy GPUs, a blocked
    reset), a layout the driver would refuse GPU by GPU: gpud is not root (nvml.h, nvmlDeviceSetMigMode:
    "Requires root user"). Nothing is saved, so no later start retries it."""
    if plans:
        refuse_unless_root("mig", f"layout '{layout.name}' {fails_without_root(p.index for p in plans.values())}. "
                                  "Nothing was changed, and the layout is not kept as the desired one")


def converging_needs_root(layout: str | None, inventory: Inventory, desired: dict[str, GpuDesired]) -> GpudError | None:
    """The refusal to converge the GPUs on a desired layout that a gpud that is not root cannot apply (one an
    earlier gpud saved): it is withdrawn rather than retried, and failed, at every start. None when root."""
    changing = [g.index for g in inventory.gpus if g.uuid in desired and not in_sync(g, desired[g.uuid])]
    try:
        refuse_unless_root("mig", f"the desired layout '{layout}' {fails_without_root(changing)}: it is withdrawn, "
                                  "nothing was changed")
    except GpudError as exc:
        return exc
    return None
