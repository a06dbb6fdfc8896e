"""Brings the GPUs to the desired MIG layout, crash-safely: the coordinator of an apply.

The desired layout is persisted before the first NVML change; at start gpud reconciles the GPUs
to it, so a crash at any point of an apply converges on the next start. An apply holds the node's
operations lock (gpud.node_operations) from its first read to its last change: a second apply, a
start-up reconcile and a GPU reset are refused meanwhile. What each step does lives apart, as
mig-parted keeps mode, state and apply apart (github.com/NVIDIA/mig-parted pkg/mig/mode,
pkg/mig/state, cmd apply): preflight (plans and refusals), apply (per GPU, with rollback),
instances (NVML changes, restore after a reset), history and view.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Iterator

from gpud.base.errors import GpudError, nvml_unavailable
from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile
from gpud.base.samples import Family
from gpud.gpu_reset import GpuHook, GpuResetter
from gpud.inventory import InventoryService
from gpud.mig.apply import ApplyRun, MigApplier
from gpud.mig.desired import Desired, DesiredStore, GpuDesired
from gpud.mig.dynamic_gpus import DynamicGpus
from gpud.mig.history import ApplyHistory
from gpud.mig.hooks import MigHooks
from gpud.mig.instances import MigInstances
from gpud.mig.layouts import Layout, LayoutsFile
from gpud.mig.preflight import (converging_needs_root, plan_layout, refuse_blocked_reset, refuse_busy_gpus,
                                refuse_without_root)
from gpud.mig.status import ApplyState, ApplyStatus, GpuApplyState, GpuProgress
from gpud.mig.sync import in_sync
from gpud.mig.view import mig_families, mig_view
from gpud.model.inventory import Inventory
from gpud.model.mig import GpuPlan
from gpud.node_operations import NodeOperations, Operation
from gpud.nvml.session import NvmlSession

log = get_logger("mig")


class MigReconciler(Component):
    name = "mig"

    def __init__(self, session: NvmlSession, inventory: InventoryService, desired: DesiredStore,
                 instances: MigInstances, resetter: GpuResetter, operations: NodeOperations, *,
                 allow_reset: bool = True, pre_apply: tuple[str, ...] = (), post_apply: tuple[str, ...] = (),
                 hook_timeout_s: float = 300.0, around_gpu_change: tuple[GpuHook, GpuHook] | None = None,
                 notify: Callable[[str, dict], object] = lambda kind, data: None,
                 default_layout: str | None = None, layouts: LayoutsFile | None = None,
                 dynamic: DynamicGpus = DynamicGpus()):
        self.session = session
        self.inventory = inventory
        self.resetter = resetter
        self._operations = operations
        self._desired = desired
        self._allow_reset = allow_reset
        self._hooks = MigHooks(pre_apply, post_apply, hook_timeout_s)
        self._applier = MigApplier(session, inventory, resetter, instances, allow_reset=allow_reset,
                                   around_gpu_change=around_gpu_change, notify=notify)
        self._notify = notify  # the watch stream
        self.status = ApplyStatus()
        self._started = False  # set once gpud has converged (or begun converging) the GPUs at start-up
        self._history = ApplyHistory(desired.path.with_name("mig-history.json"))
        self._task: asyncio.Task | None = None
        self.default_layout, self.layouts = default_layout, layouts  # mig.default_layout, mig.layouts_file
        self.dynamic = dynamic  # GPUs only DRA claims change (dra.dynamic_mig_gpus): layouts leave them out

    async def start(self, tasks: Tasks) -> None:
        """The desired layout and the applies before this start read back: an apply a crash interrupted is
        pending until the GPUs are converged on it."""
        if self._desired.load().gpus is not None:
            self.status.layout, self.status.state = self._desired.chosen.layout, ApplyState.PENDING
        self._history.load()

    async def start_with_gpus(self, tasks: Tasks) -> None:
        await self.converge_at_start(self.default_layout, self.layouts)

    def problems(self) -> list[str]:
        failed = [self.problem] if self.problem else self.status.unapplied()  # a corrupt file fails the layout
        return failed + [file.message() for file in self.corrupt_files] + \
            self.dynamic.covered_by_layout(self.inventory.current, self._desired.chosen.gpus, self.status.layout)

    @property
    def corrupt_files(self) -> list[CorruptFile]:
        return self._history.corrupt_files

    @property
    def desired(self) -> dict[str, GpuDesired]:
        """GPU UUID -> what the chosen layout wants of it (GPUs it leaves alone, and dynamic MIG GPUs, are absent)."""
        dynamic = self.dynamic.uuids(self.inventory.current)
        return {uuid: wanted for uuid, wanted in (self._desired.chosen.gpus or {}).items() if uuid not in dynamic}

    @property
    def problem(self) -> str | None:
        """Why the persisted desired layout could not be used (a corrupt file), until one is chosen again."""
        return self._desired.problem

    # -- applying ---------------------------------------------------------------------------

    async def apply(self, layout: Layout, *, force: bool = False, source: str = "api",
                    origin: str | None = None) -> tuple[dict[str, GpuPlan], asyncio.Task]:
        """Plans, persists the desired layout and starts applying it in the background. Returns the
        plans and the apply, whose result is /v1/mig's view as this apply left it. Refused (409)
        while another apply or a reset runs. `origin` says where the layout is defined: the layouts
        file's path, "builtin", or "request" (a file sent with the request)."""
        self._operations.claim(Operation.APPLY, layout=layout.name)
        try:
            inventory = await self.inventory.refresh("mig apply requested")
            if inventory is None:
                raise nvml_unavailable(self.session.error or "no inventory yet")
            desired, plans = plan_layout(layout, inventory, force, self.dynamic)
            if self._allow_reset:  # else the mode change is left pending for the operator: state reset-required
                await refuse_blocked_reset(self.resetter, layout, inventory, desired, force)
            if not force:
                await refuse_busy_gpus(self.session, layout, inventory, desired)
            refuse_without_root(layout, plans)
            self._desired.save(Desired(layout.name, source, force, desired, origin))
        except BaseException:
            self._operations.release()
            raise
        self._start_claimed(layout.name, inventory)
        return plans, self._task

    def _start_claimed(self, layout: str | None, inventory: Inventory) -> None:
        self.status = ApplyStatus(layout=layout, state=ApplyState.APPLYING, started_at=time.time(),
                                  gpus={g.uuid: GpuProgress(g.index, g.uuid) for g in inventory.gpus
                                        if g.uuid in self.desired})
        self._task = asyncio.create_task(self._run_claimed())

    async def wait(self) -> ApplyStatus:
        if self._task is not None:
            await asyncio.shield(self._task)
        return self.status

    async def stop(self) -> None:
        """Abandons an apply in progress (gpud is stopping): the persisted desired layout lets the next
        start finish it, exactly as after a crash."""
        task = self._task
        if task is not None and not task.done():
            log.warning("mig_apply_interrupted", layout=self.status.layout, why="gpud is stopping")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def converge_at_start(self, default_layout: str | None, layouts: LayoutsFile) -> None:
        """Finishes what a crash interrupted, or applies `default_layout` (mig.default_layout) when it
        is new and no layout was chosen through the API since."""
        if self.problem:
            self._started = True  # an operator's layout may be in the corrupt file: gpud applies none of its own
            self._settle(ApplyState.FAILED, self.problem)
            return
        try:
            if default_layout and self._desired.chosen.source != "api" and self.status.layout != default_layout:
                await self.apply(layouts.layout(default_layout), source="default_layout",
                                 origin=layouts.layouts()[0])
                self._started = True
                await self.wait()
            else:
                self._started = True
                await self.reconcile("startup")
        except GpudError as exc:
            self._started = True
            self._settle(ApplyState.FAILED, f"mig.default_layout '{default_layout}': {exc}")
            log.error("mig_default_layout_failed", layout=default_layout, error=str(exc))

    async def reconcile(self, reason: str) -> None:
        """Converges the GPUs on the persisted desired layout (after a crash, or at start)."""
        if not self.desired or self._operations.busy:
            return
        self._operations.claim(Operation.RECONCILE, layout=self.status.layout)
        try:
            inventory = await self.inventory.refresh(reason)
            synced = inventory is not None and all(in_sync(g, self.desired[g.uuid]) for g in inventory.gpus
                                                   if g.uuid in self.desired)
        except BaseException:
            self._operations.release()
            raise
        if inventory is None or synced:
            self._operations.release()
            if synced:
                self._settle(ApplyState.SUCCESS, self.status.error)
            return
        if refused := converging_needs_root(self.status.layout, inventory, self.desired):
            self._operations.release()  # saved by an earlier gpud: retried, it would fail at every start
            self._desired.take_back()
            log.warning("mig_desired_withdrawn", layout=self.status.layout, error=refused.message)
            return self._settle(ApplyState.FAILED, refused.message)
        log.warning("mig_out_of_sync", layout=self.status.layout, reason=reason)
        self._start_claimed(self.status.layout, inventory)
        await self.wait()

    async def _run_claimed(self) -> dict:
        """Runs the claimed apply; its result is the view it ends with, taken before another can start."""
        try:
            await self._run()
        except Exception as exc:  # never leave the status at "applying"
            log.exception("mig_apply_crashed", error=str(exc))
            self.status.state, self.status.error = ApplyState.FAILED, f"internal error: {exc}"
        finally:
            self.status.finished_at = time.time()
            self._history.add(self.status)
            self._operations.release()
        view = self.view(self.inventory.current)
        await self._history.save()
        return view

    async def _run(self) -> None:
        inventory = await self.inventory.refresh("mig apply")
        changing = [g for g in inventory.gpus if g.uuid in self.desired and not in_sync(g, self.desired[g.uuid])]
        for gpu in inventory.gpus:
            if gpu.uuid in self.status.gpus and gpu not in changing:
                self.status.gpus[gpu.uuid].state = GpuApplyState.UNCHANGED
        if changing and (failure := await self._hooks.run("pre_apply", self.status.layout,
                                                          [g.index for g in changing])):
            self.status.state, self.status.error = ApplyState.FAILED, f"{failure}; the apply is cancelled"
            for progress in self.status.gpus.values():
                if progress.state == GpuApplyState.PENDING:
                    progress.state = GpuApplyState.UNCHANGED
            self._desired.take_back()  # for good: the next start must not resume it
            return
        await self._applier.change(ApplyRun(self.status, self.desired, self._desired.chosen.force), changing)
        final = await self.inventory.refresh("mig apply finished")
        if changing and (failure := await self._hooks.run("post_apply", self.status.layout,
                                                          [g.index for g in changing])):
            self.status.error = failure
        self._settle(self.status.outcome(), "; ".join(f"GPU {p.index}: {p.error}" for p in self.status.gpus.values()
                                                      if p.error) or self.status.error)
        log.info("mig_apply_finished", layout=self.status.layout, state=self.status.state.value,
                 mutations=sum(p.mutations for p in self.status.gpus.values()),
                 in_sync=all(in_sync(g, self.desired[g.uuid]) for g in final.gpus if g.uuid in self.desired))

    def _settle(self, state: ApplyState, error: str | None) -> None:
        """The layout's outcome, said on the watch stream: what follows MIG (NFD's labels, the device
        plugin) learns of it from there, whether an apply or start-up convergence reached it."""
        self.status.state, self.status.error = state, error
        self._notify("mig", {"layout": self.status.layout, "state": state.value, "error": error})

    # -- status -------------------------------------------------------------------------------

    def view(self, inventory: Inventory | None) -> dict:
        return mig_view(inventory, self.desired, self.status, origin=self._desired.chosen.origin,
                        dynamic=self.dynamic.uuids(inventory),
                        started=self._started, problem=self.problem, history=self._history.entries)

    def collect(self) -> Iterator[Family]:
        return mig_families(self.view(self.inventory.current), self.desired)
