"""Brings the GPUs to the desired MIG layout, crash-safely, one GPU at a time.

The desired layout is persisted before the first NVML change; at start gpud reconciles the GPUs
to it, so a crash at any point of an apply converges on the next start. Per GPU an apply is a
transaction: when a step fails, that GPU is put back to the instances it had, and the other GPUs
are left as they are.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Collection, Iterator

from gpud.errors import GpudError
from gpud.gpu_reset import GpuResetter, ResetBlocked, ResetBusy, ResetOutcome
from gpud.inventory import Gpu, Inventory, InventoryService, MigInfo
from gpud.lifecycle import Component, Tasks
from gpud.logs import get_logger
from gpud.mig.desired import NOTHING, Desired, DesiredStore, GpuDesired
from gpud.mig.hooks import MigHooks
from gpud.mig.layouts import Layout, LayoutEntry, LayoutError, LayoutsFile, NodeGpu
from gpud.mig.model import GpuInstanceState, GpuMigState, GpuPlan, PlanError
from gpud.mig.planner import plan_gpu, plan_restore
from gpud.nvml import mig as nvml_mig
from gpud.nvml.host_tools import ResetFailed
from gpud.nvml.privileges import not_root_because, running_as_root
from gpud.nvml.reset import compute_pids
from gpud.nvml.session import NvmlSession, NvmlUnavailable, describe_error
from gpud.persist import read_json, write_json_atomic
from gpud.samples import HOSTNAME, Family

log = get_logger("mig")
HISTORY_KEPT = 20  # the last applies /v1/mig lists (newest first), kept across restarts


class ApplyRefused(GpudError):
    """An apply gpud will not start: nothing was touched."""


@dataclass
class GpuProgress:
    index: int
    uuid: str
    state: str = "pending"  # pending | applying | done | unchanged | failed | reset-required
    error: str | None = None
    mutations: int = 0


@dataclass
class ApplyStatus:
    layout: str | None = None
    state: str = "success"  # success | pending | applying | failed | reset-required
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    gpus: dict[str, GpuProgress] = field(default_factory=dict)


def root_needed(plans: dict[str, GpuPlan]) -> str | None:
    """Why applying these plans will fail for lack of privilege, said before anything is tried;
    None when nothing changes or gpud runs as root."""
    if not plans or running_as_root():
        return None
    indexes = ", ".join(str(plan.index) for plan in sorted(plans.values(), key=lambda p: p.index))
    return (f"{not_root_because('mig')}: applying it would change GPU {indexes} and fail with "
            "Insufficient Permissions; run gpud as root")


def mig_state_of(gpu: Gpu) -> GpuMigState:
    return GpuMigState(index=gpu.index, uuid=gpu.uuid, pci_device_id=gpu.pci_device_id, capable=gpu.mig.capable,
                       mode_enabled=gpu.mig.mode == "enabled", capabilities=gpu.mig.capabilities, instances=gpu.mig.instances)


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
    return gpu.mig.capable and gpu.mig.mode != wanted and _compute_major(gpu) < 9


def _compute_major(gpu: Gpu) -> int:
    try:
        return int(gpu.cuda_compute_capability.split(".")[0])
    except ValueError:
        return 0  # unknown: assume the stricter older GPU


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


class MigReconciler(Component):
    name = "mig"

    def __init__(self, session: NvmlSession, inventory: InventoryService, state_path: Path, resetter: GpuResetter,
                 *, allow_reset: bool = True, pre_apply: tuple[str, ...] = (), post_apply: tuple[str, ...] = (),
                 hook_timeout_s: float = 300.0, around_gpu_change: tuple | None = None,
                 notify: Callable[[str, dict], object] = lambda kind, data: None,
                 default_layout: str | None = None, layouts: LayoutsFile | None = None):
        self.session = session
        self.inventory = inventory
        self.resetter = resetter
        self.default_layout, self.layouts = default_layout, layouts  # mig.default_layout, mig.layouts_file
        self._store = DesiredStore(state_path)
        self._allow_reset = allow_reset
        self._hooks = MigHooks(pre_apply, post_apply, hook_timeout_s)
        # Called with a GPU's UUID before and after its MIG layout changes (MPS daemons stop and restart).
        self._around_gpu_change = around_gpu_change
        self._notify = notify  # the watch stream
        # What changes the GPUs' MIG state now (an apply, a start-up reconcile or a reset), None when
        # nothing does: claimed and checked with no await between, so two requests never both pass.
        self._running: dict | None = None
        self.status = ApplyStatus()
        self._chosen: Desired = NOTHING
        self.desired: dict[str, GpuDesired] = {}
        self.desired_source: str | None = None  # "api" | "default_layout"
        self._force = False
        self._started = False  # set once gpud has converged (or begun converging) the GPUs at start-up
        self._load_desired()
        self._history_path = state_path.with_name("mig-history.json")
        history, corrupt = read_json(self._history_path, _history_from)
        self.corrupt_files = [corrupt] if corrupt else []
        self.history: list[dict] = history or []  # replaced, never changed in place: a write in progress keeps its list
        self._history_written = asyncio.Lock()

    # -- persisted desired state ------------------------------------------------------------

    def _load_desired(self) -> None:
        self._use(self._store.load())
        if self._chosen.gpus is not None:
            self.status.layout, self.status.state = self._chosen.layout, "pending"

    def _use(self, desired: Desired) -> None:
        self._chosen = desired
        self.desired, self.desired_source, self._force = desired.gpus or {}, desired.source, desired.force

    @property
    def problem(self) -> str | None:
        """Why the persisted desired layout could not be used (a corrupt file), until one is chosen again."""
        return self._store.problem

    def _persist_desired(self, chosen: Desired) -> None:
        self._store.save(chosen, replacing=self._chosen)
        self._use(chosen)

    def _claim(self, operation: dict) -> None:
        if self._running is not None:
            running = self._running
            what = (f"a MIG apply of '{running['layout']}'" if running["operation"] != "reset"
                    else f"a reset of GPUs {', '.join(map(str, running['gpus']))}")
            raise ApplyRefused(409, "apply-in-progress", f"{what} is in progress; nothing was changed, try again "
                                                         "once it is done", running=running)
        self._running = {**operation, "started_at": time.time()}

    # -- planning (pure: nothing is touched) ------------------------------------------------

    def plan(self, layout: Layout, inventory: Inventory, force: bool = False) -> tuple[dict, dict[str, GpuPlan]]:
        """desired per GPU and plans per GPU whose instances change. Raises ApplyRefused if it cannot apply."""
        try:
            desired = resolve_layout(layout, inventory)
        except LayoutError as exc:
            raise ApplyRefused(422, "layout-invalid", str(exc)) from None
        if not desired:  # applying it would change nothing, yet say it succeeded: surely not what was meant
            raise ApplyRefused(422, "layout-matches-no-gpu",
                               f"layout '{layout.name}' {layout.no_match_reason(node_gpus(inventory))}")
        plans = {}
        for gpu in inventory.gpus:
            wanted = desired.get(gpu.uuid)
            if wanted is None or in_sync(gpu, wanted):
                continue
            if gpu.lost:
                raise ApplyRefused(409, "gpu-lost", f"GPU {gpu.index} ({gpu.uuid}) is lost; it cannot be changed")
            state = mig_state_of(gpu)
            if not wanted.mig_enabled or not state.mode_enabled:
                state = replace(state, mode_enabled=True, instances=())  # mode changes clear the GPU
            try:
                plans[gpu.uuid] = plan_gpu(state, wanted.devices)
            except PlanError as exc:
                raise ApplyRefused(422, "layout-does-not-fit", f"layout '{layout.name}': {exc}",
                                   gpu=gpu.index) from None
        if not force:
            self._refuse_busy_instances(inventory, desired, plans)
        return desired, plans

    def _refuse_busy_instances(self, inventory: Inventory, desired: dict, plans: dict) -> None:
        busy = []
        for gpu in inventory.gpus:
            wanted = desired.get(gpu.uuid)
            if wanted is None or in_sync(gpu, wanted):
                continue
            doomed = _doomed_compute_instances(gpu, wanted, plans.get(gpu.uuid))
            busy += [{"gpu": gpu.index, "uuid": ci.uuid, "gi_id": gi.gi_id, "ci_id": ci.ci_id, "pids": list(ci.pids)}
                     for gi in gpu.mig.instances for ci in gi.compute_instances
                     if (gi.gi_id, ci.ci_id) in doomed and ci.pids]
        if busy:
            where = "; ".join(f"GPU {b['gpu']} instance {b['uuid']} (GI {b['gi_id']}, CI {b['ci_id']}) runs PIDs "
                              f"{', '.join(map(str, b['pids']))}" for b in busy)
            raise ApplyRefused(409, "instances-in-use", f"refusing to destroy MIG devices with running processes: "
                                                        f"{where}; stop them or apply with force", busy=busy)

    # -- applying ---------------------------------------------------------------------------

    async def apply(self, layout: Layout, *, force: bool = False, source: str = "api",
                    origin: str | None = None) -> tuple[dict[str, GpuPlan], asyncio.Task]:
        """Plans, persists the desired layout and starts applying it in the background. Returns the
        plans and the apply, whose result is /v1/mig's view as this apply left it. Refused (409)
        while another apply or a reset runs. `origin` says where the layout is defined: the layouts
        file's path, "builtin", or "request" (a file sent with the request)."""
        self._claim({"operation": "apply", "layout": layout.name})
        try:
            inventory = await self.inventory.refresh("mig apply requested")
            if inventory is None:
                raise ApplyRefused(503, "nvml-unavailable", self.session.error or "no inventory yet")
            desired, plans = self.plan(layout, inventory, force)
            await self._refuse_blocked_reset(layout, inventory, desired, force)
            if not force:
                await self._refuse_busy_gpus(layout, inventory, desired)
            self._persist_desired(Desired(layout.name, source, force, desired, origin))
        except BaseException:
            self._running = None
            raise
        self.status = ApplyStatus(layout=layout.name, state="applying", started_at=time.time(),
                                  gpus={g.uuid: GpuProgress(g.index, g.uuid) for g in inventory.gpus
                                        if g.uuid in desired})
        self._task = asyncio.create_task(self._run_claimed())
        return plans, self._task

    async def _refuse_busy_gpus(self, layout: Layout, inventory: Inventory, desired: dict[str, GpuDesired]) -> None:
        """Refuses, before any change, a layout that changes the MIG mode of a whole GPU processes
        compute on: the change would fail under them, or wait for them (busy MIG devices are
        _refuse_busy_instances')."""
        busy = []
        for gpu in inventory.gpus:
            if gpu.uuid in desired and gpu.mig.mode != "enabled" and changes_mode(gpu, desired[gpu.uuid]):
                pids = await self.session.call(compute_pids, gpu.index)
                if pids:
                    busy.append({"gpu": gpu.index, "uuid": gpu.uuid, "pids": list(pids)})
        if busy:
            where = "; ".join(f"GPU {b['gpu']} ({b['uuid']}) runs PIDs {', '.join(map(str, b['pids']))}" for b in busy)
            raise ApplyRefused(409, "gpu-in-use", f"layout '{layout.name}' changes the MIG mode of GPUs with running "
                                                  f"processes: {where}. Nothing was changed; stop them or apply "
                                                  "with force", busy=busy)

    async def _refuse_blocked_reset(self, layout: Layout, inventory: Inventory, desired: dict[str, GpuDesired],
                                    force: bool) -> None:
        """Refuses, before any change, a layout whose MIG mode change needs a GPU reset that would be
        refused: the GPU would be left half-changed, its mode pending until someone frees it."""
        if not self._allow_reset:
            return  # the mode change is left pending for the operator: state reset-required
        needing = [g.index for g in inventory.gpus if g.uuid in desired and mode_change_needs_reset(g, desired[g.uuid])]
        if not needing:
            return
        group, blockers = await self.resetter.preflight(needing, inventory, force=force)
        if blockers:
            refused = ResetBlocked(blockers, tuple(g.index for g in group), tuple(needing))
            raise ApplyRefused(409, "reset-blocked", f"layout '{layout.name}' changes the MIG mode of Ampere GPUs, "
                                                     f"which may take a GPU reset, and {refused}. Nothing was "
                                                     "changed; free the GPU and apply again, or set "
                                                     "mig.allow_gpu_reset: false to leave the reset to you",
                               blockers=[b.as_dict() for b in blockers], reset_gpus=list(refused.group))

    async def reset_gpus(self, indices: list[int], *, force: bool = False,
                         why: str = "asked through the API") -> ResetOutcome:
        """A GPU reset asked for through the API (or by health.auto_reset): the GPUs with their NVLink
        peers, MIG layouts brought back afterwards (a reset destroys every MIG instance)."""
        self._claim({"operation": "reset", "gpus": sorted(indices)})
        try:
            return await self.resetter.reset(indices, why, force=force,
                                             restore=lambda gpus, after: self._restore_after_reset(gpus, after, ()))
        finally:
            self._running = None

    async def reset_gpu(self, index: int, why: str):
        """health.auto_reset's reset of one GPU (and the peers it must be reset with)."""
        return await self.reset_gpus([index], why=why)

    async def wait(self) -> ApplyStatus:
        task = getattr(self, "_task", None)
        if task is not None:
            await asyncio.shield(task)
        return self.status

    async def stop(self) -> None:
        """Abandons an apply in progress (gpud is stopping): the persisted desired layout lets the next
        start finish it, exactly as after a crash."""
        task = getattr(self, "_task", None)
        if task is not None and not task.done():
            log.warning("mig_apply_interrupted", layout=self.status.layout, why="gpud is stopping")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def start_with_gpus(self, tasks: Tasks) -> None:
        await self.converge_at_start(self.default_layout, self.layouts)

    def problems(self) -> list[str]:
        return ([self.problem] if self.problem else []) + [file.message() for file in self.corrupt_files]

    async def converge_at_start(self, default_layout: str | None, layouts: LayoutsFile) -> None:
        """Finishes what a crash interrupted, or applies `default_layout` (mig.default_layout) when it
        is new and no layout was chosen through the API since."""
        if self.problem:
            self._started = True  # an operator's layout may be in the corrupt file: gpud applies none of its own
            self._settle("failed", self.problem)
            return
        try:
            if default_layout and self.desired_source != "api" and self.status.layout != default_layout:
                await self.apply(layouts.layout(default_layout), source="default_layout",
                                 origin=layouts.layouts()[0])
                self._started = True
                await self.wait()
            else:
                self._started = True
                await self.reconcile("startup")
        except GpudError as exc:
            self._started = True
            self._settle("failed", f"mig.default_layout '{default_layout}': {exc}")
            log.error("mig_default_layout_failed", layout=default_layout, error=str(exc))

    async def reconcile(self, reason: str) -> None:
        """Converges the GPUs on the persisted desired layout (after a crash, or at start)."""
        if not self.desired or self._running is not None:
            return
        self._claim({"operation": "reconcile", "layout": self.status.layout})
        try:
            inventory = await self.inventory.refresh(reason)
            synced = inventory is not None and all(in_sync(g, self.desired[g.uuid]) for g in inventory.gpus
                                                   if g.uuid in self.desired)
        except BaseException:
            self._running = None
            raise
        if inventory is None or synced:
            self._running = None
            if synced:
                self._settle("success", self.status.error)
            return
        log.warning("mig_out_of_sync", layout=self.status.layout, reason=reason)
        self.status = ApplyStatus(layout=self.status.layout, state="applying", started_at=time.time(),
                                  gpus={g.uuid: GpuProgress(g.index, g.uuid) for g in inventory.gpus
                                        if g.uuid in self.desired})
        self._task = asyncio.create_task(self._run_claimed())
        await self.wait()

    async def _run_claimed(self) -> dict:
        """Runs the claimed apply; its result is the view it ends with, taken before another can start."""
        try:
            await self._run()
        except Exception as exc:  # never leave the status at "applying"
            log.exception("mig_apply_crashed", error=str(exc))
            self.status.state, self.status.error = "failed", f"internal error: {exc}"
        finally:
            self.status.finished_at = time.time()
            self._add_to_history(self.status)
            self._running = None
        view = self.view(self.inventory.current)
        await self._save_history()
        return view

    def _add_to_history(self, status: ApplyStatus) -> None:
        gpus = [{"index": p.index, "uuid": p.uuid, "state": p.state, "error": p.error} for p in status.gpus.values()]
        entry = {"layout": status.layout, "state": status.state, "error": status.error,
                 "started_at": status.started_at, "finished_at": status.finished_at, "gpus": gpus}
        self.history = [entry, *self.history][:HISTORY_KEPT]

    async def _save_history(self) -> None:
        """Writes the history off the event loop (the write ends with two fsyncs), one write at a time,
        each of the list as it is then: an older list never lands after a newer one."""
        async with self._history_written:
            try:
                await asyncio.to_thread(write_json_atomic, self._history_path, self.history)
            except OSError as exc:
                log.error("mig_history_not_saved", path=str(self._history_path), error=str(exc),
                          consequence="a gpud restart would show the MIG apply history without this apply")

    async def _run(self) -> None:
        inventory = await self.inventory.refresh("mig apply")
        changing = [g for g in inventory.gpus if g.uuid in self.desired and not in_sync(g, self.desired[g.uuid])]
        for gpu in inventory.gpus:
            if gpu.uuid in self.status.gpus and gpu not in changing:
                self.status.gpus[gpu.uuid].state = "unchanged"
        if changing and (failure := await self._hooks.run("pre_apply", self.status.layout,
                                                          [g.index for g in changing])):
            self.status.state, self.status.error = "failed", f"{failure}; the apply is cancelled"
            for progress in self.status.gpus.values():
                if progress.state == "pending":
                    progress.state = "unchanged"
            self._use(self._store.take_back())  # for good: the next start must not resume it
            return
        # As mig-parted does: every mode is set first, then one reset takes them all, so a GPU is
        # never reset again after its instances were made (a reset destroys them).
        awaiting_reset = [gpu for gpu in changing if await self._apply_gpu(gpu, self.desired[gpu.uuid])]
        if awaiting_reset:
            await self._reset_then_finish(awaiting_reset)
        final = await self.inventory.refresh("mig apply finished")
        if changing and (failure := await self._hooks.run("post_apply", self.status.layout,
                                                          [g.index for g in changing])):
            self.status.error = failure
        states = {p.state for p in self.status.gpus.values()}
        errors = [f"GPU {p.index}: {p.error}" for p in self.status.gpus.values() if p.error]
        self._settle("failed" if "failed" in states else "reset-required" if "reset-required" in states
                     else "success", "; ".join(errors) or self.status.error)
        log.info("mig_apply_finished", layout=self.status.layout, state=self.status.state,
                 mutations=sum(p.mutations for p in self.status.gpus.values()),
                 in_sync=all(in_sync(g, self.desired[g.uuid]) for g in final.gpus if g.uuid in self.desired))

    def _settle(self, state: str, error: str | None) -> None:
        """The layout's outcome, said on the watch stream: what follows MIG (NFD's labels, the device
        plugin) learns of it from there, whether an apply or start-up convergence reached it."""
        self.status.state, self.status.error = state, error
        self._notify("mig", {"layout": self.status.layout, "state": state, "error": error})

    async def _apply_gpu(self, gpu: Gpu, desired: GpuDesired) -> bool:
        """Changes one GPU. True when its new MIG mode waits for a GPU reset: the rest of its change
        (and restarting its MPS daemons) comes after the reset."""
        progress = self.status.gpus[gpu.uuid]
        progress.state = "applying"
        self._notify("mig", {"layout": self.status.layout, "state": "applying", "gpu": gpu.index})
        await self._around(0, gpu.uuid)
        awaiting_reset = False
        try:
            awaiting_reset = await self._change_gpu(gpu, desired, progress)
        finally:
            if not awaiting_reset:
                await self._around(1, gpu.uuid)
        return awaiting_reset

    async def _around(self, which: int, uuid: str) -> None:
        if self._around_gpu_change:
            await self._around_gpu_change[which](uuid)

    def _bound(self, gpu: Gpu):
        return log.bind(gpu=gpu.index, uuid=gpu.uuid, layout=self.status.layout)

    async def _change_gpu(self, gpu: Gpu, desired: GpuDesired, progress: GpuProgress) -> bool:
        bound = self._bound(gpu)
        try:
            outcome = await self._set_mode(gpu, desired.mig_enabled, progress, bound)
            if outcome == "needs-reset" and self._allow_reset:
                return True
            if outcome != "active":
                _mark_reset_required(progress, bound, gpu, outcome)
                return False
            if mode_change_needs_reset(gpu, desired):
                # nvml.h, nvmlDeviceSetMigMode: it "may unbind or reset the device to activate the
                # requested mode": on an idle Ampere GPU the driver reset it, and what a reset clears is gone.
                bound.warning("gpu_reset_by_driver", why="MIG mode change on an idle Ampere GPU")
                self.resetter.after_gpu_reset(gpu.uuid)
            await self._finish_gpu(await self._fresh(gpu.uuid), desired, progress, gpu.mig)
        except Exception as exc:
            await self._fail(gpu, progress, exc, gpu.mig)
        return False

    async def _finish_gpu(self, gpu: Gpu, desired: GpuDesired, progress: GpuProgress, original: MigInfo) -> None:
        """Creates and destroys instances once the GPU is in the desired mode; a failure puts the
        GPU back to original (its MIG mode included)."""
        try:
            if desired.mig_enabled:
                plan = plan_gpu(mig_state_of(gpu), desired.devices)
                self._bound(gpu).info("mig_gpu_plan", destroy=len(plan.destroy_cis) + len(plan.destroy_gis),
                                      create=len(plan.create_cis) + sum(1 + len(g.compute_instances)
                                                                        for g in plan.create_gis),
                                      keep=plan.kept)
                await self._execute(gpu, plan, progress)
            progress.state = "done"
            self._bound(gpu).info("mig_gpu_applied", mutations=progress.mutations)
        except Exception as exc:
            await self._fail(gpu, progress, exc, original)

    async def _fail(self, gpu: Gpu, progress: GpuProgress, exc: Exception, original: MigInfo) -> None:
        progress.state, progress.error = "failed", describe_error(exc)
        bound = self._bound(gpu)
        bound.error("mig_gpu_failed", error=progress.error, mutations=progress.mutations)
        await self._roll_back(gpu.index, gpu.uuid, original, progress, bound)

    async def _set_mode(self, gpu: Gpu, enabled: bool, progress: GpuProgress, bound) -> str:
        """Clears the GPU and requests its MIG mode when it must change: "active", "needs-reset" or
        "needs-reboot" (gpud.nvml.mig.set_mig_mode)."""
        if gpu.mig.mode == ("enabled" if enabled else "disabled") and gpu.mig.pending_mode == gpu.mig.mode:
            return "active"
        if gpu.mig.mode == "enabled":
            await self._execute(gpu, GpuPlan(gpu.index, gpu.uuid, target=(),
                                             destroy_cis=_all_cis(gpu.mig.instances),
                                             destroy_gis=tuple(gi.gi_id for gi in gpu.mig.instances)), progress)
        elif self._force and not (self._allow_reset and _compute_major(gpu) < 9):
            # (where a GPU reset applies the mode, the forced reset ends them, every GPU in one command)
            await self._end_gpu_processes(gpu)
        outcome = await self._mutate(progress, nvml_mig.set_mig_mode, gpu.index, enabled)
        bound.info("mig_mode_set", enabled=enabled, outcome=outcome)
        return outcome

    async def _reset_then_finish(self, gpus: list[Gpu]) -> None:
        """One reset for every GPU whose mode waits for it (with their NVLink peers), then their
        instances; peers that had instances get them back."""
        changing = {gpu.uuid for gpu in gpus}

        async def finish(reset: tuple[Gpu, ...], after: Inventory) -> None:
            for gpu in gpus:
                fresh = next(g for g in after.gpus if g.uuid == gpu.uuid)
                desired, progress = self.desired[gpu.uuid], self.status.gpus[gpu.uuid]
                if fresh.mig.mode != ("enabled" if desired.mig_enabled else "disabled"):
                    progress.state = "failed"
                    progress.error = f"the GPU reset did not apply the MIG mode change (mode {fresh.mig.mode}, " \
                                     f"pending {fresh.mig.pending_mode})"
                    continue
                # reset: what it had is gone, its new mode stays (going back would take another reset)
                await self._finish_gpu(fresh, desired, progress, replace(fresh.mig, instances=()))
            await self._restore_after_reset(reset, after, changing)

        try:
            await self.resetter.reset([gpu.index for gpu in gpus], "MIG mode change waits for a GPU reset (Ampere)",
                                      force=self._force, restore=finish)
        except ResetBlocked as exc:
            for gpu in gpus:
                _mark_reset_required(self.status.gpus[gpu.uuid], self._bound(gpu), gpu, "blocked", str(exc))
        except (ResetFailed, ResetBusy, NvmlUnavailable) as exc:
            for gpu in gpus:  # their new mode is pending: taken back, with the instances they had
                progress = self.status.gpus[gpu.uuid]
                progress.state, progress.error = "failed", f"GPU reset failed: {exc}"
                await self._roll_back(gpu.index, gpu.uuid, gpu.mig, progress, self._bound(gpu))
        finally:
            for gpu in gpus:
                await self._around(1, gpu.uuid)

    async def _restore_after_reset(self, reset: tuple[Gpu, ...], after: Inventory, skip: Collection[str]) -> None:
        """A reset destroys every MIG instance: GPUs the layout manages get the layout again, other
        GPUs the instances they had (same profiles and placements; new MIG UUIDs)."""
        for before in reset:
            now = next((g for g in after.gpus if g.uuid == before.uuid), None)
            if before.uuid in skip or now is None or now.lost or now.mig.mode != "enabled":
                continue
            wanted = self.desired.get(before.uuid)
            try:
                if wanted is not None and wanted.mig_enabled:
                    plan = plan_gpu(mig_state_of(now), wanted.devices)
                elif before.mig.instances:
                    plan = plan_restore(mig_state_of(now), before.mig.instances)
                else:
                    continue
                await self._execute(now, plan, GpuProgress(now.index, now.uuid))
                log.info("mig_restored_after_reset", gpu=now.index, uuid=now.uuid, instances=len(plan.target),
                         source="layout" if wanted is not None and wanted.mig_enabled else "before the reset")
            except Exception as exc:
                log.error("mig_restore_after_reset_failed", gpu=now.index, uuid=now.uuid, error=describe_error(exc))

    async def _execute(self, gpu: Gpu, plan: GpuPlan, progress: GpuProgress) -> None:
        index = gpu.index
        if self._force:
            await self._end_processes(gpu, plan)
        for gi_id, ci_id in plan.destroy_cis:
            await self._mutate(progress, nvml_mig.destroy_compute_instance, index, gi_id, ci_id)
        for gi_id in plan.destroy_gis:
            await self._mutate(progress, nvml_mig.destroy_gpu_instance, index, gi_id)
        for gi_id, ci in plan.create_cis:
            await self._mutate(progress, nvml_mig.create_compute_instance, index, gi_id, ci.constant, ci.start,
                               ci.slices)
        for gi in plan.create_gis:
            gi_id = await self._mutate(progress, nvml_mig.create_gpu_instance, index, gi.profile_id, gi.placement)
            for ci in gi.compute_instances:
                await self._mutate(progress, nvml_mig.create_compute_instance, index, gi_id, ci.constant, ci.start,
                                   ci.slices)

    async def _end_gpu_processes(self, gpu: Gpu) -> None:
        """Forced mode change of a GPU out of MIG mode: its compute processes go first."""
        pids = await self.session.call(compute_pids, gpu.index)
        if pids:
            self._bound(gpu).warning("mig_forced_processes_ended", pids=list(pids))
            await asyncio.to_thread(self.resetter.host.end_processes, gpu.uuid, pids)

    async def _end_processes(self, gpu: Gpu, plan: GpuPlan) -> None:
        doomed = set(plan.destroy_cis)
        for gi in gpu.mig.instances:
            for ci in gi.compute_instances:
                if (gi.gi_id, ci.ci_id) in doomed and ci.pids:
                    log.warning("mig_forced_processes_ended", gpu=gpu.index, uuid=ci.uuid, pids=list(ci.pids))
                    await asyncio.to_thread(self.resetter.host.end_processes, ci.uuid, ci.pids)

    async def _mutate(self, progress: GpuProgress, fn, *args):
        result = await self.session.call(fn, *args)
        progress.mutations += 1
        return result

    async def _fresh(self, uuid: str) -> Gpu:
        inventory = await self.inventory.refresh("mig step")
        return next(g for g in inventory.gpus if g.uuid == uuid)

    async def _roll_back(self, index: int, uuid: str, original: MigInfo, progress: GpuProgress, bound) -> None:
        """Puts the GPU back to original: the instances it had, then its MIG mode (a mode change
        that failed midway is taken back, never left changed or pending)."""
        try:
            gpu = await self._fresh(uuid)
            if gpu.error:  # what it holds is unknown: undoing from a partial read would fail confusingly
                raise RuntimeError(f"GPU {index} could not be read: {gpu.error}")
            if gpu.mig.mode == "enabled":
                had = original.instances if original.mode == "enabled" else ()
                await self._execute(gpu, plan_restore(mig_state_of(gpu), had), GpuProgress(index, uuid))
            if original.mode is not None and (gpu.mig.mode, gpu.mig.pending_mode) != (original.mode, original.mode):
                await self._restore_mode(gpu, original.mode == "enabled", bound)
            bound.warning("mig_gpu_rolled_back", restored=len(original.instances), mode=original.mode)
        except Exception as exc:
            progress.error = f"{progress.error}; rollback failed: {describe_error(exc)}"
            bound.error("mig_gpu_rollback_failed", error=describe_error(exc))

    async def _restore_mode(self, gpu: Gpu, enabled: bool, bound) -> None:
        outcome = await self.session.call(nvml_mig.set_mig_mode, gpu.index, enabled)
        if outcome != "active":
            raise RuntimeError(f"the MIG mode could not be set back to {'enabled' if enabled else 'disabled'} "
                               f"({outcome}): run nvidia-smi -r -i {gpu.pci_bus_id} once nothing uses the GPU")
        if gpu.mig.mode != ("enabled" if enabled else "disabled") and _compute_major(gpu) < 9:
            bound.warning("gpu_reset_by_driver", why="MIG mode set back on an idle Ampere GPU")
            self.resetter.after_gpu_reset(gpu.uuid)

    # -- status -------------------------------------------------------------------------------

    def view(self, inventory: Inventory | None) -> dict:
        gpus = []
        for gpu in inventory.gpus if inventory else ():
            desired = self.desired.get(gpu.uuid)
            progress = self.status.gpus.get(gpu.uuid)
            gpus.append({"index": gpu.index, "uuid": gpu.uuid,
                         "desired": desired.as_dict() if desired else None, "actual": actual_of(gpu),
                         "in_sync": desired is None or in_sync(gpu, desired),
                         "state": progress.state if progress else None,
                         "error": progress.error if progress else None})
        all_in_sync = bool(gpus) and all(g["in_sync"] for g in gpus)
        state = self.status.state
        if (state == "success" and not all_in_sync and self.desired) or not self._started:
            state = "pending"
        return {"layout": self.status.layout, "layout_origin": self._chosen.origin, "state": state,
                "in_sync": all_in_sync,
                "error": self.status.error or self.problem,
                "started_at": self.status.started_at, "finished_at": self.status.finished_at, "gpus": gpus,
                "history": self.history}

    def collect(self) -> Iterator[Family]:
        """Whether the GPUs have the desired layout, for /metrics (no desired layout: nothing is out of sync)."""
        in_sync = Family("gpud_mig_in_sync", "1 when every GPU has the desired MIG layout.", "gauge")
        synced = self.view(self.inventory.current)["in_sync"] or not self.desired
        in_sync.add({"hostname": HOSTNAME}, 1 if synced else 0)
        yield in_sync


def _history_from(document: list) -> list[dict]:
    if not isinstance(document, list) or not all(isinstance(entry, dict) and isinstance(entry.get("state"), str)
                                                 for entry in document):
        raise ValueError("the MIG apply history must be a list of applies, each with its state")
    return document[:HISTORY_KEPT]


def _mark_reset_required(progress: GpuProgress, bound, gpu: Gpu, outcome: str, detail: str = "") -> None:
    """The GPU's new MIG mode is pending: say what applies it."""
    progress.state = "reset-required"
    progress.error = {
        "needs-reset": f"the MIG mode change waits for a GPU reset (mig.allow_gpu_reset is false): run "
                       f"nvidia-smi -r -i {gpu.pci_bus_id} once nothing uses the GPU",
        "needs-reboot": "the driver can apply the MIG mode change only at a reboot (activation status "
                        "RESET_REQUIRED: this platform does not expose a GPU reset, as in a pass-through VM)",
        "blocked": f"the MIG mode change waits for a GPU reset, which would be refused: {detail}",
    }[outcome]
    bound.warning("mig_reset_required", outcome=outcome, error=progress.error)


def _all_cis(instances: tuple[GpuInstanceState, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((gi.gi_id, ci.ci_id) for gi in instances for ci in gi.compute_instances)


def _doomed_compute_instances(gpu: Gpu, desired: GpuDesired, plan: GpuPlan | None) -> set[tuple[int, int]]:
    mode_change = (gpu.mig.mode == "enabled") != desired.mig_enabled or gpu.mig.mode != "enabled"
    if mode_change:
        return set(_all_cis(gpu.mig.instances))
    return set(plan.destroy_cis) if plan else set()
