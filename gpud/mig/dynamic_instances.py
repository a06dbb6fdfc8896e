"""A dynamic MIG device's NVML changes, each recorded before it is made (gpud.mig.dynamic_records): its GPU
instance at exactly the allocated placement with the compute instance that takes all of it, and destroying
them again. Through gpud.nvml.mig on the NVML session, as gpud.mig.instances changes a layout's."""

from __future__ import annotations

from dataclasses import replace

from gpud.base.logs import get_logger

from gpud.mig.dynamic_records import DynamicRecord, DynamicRecords, RecordState
from gpud.mig.dynamic_view import find_instance, pids_line
from gpud.model.inventory import Gpu, Inventory
from gpud.model.mig import GiProfile, GpuInstanceState, Placement
from gpud.nvml import mig as nvml_mig
from gpud.nvml.session import NvmlSession

log = get_logger("mig")


class DynamicInstances:
    def __init__(self, session: NvmlSession, records: DynamicRecords):
        self.session = session
        self.records = records

    async def create(self, gpu: Gpu, profile: GiProfile, placement: Placement) -> tuple[int, int]:
        """The GPU instance at exactly that placement and its whole-GI compute instance; a GI whose CI
        is refused is destroyed again."""
        gi_id = await self.session.call(nvml_mig.create_gpu_instance, gpu.index, profile.id, placement)
        return gi_id, await self.whole_ci(gpu, profile, gi_id, undo_gi=True)

    async def whole_ci(self, gpu: Gpu, profile: GiProfile, gi_id: int, *, undo_gi: bool) -> int:
        whole = profile.whole_ci
        try:
            return await self.session.call(nvml_mig.create_compute_instance, gpu.index, gi_id, whole.constant, 0,
                                           whole.slices)
        except Exception:
            if undo_gi:
                await self.session.call(nvml_mig.destroy_gpu_instance, gpu.index, gi_id)
            raise

    async def destroy(self, inventory: Inventory, record: DynamicRecord) -> str | None:
        """Destroys the record's instance (recorded as destroying first) and drops the record; its MIG UUID."""
        self.records.put(replace(record, state=RecordState.DESTROYING))
        gpu = next((g for g in inventory.gpus if g.uuid == record.gpu_uuid), None)
        gi = find_instance(gpu, record) if gpu is not None else None
        uuid = None
        if gi is not None:
            uuid = next((ci.uuid for ci in gi.compute_instances if ci.uuid), None)
            await self.destroy_instance(gpu, gi)
        self.records.drop(record)
        return uuid

    async def destroy_instance(self, gpu: Gpu, gi: GpuInstanceState) -> None:
        for ci in gi.compute_instances:
            await self.session.call(nvml_mig.destroy_compute_instance, gpu.index, gi.gi_id, ci.ci_id)
        await self.session.call(nvml_mig.destroy_gpu_instance, gpu.index, gi.gi_id)

    async def destroy_unrecorded(self, gpu: Gpu, names: dict[int, str]) -> list[str]:
        """Instances on a dynamic GPU no record names: destroyed when idle; those processes run on are kept,
        and returned as problems."""
        kept = []
        for gi in gpu.mig.instances if gpu.mig.mode == "enabled" else ():
            if any(find_instance(gpu, r) == gi for r in self.records.records if r.gpu_uuid == gpu.uuid):
                continue
            pids = sorted({pid for ci in gi.compute_instances for pid in ci.pids})
            if pids:
                kept.append(f"GPU {gpu.index} ({gpu.uuid}) is a dynamic MIG GPU, yet holds a GPU instance no DRA "
                            f"claim made (GI {gi.gi_id}, memory slices {gi.placement.start}-"
                            f"{gi.placement.start + gi.placement.size - 1}) running {pids_line(pids, names)}: kept")
                continue
            await self.destroy_instance(gpu, gi)
            log.warning("dynamic_mig_unrecorded_instance_destroyed", gpu=gpu.index, gi_id=gi.gi_id,
                        profile_id=gi.profile_id, start=gi.placement.start,
                        why="only DRA claims make instances on a dynamic MIG GPU")
        return kept

    def note_uuids(self, inventory: Inventory) -> None:
        """Present records take their MIG UUIDs (and ids) from the GPUs as read now."""
        changed = []
        for record in self.records.records:
            gpu = next((g for g in inventory.gpus if g.uuid == record.gpu_uuid), None)
            gi = find_instance(gpu, record) if gpu is not None and record.state == RecordState.PRESENT else None
            if gi is not None and gi.compute_instances:
                ci = gi.compute_instances[0]
                if (record.gi_id, record.ci_id, record.uuid) != (gi.gi_id, ci.ci_id, ci.uuid):
                    changed.append(record.made(gi.gi_id, ci.ci_id, ci.uuid))
        if changed:
            self.records.put(*changed)
