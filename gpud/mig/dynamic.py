"""Dynamic MIG: on the GPUs dra.dynamic_mig_gpus selects, a DRA claim's MIG device is made when the claim
is prepared, at exactly the placement the scheduler allocated, and destroyed when it is unprepared
(PUT and DELETE /v1/mig/dynamic/{uid}, called by `gpud dra-plugin`). Only the claim's own instances
change: every other instance on the GPU, and the processes on it, stay as they are.

As NVIDIA's DRA driver does behind its DynamicMIG gate (kubernetes-sigs/dra-driver-nvidia-gpu
cmd/gpu-kubelet-plugin/nvlib.go: createMigDevice, deleteMigDevice, maybeDisableMigMode), with gpud's
own guarantees: each change holds the node-operations lock (a MIG apply or a GPU reset never runs
meanwhile), is recorded before it is made (gpud.mig.dynamic_records) so a crash at any step converges
at the next start, and answers only once the inventory and the CDI spec show the new device.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from gpud.base.errors import ErrorKind, GpudError, nvml_unavailable
from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.base.samples import Family
from gpud.gpu_reset import GpuResetter
from gpud.inventory import InventoryService
from gpud.mig.dynamic_checks import planned_devices
from gpud.mig.dynamic_gpus import SETTING, DynamicGpus
from gpud.mig.dynamic_instances import DynamicInstances
from gpud.mig.dynamic_mode import DynamicMode
from gpud.mig.dynamic_records import DynamicRecord, DynamicRecords, RecordState
from gpud.mig.dynamic_view import claim_answer, dynamic_view, find_instance, pids_line, process_names
from gpud.mig.instances import MigInstances
from gpud.model.dcgm_labels import HOSTNAME
from gpud.model.inventory import Gpu, Inventory
from gpud.node_operations import NodeOperations, Operation
from gpud.nvml.session import NvmlSession, describe_error
from gpud.processes.monitor import ProcessMonitor

log = get_logger("mig")


@dataclass(frozen=True)
class WantedDevice:
    """One device of PUT /v1/mig/dynamic/{uid}: a GPU instance of this profile at this placement."""

    gpu: str  # GPU UUID
    gi_profile_id: int
    placement_start: int

    @property
    def key(self) -> tuple[str, int, int]:
        return self.gpu, self.gi_profile_id, self.placement_start


class DynamicMig(Component):
    name = "dynamic-mig"

    def __init__(self, session: NvmlSession, inventory: InventoryService, records: DynamicRecords,
                 instances: MigInstances, resetter: GpuResetter, operations: NodeOperations, gpus: DynamicGpus, *,
                 allow_reset: bool, processes: ProcessMonitor | None = None,
                 files_current: Callable[[str], Awaitable[None]]):
        self.session = session
        self.inventory = inventory
        self.records = records
        self.gpus = gpus
        self._operations = operations
        self._processes = processes  # names the processes a refusal lists
        self._files_current = files_current  # the CDI spec brought up to date before an answer
        self._instances = DynamicInstances(session, records)
        self._mode = DynamicMode(session, resetter, allow_reset=allow_reset, restore=instances.restore_after_reset)
        self._problems: list[str] = []  # what start-up convergence left as it found it
        self.converged = False  # start-up convergence is over: until then claims wait (503)

    async def start(self, tasks: Tasks) -> None:
        self.records.load()

    async def start_with_gpus(self, tasks: Tasks) -> None:
        """The boot id is known now: an earlier boot's records go, this boot's are converged on."""
        self.records.drop_earlier_boots()
        try:
            await self.converge()
        finally:
            self.converged = True

    def problems(self) -> list[str]:
        return [file.message() for file in self.records.corrupt_files] + self._problems

    def view(self) -> dict:
        """GET /v1/mig/dynamic."""
        return dynamic_view(self.inventory.current, self.gpus, self.records.records)

    def collect(self) -> Iterator[Family]:
        inventory = self.inventory.current
        dynamic = [gpu for gpu in inventory.gpus if self.gpus.selects(gpu)] if inventory else []
        if not dynamic:  # no series where no GPU is dynamic
            return
        family = Family("gpud_mig_dynamic_instances", "MIG devices DRA claims hold, per dynamic MIG GPU.", "gauge")
        for gpu in dynamic:
            family.add({"gpu": str(gpu.index), "UUID": gpu.uuid, "hostname": HOSTNAME},
                       sum(r.gpu_uuid == gpu.uuid for r in self.records.records))
        yield family

    async def prepare(self, claim: str, wanted: tuple[WantedDevice, ...]) -> dict:
        """Makes the claim's MIG devices; the same again answers what was made, changing nothing."""
        self._refuse_until_converged()
        held = self.records.of_claim(claim)
        if held:
            if sorted(r.key for r in held) != sorted(w.key for w in wanted):
                raise GpudError(ErrorKind.CONFLICT, "dynamic-claim-differs",
                                f"DRA claim {claim} already holds other dynamic MIG devices "
                                f"({_keys(r.key for r in held)}); unprepare it first",
                                held=[r.document() for r in held])
            if all(r.state == RecordState.PRESENT for r in held):
                return claim_answer(claim, wanted, held, self.inventory.current)
        self._operations.claim(Operation.DYNAMIC_MIG, claim=claim)
        try:
            inventory = await self._refreshed(f"dynamic MIG devices of claim {claim}")
            if held:  # a start that could not finish them: once more
                await self._converge_gpus(inventory, {r.gpu_uuid for r in held})
            else:
                await self._make(claim, wanted, inventory)
            inventory = await self._refreshed(f"dynamic MIG devices of claim {claim} made")
            self._instances.note_uuids(inventory)
        finally:
            self._operations.release()
        held = self.records.of_claim(claim)
        if not all(r.state == RecordState.PRESENT for r in held):
            raise GpudError(ErrorKind.FAILED, "dynamic-mig-failed", "; ".join(self._problems)
                            or f"the dynamic MIG devices of DRA claim {claim} could not be made")
        await self._files_current(f"dynamic MIG devices of claim {claim}")
        return claim_answer(claim, wanted, held, inventory)

    async def unprepare(self, claim: str) -> dict:
        """Destroys the claim's MIG devices; a claim with none answers an empty list."""
        self._refuse_until_converged()
        held = self.records.of_claim(claim)
        if not held:
            return {"claim": claim, "destroyed": []}
        self._operations.claim(Operation.DYNAMIC_MIG, claim=claim)
        try:
            inventory = await self._refreshed(f"dynamic MIG devices of claim {claim} released")
            busy = [(r, gpu, ci) for r in held if (gpu := _gpu(inventory, r.gpu_uuid)) is not None
                    and (gi := find_instance(gpu, r)) is not None for ci in gi.compute_instances if ci.pids]
            if busy:
                names = process_names(self._processes)
                raise GpudError(ErrorKind.CONFLICT, "instance-in-use",
                                "; ".join(f"MIG device {ci.uuid} of DRA claim {claim} on GPU {gpu.index} runs "
                                          f"{pids_line(ci.pids, names)}" for _, gpu, ci in busy)
                                + ": nothing was destroyed; try again once they ended",
                                busy=[{"uuid": ci.uuid, "gpu": gpu.index, "pids": list(ci.pids)}
                                      for _, gpu, ci in busy])
            destroyed = []
            for record in held:
                uuid = await self._instances.destroy(inventory, record)
                destroyed.append(uuid or record.uuid)
            await self._modes_off(await self._refreshed("dynamic MIG devices destroyed"), {r.gpu_uuid for r in held})
            self._instances.note_uuids(await self._refreshed(f"dynamic MIG devices of claim {claim} destroyed"))
        finally:
            self._operations.release()
        await self._files_current(f"dynamic MIG devices of claim {claim} destroyed")
        log.info("dynamic_mig_claim_released", claim=claim, destroyed=destroyed)
        return {"claim": claim, "destroyed": [uuid for uuid in destroyed if uuid]}

    async def _make(self, claim: str, wanted: tuple[WantedDevice, ...], inventory: Inventory) -> None:
        planned = planned_devices(wanted, inventory, self.gpus, self.records.records)
        await self._mode.refuse_busy(sorted({gpu.uuid: gpu for gpu, _, _ in planned}.values(), key=lambda g: g.index),
                                     process_names(self._processes))
        records = [DynamicRecord(claim, gpu.uuid, profile.id, placement, profile.name, RecordState.CREATING)
                   for gpu, profile, placement in planned]
        self.records.put(*records)  # before the first change: a crash from here on converges at start
        in_mode: dict[str, Gpu] = {}  # each GPU as read once in MIG mode
        switched_on: set[str] = set()
        try:
            for record, (gpu, profile, _placement) in zip(records, planned):
                if gpu.uuid not in in_mode:
                    if gpu.mig.mode != "enabled":
                        switched_on.add(gpu.uuid)
                    in_mode[gpu.uuid] = await self._mode.enable(gpu, self.inventory)
                gi_id, ci_id = await self._instances.create(in_mode[gpu.uuid], profile, record.placement)
                self.records.put(record.made(gi_id, ci_id, None))
            log.info("dynamic_mig_claim_prepared", claim=claim,
                     devices=[f"GPU {gpu.index} {profile.name} at {placement.start}"
                              for gpu, profile, placement in planned])
        except Exception as exc:
            await self._undo(claim, records, switched_on)
            if isinstance(exc, GpudError):
                raise
            raise GpudError(ErrorKind.FAILED, "dynamic-mig-failed",
                            f"making the MIG devices of DRA claim {claim} failed: {describe_error(exc)}; what this "
                            "request made was undone") from None

    async def _undo(self, claim: str, records: list[DynamicRecord], switched_on: set[str]) -> None:
        """Takes back what a failed prepare made: its instances, its records, the MIG mode it switched on."""
        try:
            inventory = await self._refreshed(f"dynamic MIG devices of claim {claim} failed")
            for record in records:
                await self._instances.destroy(inventory, record)
            await self._modes_off(await self._refreshed("dynamic MIG failure undone"), switched_on)
            log.warning("dynamic_mig_claim_undone", claim=claim, devices=len(records))
        except Exception as exc:  # the records stay: start-up convergence finishes the undo or the make
            self._problems.append(f"undoing the failed dynamic MIG devices of DRA claim {claim} failed: "
                                  f"{describe_error(exc)}")
            log.error("dynamic_mig_undo_failed", claim=claim, error=describe_error(exc))

    async def _modes_off(self, inventory: Inventory, uuids: set[str]) -> None:
        """GPUs left with no instance leave MIG mode where that needs no reset: the whole GPU is usable again."""
        for gpu in inventory.gpus:
            if gpu.uuid in uuids and not any(r.gpu_uuid == gpu.uuid for r in self.records.records):
                await self._mode.disable_if_idle(gpu)

    # -- start-up convergence ----------------------------------------------------------------------

    async def converge(self) -> None:
        """Brings each dynamic GPU to its records: a crash's creating record made (or adopted), a present one
        a reset destroyed made again, a destroying one finished; instances no record names destroyed,
        unless processes run on them (kept and reported)."""
        inventory = self.inventory.current
        if inventory is None:
            return
        dynamic = self.gpus.uuids(inventory)
        stray = [r for r in self.records.records if r.gpu_uuid not in dynamic]
        self._problems = [f"dynamic MIG device of DRA claim {r.claim} on GPU {r.gpu_uuid}: the GPU is no longer "
                          f"selected by {SETTING} (or gone); its record is kept, the GPU left as it is" for r in stray]
        if not any(r.gpu_uuid in dynamic for r in self.records.records) and \
                not any(gpu.mig.mode == "enabled" for gpu in inventory.gpus if gpu.uuid in dynamic):
            return  # nothing recorded, no instance: nothing to converge (and the node is not held for nothing)
        self._operations.claim(Operation.DYNAMIC_MIG)
        try:
            inventory = await self._refreshed("dynamic MIG convergence")
            await self._converge_gpus(inventory, dynamic)
            self._instances.note_uuids(await self._refreshed("dynamic MIG converged"))
        finally:
            self._operations.release()
        await self._files_current("dynamic MIG converged")

    async def _converge_gpus(self, inventory: Inventory, uuids: set[str] | frozenset[str]) -> None:
        for gpu in inventory.gpus:
            if gpu.uuid not in uuids:
                continue
            for record in [r for r in self.records.records if r.gpu_uuid == gpu.uuid]:
                try:
                    await self._converge_record(record)
                except Exception as exc:
                    self._problems.append(f"dynamic MIG device of DRA claim {record.claim} on GPU {gpu.index} "
                                          f"({record.profile} at {record.placement.start}) could not be converged: "
                                          f"{describe_error(exc)}")
                    log.error("dynamic_mig_converge_failed", claim=record.claim, gpu=gpu.index,
                              error=describe_error(exc))
            await self._unrecorded(_gpu(await self._refreshed("dynamic MIG records converged"), gpu.uuid))

    async def _converge_record(self, record: DynamicRecord) -> None:
        inventory = await self._refreshed(f"dynamic MIG device of claim {record.claim}")
        gpu = _gpu(inventory, record.gpu_uuid)
        if record.state == RecordState.DESTROYING:
            await self._instances.destroy(inventory, record)
            log.warning("dynamic_mig_destroy_finished", claim=record.claim, gpu=gpu.index, profile=record.profile)
            await self._modes_off(await self._refreshed("dynamic MIG destroy finished"), {gpu.uuid})
            return
        profile = gpu.mig.capabilities.gi_profile_by_id(record.gi_profile_id)
        gi = find_instance(gpu, record)
        if gi is not None:
            ci_id = gi.compute_instances[0].ci_id if gi.compute_instances else \
                await self._instances.whole_ci(gpu, profile, gi.gi_id, undo_gi=False)
            self.records.put(record.made(gi.gi_id, ci_id, record.uuid))
            if record.state == RecordState.CREATING:
                log.warning("dynamic_mig_instance_adopted", claim=record.claim, gpu=gpu.index, gi_id=gi.gi_id)
            return
        gpu = await self._mode.enable(gpu, self.inventory)
        gi_id, ci_id = await self._instances.create(gpu, profile, record.placement)
        self.records.put(record.made(gi_id, ci_id, None))
        if record.state == RecordState.PRESENT:  # a GPU reset destroyed it: the claim's device has a new UUID
            log.warning("dynamic_mig_instance_recreated", claim=record.claim, gpu=gpu.index, profile=record.profile,
                        old_uuid=record.uuid, why="gone from the GPU (a GPU reset destroys every MIG instance); "
                                                  "its MIG UUID changes")
        else:
            log.info("dynamic_mig_create_finished", claim=record.claim, gpu=gpu.index, profile=record.profile)

    async def _unrecorded(self, gpu: Gpu | None) -> None:
        if gpu is not None:
            self._problems += await self._instances.destroy_unrecorded(gpu, process_names(self._processes))
            await self._modes_off(await self._refreshed("dynamic MIG unrecorded instances"), {gpu.uuid})

    def _refuse_until_converged(self) -> None:
        """A crash's half-made devices are settled first: a claim answered from their records would be wrong."""
        if not self.converged:
            raise GpudError(ErrorKind.UNAVAILABLE, "starting",
                            "gpud is starting: its dynamic MIG devices are not converged yet; try again shortly")

    async def _refreshed(self, reason: str) -> Inventory:
        inventory = await self.inventory.refresh(reason)
        if inventory is None:
            raise nvml_unavailable(self.session.error or "no inventory yet")
        return inventory


def _gpu(inventory: Inventory, uuid: str) -> Gpu | None:
    return next((gpu for gpu in inventory.gpus if gpu.uuid == uuid), None)


def _keys(keys) -> str:
    return ", ".join(f"GPU {gpu} profile {profile} at {start}" for gpu, profile, start in sorted(keys))
