"""Applying a layout to the GPUs it changes, one GPU at a time, as a transaction per GPU: when a step
fails, that GPU is put back to the instances and MIG mode it had, and the other GPUs are left as
they are. Every mode is set first, then one GPU reset takes the GPUs whose mode waits for it
(github.com/NVIDIA/mig-parted: pkg/mig/mode sets modes, pkg/mig/state restores a GPU's instances).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from gpud.base.logs import get_logger
from gpud.gpu_reset import GpuHook, GpuResetter, ResetBlocked
from gpud.inventory import InventoryService
from gpud.mig.desired import GpuDesired
from gpud.mig.instances import MigInstances
from gpud.mig.planner import plan_gpu, plan_restore
from gpud.mig.status import ApplyStatus, GpuApplyState, GpuProgress, ModeOutcome
from gpud.mig.sync import all_cis, mig_state_of, mode_change_needs_reset, resets_to_change_mode
from gpud.model.inventory import Gpu, Inventory, MigInfo
from gpud.model.mig import GpuPlan
from gpud.nvml import mig as nvml_mig
from gpud.nvml.host_tools import ResetFailed
from gpud.nvml.session import NvmlSession, NvmlUnavailable, describe_error

log = get_logger("mig")


@dataclass
class ApplyRun:
    """One apply: its progress, what it wants of each GPU, and whether it ends processes in its way."""
    status: ApplyStatus
    desired: dict[str, GpuDesired]
    force: bool


class MigApplier:
    def __init__(self, session: NvmlSession, inventory: InventoryService, resetter: GpuResetter,
                 instances: MigInstances, *, allow_reset: bool, around_gpu_change: tuple[GpuHook, GpuHook] | None,
                 notify: Callable[[str, dict], object]):
        self.session = session
        self.inventory = inventory
        self.resetter = resetter
        self.instances = instances
        self._allow_reset = allow_reset
        # Called with a GPU's UUID before and after its MIG layout changes (MPS daemons stop and restart).
        self._around_gpu_change = around_gpu_change
        self._notify = notify  # the watch stream

    async def change(self, run: ApplyRun, changing: list[Gpu]) -> None:
        """As mig-parted does: every mode is set first, then one reset takes them all, so a GPU is
        never reset again after its instances were made (a reset destroys them)."""
        awaiting_reset = [gpu for gpu in changing if await self._apply_gpu(run, gpu)]
        if awaiting_reset:
            await self._reset_then_finish(run, awaiting_reset)

    async def _apply_gpu(self, run: ApplyRun, gpu: Gpu) -> bool:
        """Changes one GPU. True when its new MIG mode waits for a GPU reset: the rest of its change
        (and restarting its MPS daemons) comes after the reset."""
        progress = run.status.gpus[gpu.uuid]
        progress.state = GpuApplyState.APPLYING
        self._notify("mig", {"layout": run.status.layout, "state": GpuApplyState.APPLYING.value, "gpu": gpu.index})
        await self._around(0, gpu.uuid)
        awaiting_reset = False
        try:
            awaiting_reset = await self._change_gpu(run, gpu, progress)
        finally:
            if not awaiting_reset:
                await self._around(1, gpu.uuid)
        return awaiting_reset

    async def _around(self, which: int, uuid: str) -> None:
        if self._around_gpu_change:
            await self._around_gpu_change[which](uuid)

    @staticmethod
    def _bound(run: ApplyRun, gpu: Gpu):
        return log.bind(gpu=gpu.index, uuid=gpu.uuid, layout=run.status.layout)

    async def _change_gpu(self, run: ApplyRun, gpu: Gpu, progress: GpuProgress) -> bool:
        desired = run.desired[gpu.uuid]
        bound = self._bound(run, gpu)
        try:
            outcome = await self._set_mode(run, gpu, desired.mig_enabled, progress, bound)
            if outcome == ModeOutcome.NEEDS_RESET and self._allow_reset:
                return True
            if outcome != ModeOutcome.ACTIVE:
                _mark_reset_required(progress, bound, gpu, outcome)
                return False
            if mode_change_needs_reset(gpu, desired):
                # nvml.h, nvmlDeviceSetMigMode: it "may unbind or reset the device to activate the
                # requested mode": on an idle Ampere GPU the driver reset it, and what a reset clears is gone.
                bound.warning("gpu_reset_by_driver", why="MIG mode change on an idle Ampere GPU")
                self.resetter.after_gpu_reset(gpu.uuid)
            await self._finish_gpu(run, await self._fresh(gpu.uuid), progress, gpu.mig)
        except Exception as exc:
            await self._fail(run, gpu, progress, exc, gpu.mig)
        return False

    async def _finish_gpu(self, run: ApplyRun, gpu: Gpu, progress: GpuProgress, original: MigInfo) -> None:
        """Creates and destroys instances once the GPU is in the desired mode; a failure puts the
        GPU back to original (its MIG mode included)."""
        desired = run.desired[gpu.uuid]
        try:
            if desired.mig_enabled:
                plan = plan_gpu(mig_state_of(gpu), desired.devices)
                self._bound(run, gpu).info("mig_gpu_plan", destroy=len(plan.destroy_cis) + len(plan.destroy_gis),
                                           create=len(plan.create_cis) + sum(1 + len(g.compute_instances)
                                                                             for g in plan.create_gis),
                                           keep=plan.kept)
                await self.instances.execute(gpu, plan, progress, run.force)
            progress.state = GpuApplyState.DONE
            self._bound(run, gpu).info("mig_gpu_applied", mutations=progress.mutations)
        except Exception as exc:
            await self._fail(run, gpu, progress, exc, original)

    async def _fail(self, run: ApplyRun, gpu: Gpu, progress: GpuProgress, exc: Exception, original: MigInfo) -> None:
        progress.state, progress.error = GpuApplyState.FAILED, describe_error(exc)
        bound = self._bound(run, gpu)
        bound.error("mig_gpu_failed", error=progress.error, mutations=progress.mutations)
        await self._roll_back(run, gpu.index, gpu.uuid, original, progress, bound)

    async def _set_mode(self, run: ApplyRun, gpu: Gpu, enabled: bool, progress: GpuProgress, bound) -> ModeOutcome:
        """Clears the GPU and requests its MIG mode when it must change (gpud.nvml.mig.set_mig_mode)."""
        if gpu.mig.mode == ("enabled" if enabled else "disabled") and gpu.mig.pending_mode == gpu.mig.mode:
            return ModeOutcome.ACTIVE
        if gpu.mig.mode == "enabled":
            await self.instances.execute(gpu, GpuPlan(gpu.index, gpu.uuid, target=(),
                                                      destroy_cis=all_cis(gpu.mig.instances),
                                                      destroy_gis=tuple(gi.gi_id for gi in gpu.mig.instances)),
                                         progress, run.force)
        elif run.force and not (self._allow_reset and resets_to_change_mode(gpu)):
            # (where a GPU reset applies the mode, the forced reset ends them, every GPU in one command)
            await self.instances.end_gpu_processes(gpu, bound)
        outcome = ModeOutcome(await self.instances.mutate(progress, nvml_mig.set_mig_mode, gpu.index, enabled))
        bound.info("mig_mode_set", enabled=enabled, outcome=outcome.value)
        return outcome

    async def _reset_then_finish(self, run: ApplyRun, gpus: list[Gpu]) -> None:
        """One reset for every GPU whose mode waits for it (with their NVLink peers), then their
        instances; peers that had instances get them back."""
        changing = {gpu.uuid for gpu in gpus}

        async def finish(reset: tuple[Gpu, ...], after: Inventory) -> None:
            for gpu in gpus:
                fresh = next(g for g in after.gpus if g.uuid == gpu.uuid)
                desired, progress = run.desired[gpu.uuid], run.status.gpus[gpu.uuid]
                if fresh.mig.mode != ("enabled" if desired.mig_enabled else "disabled"):
                    progress.state = GpuApplyState.FAILED
                    progress.error = f"the GPU reset did not apply the MIG mode change (mode {fresh.mig.mode}, " \
                                     f"pending {fresh.mig.pending_mode})"
                    continue
                # reset: what it had is gone, its new mode stays (going back would take another reset)
                await self._finish_gpu(run, fresh, progress, replace(fresh.mig, instances=()))
            await self.instances.restore_after_reset(reset, after, changing)

        try:
            await self.resetter.reset([gpu.index for gpu in gpus], "MIG mode change waits for a GPU reset (Ampere)",
                                      force=run.force, restore=finish)
        except ResetBlocked as exc:
            for gpu in gpus:
                _mark_reset_required(run.status.gpus[gpu.uuid], self._bound(run, gpu), gpu, ModeOutcome.BLOCKED,
                                     str(exc))
        except (ResetFailed, NvmlUnavailable) as exc:
            for gpu in gpus:  # their new mode is pending: taken back, with the instances they had
                progress = run.status.gpus[gpu.uuid]
                progress.state, progress.error = GpuApplyState.FAILED, f"GPU reset failed: {exc}"
                await self._roll_back(run, gpu.index, gpu.uuid, gpu.mig, progress, self._bound(run, gpu))
        finally:
            for gpu in gpus:
                await self._around(1, gpu.uuid)

    async def _fresh(self, uuid: str) -> Gpu:
        inventory = await self.inventory.refresh("mig step")
        return next(g for g in inventory.gpus if g.uuid == uuid)

    async def _roll_back(self, run: ApplyRun, index: int, uuid: str, original: MigInfo, progress: GpuProgress,
                         bound) -> None:
        """Puts the GPU back to original: the instances it had, then its MIG mode (a mode change
        that failed midway is taken back, never left changed or pending)."""
        try:
            gpu = await self._fresh(uuid)
            if gpu.error:  # what it holds is unknown: undoing from a partial read would fail confusingly
                raise RuntimeError(f"GPU {index} could not be read: {gpu.error}")
            if gpu.mig.mode == "enabled":
                had = original.instances if original.mode == "enabled" else ()
                await self.instances.execute(gpu, plan_restore(mig_state_of(gpu), had), GpuProgress(index, uuid),
                                             run.force)
            if original.mode is not None and (gpu.mig.mode, gpu.mig.pending_mode) != (original.mode, original.mode):
                await self._restore_mode(gpu, original.mode == "enabled", bound)
            bound.warning("mig_gpu_rolled_back", restored=len(original.instances), mode=original.mode)
        except Exception as exc:
            progress.error = f"{progress.error}; rollback failed: {describe_error(exc)}"
            bound.error("mig_gpu_rollback_failed", error=describe_error(exc))

    async def _restore_mode(self, gpu: Gpu, enabled: bool, bound) -> None:
        outcome = await self.session.call(nvml_mig.set_mig_mode, gpu.index, enabled)
        if outcome != ModeOutcome.ACTIVE:
            raise RuntimeError(f"the MIG mode could not be set back to {'enabled' if enabled else 'disabled'} "
                               f"({outcome}): run nvidia-smi -r -i {gpu.pci_bus_id} once nothing uses the GPU")
        if gpu.mig.mode != ("enabled" if enabled else "disabled") and resets_to_change_mode(gpu):
            bound.warning("gpu_reset_by_driver", why="MIG mode set back on an idle Ampere GPU")
            self.resetter.after_gpu_reset(gpu.uuid)


def _mark_reset_required(progress: GpuProgress, bound, gpu: Gpu, outcome: ModeOutcome, detail: str = "") -> None:
    """The GPU's new MIG mode is pending: say what applies it."""
    progress.state = GpuApplyState.RESET_REQUIRED
    progress.error = {
        ModeOutcome.NEEDS_RESET: f"the MIG mode change waits for a GPU reset (mig.allow_gpu_reset is false): run "
                                 f"nvidia-smi -r -i {gpu.pci_bus_id} once nothing uses the GPU",
        ModeOutcome.NEEDS_REBOOT: "the driver can apply the MIG mode change only at a reboot (activation status "
                                  "RESET_REQUIRED: this platform does not expose a GPU reset, as in a pass-through "
                                  "VM)",
        ModeOutcome.BLOCKED: f"the MIG mode change waits for a GPU reset, which would be refused: {detail}",
    }[outcome]
    bound.warning("mig_reset_required", outcome=outcome.value, error=progress.error)
