"""The MIG instances of a GPU: creating and destroying them by a plan, and putting back what a GPU
reset destroyed (as mig-parted keeps a GPU's MIG state, to fetch and restore, apart from applying
a config: github.com/NVIDIA/mig-parted, pkg/mig/state)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from gpud.base.logs import get_logger
from gpud.mig.desired import DesiredStore
from gpud.mig.dynamic_gpus import DynamicGpus
from gpud.mig.planner import plan_gpu, plan_restore
from gpud.mig.status import GpuProgress
from gpud.mig.sync import mig_state_of
from gpud.model.inventory import Gpu, Inventory
from gpud.model.mig import GpuPlan
from gpud.nvml import mig as nvml_mig
from gpud.nvml.host_tools import HostTools, SimHostTools
from gpud.nvml.reset import compute_pids
from gpud.nvml.session import NvmlSession, describe_error

log = get_logger("mig")


class MigInstances:
    def __init__(self, session: NvmlSession, host: HostTools | SimHostTools, desired: DesiredStore,
                 dynamic: DynamicGpus = DynamicGpus()):
        self.session = session
        self.host = host  # ends the processes a forced change takes away
        self._desired = desired
        self._dynamic = dynamic  # their instances are the DRA claims': put back as they were, never a layout's

    async def execute(self, gpu: Gpu, plan: GpuPlan, progress: GpuProgress, force: bool) -> None:
        index = gpu.index
        if force:
            await self._end_processes(gpu, plan)
        for gi_id, ci_id in plan.destroy_cis:
            await self.mutate(progress, nvml_mig.destroy_compute_instance, index, gi_id, ci_id)
        for gi_id in plan.destroy_gis:
            await self.mutate(progress, nvml_mig.destroy_gpu_instance, index, gi_id)
        for gi_id, ci in plan.create_cis:
            await self.mutate(progress, nvml_mig.create_compute_instance, index, gi_id, ci.constant, ci.start,
                              ci.slices)
        for gi in plan.create_gis:
            gi_id = await self.mutate(progress, nvml_mig.create_gpu_instance, index, gi.profile_id, gi.placement)
            for ci in gi.compute_instances:
                await self.mutate(progress, nvml_mig.create_compute_instance, index, gi_id, ci.constant, ci.start,
                                  ci.slices)

    async def mutate(self, progress: GpuProgress, fn, *args):
        """One NVML change, counted on the GPU's progress."""
        result = await self.session.call(fn, *args)
        progress.mutations += 1
        return result

    async def end_gpu_processes(self, gpu: Gpu, bound) -> None:
        """Forced mode change of a GPU out of MIG mode: its compute processes go first."""
        pids = await self.session.call(compute_pids, gpu.index)
        if pids:
            bound.warning("mig_forced_processes_ended", pids=list(pids))
            await asyncio.to_thread(self.host.end_processes, gpu.uuid, pids)

    async def _end_processes(self, gpu: Gpu, plan: GpuPlan) -> None:
        doomed = set(plan.destroy_cis)
        for gi in gpu.mig.instances:
            for ci in gi.compute_instances:
                if (gi.gi_id, ci.ci_id) in doomed and ci.pids:
                    log.warning("mig_forced_processes_ended", gpu=gpu.index, uuid=ci.uuid, pids=list(ci.pids))
                    await asyncio.to_thread(self.host.end_processes, ci.uuid, ci.pids)

    async def restore_after_reset(self, reset: tuple[Gpu, ...], after: Inventory, skip: Collection[str] = ()) -> None:
        """A reset destroys every MIG instance: GPUs the layout manages get the layout again, other
        GPUs the instances they had (same profiles and placements; new MIG UUIDs). skip: GPUs the
        caller finishes itself."""
        chosen = self._desired.chosen
        for before in reset:
            now = next((g for g in after.gpus if g.uuid == before.uuid), None)
            if before.uuid in skip or now is None or now.lost or now.mig.mode != "enabled":
                continue
            wanted = None if self._dynamic.selects(now) else (chosen.gpus or {}).get(before.uuid)
            try:
                if wanted is not None and wanted.mig_enabled:
                    plan = plan_gpu(mig_state_of(now), wanted.devices)
                elif before.mig.instances:
                    plan = plan_restore(mig_state_of(now), before.mig.instances)
                else:
                    continue
                await self.execute(now, plan, GpuProgress(now.index, now.uuid), chosen.force)
                log.info("mig_restored_after_reset", gpu=now.index, uuid=now.uuid, instances=len(plan.target),
                         source="layout" if wanted is not None and wanted.mig_enabled else "before the reset")
            except Exception as exc:
                log.error("mig_restore_after_reset_failed", gpu=now.index, uuid=now.uuid, error=describe_error(exc))
