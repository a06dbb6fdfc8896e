"""GPU resets as real drivers accept them.

`nvidia-smi -r` is refused while anything holds the GPU: CUDA processes, monitoring tools (DCGM,
another nvidia-smi, gpud's own NVML session and event sets), nvidia-persistenced, MPS servers, the
nvidia_drm module (nvidia-smi(1) under -r/--gpu-reset). GPUs joined by direct NVLink go in the same
command (gpud.nvml.reset). So a reset here is: find the GPUs that go together; check every one of
them for blockers and refuse before changing anything, then refuse it to a gpud that is not root
(nvidia-smi(1), -r: "Requires root"); stop gpud's own MPS daemons there; shut
gpud's NVML session down; reset; bring NVML back, re-read the node, put back the MIG instances a
reset destroys, tell health what a reset clears, restart MPS. A reset holds the node's operations
lock (gpud.node_operations): no MIG apply runs meanwhile, and an apply that needs a reset runs it
inside its own hold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from gpud.base.errors import ErrorKind, GpudError, nvml_unavailable
from gpud.base.logs import get_logger
from gpud.inventory import InventoryService
from gpud.model.inventory import Gpu, Inventory
from gpud.node_operations import NodeOperations, Operation
from gpud.nvml.host_tools import HostTools, ResetFailed, SimHostTools
from gpud.nvml.privileges import refuse_unless_root
from gpud.nvml.reset import compute_pids, read_topology
from gpud.nvml.session import NvmlSession, NvmlUnavailable

log = get_logger("reset")

GpuHook = Callable[[str], Awaitable[None]]
# Runs after a reset, before gpud's MPS daemons start again: (the GPUs reset, the node re-read after it).
Restore = Callable[[tuple[Gpu, ...], Inventory], Awaitable[None]]


@dataclass(frozen=True)
class Blocker:
    gpu: int
    uuid: str
    reason: str  # one line: who blocks and what to do

    def as_dict(self) -> dict:
        return {"gpu": self.gpu, "uuid": self.uuid, "reason": self.reason}


class ResetBlocked(GpudError):
    """Something holds a GPU that must be reset: nothing was changed. str() is the refusal alone, for a
    sentence of its own (a MIG apply's, health's auto-reset)."""

    def __init__(self, blockers: list[Blocker], group: tuple[int, ...], requested: tuple[int, ...]):
        peers = [index for index in group if index not in requested]
        together = f" (NVLink peers {', '.join(map(str, peers))} must be reset in the same command)" if peers else ""
        self.refusal = (f"a GPU reset would be refused{together}: "
                        + "; ".join(f"GPU {b.gpu}: {b.reason}" for b in blockers))
        super().__init__(ErrorKind.CONFLICT, "reset-blocked", f"{self.refusal}. Nothing was changed",
                         blockers=[b.as_dict() for b in blockers], reset_gpus=list(group))
        self.blockers, self.group = blockers, group

    def __str__(self) -> str:
        return self.refusal


@dataclass
class ResetOutcome:
    requested: tuple[int, ...]
    gpus: tuple[int, ...]  # every GPU reset: the requested ones and their NVLink peers
    output: str  # what the reset tool said
    ended_pids: dict[str, list[int]] = field(default_factory=dict)  # device UUID -> compute processes ended
    cleared: list[dict] = field(default_factory=list)  # health reasons the reset took away

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(index for index in self.gpus if index not in self.requested)

    def as_dict(self) -> dict:
        return {"requested": list(self.requested), "reset": list(self.gpus), "peers": list(self.peers),
                "output": self.output, "ended_processes": self.ended_pids, "cleared": self.cleared}


class GpuResetter:
    def __init__(self, session: NvmlSession, inventory: InventoryService, host: HostTools | SimHostTools,
                 operations: NodeOperations, *, own_pids: Callable[[], Collection[int]],
                 around: tuple[GpuHook, GpuHook] | None = None,
                 health_reasons: Callable[[], dict[str, list[dict]]] = dict,
                 on_gpu_reset: Callable[[str], object] = lambda uuid: None, restore: Restore | None = None):
        self.session = session
        self.inventory = inventory
        self.host = host
        self._operations = operations
        self._own_pids = own_pids  # gpud and the MPS daemons it started: they go away for the reset
        self._around = around  # stops gpud's MPS daemons on a GPU, and starts them again
        self._health_reasons = health_reasons  # device UUID -> its health reasons now
        self._on_gpu_reset = on_gpu_reset  # health clears what a reset clears
        self._restore = restore  # the MIG instances a reset destroyed come back (gpud.mig.instances)

    async def group(self, targets: Collection[int], inventory: Inventory) -> tuple[tuple[Gpu, ...], bool]:
        """The targets and the NVLink peers that must be reset with them, in index order, and
        whether each of them could be reset on its own (gpud.nvml.reset)."""
        known = {gpu.index: (gpu.pci_bus_id, gpu.architecture) for gpu in inventory.gpus}
        topology = await self.session.call(read_topology, known)
        fabric_manager = await asyncio.to_thread(self.host.fabric_manager_running) \
            if topology.asks_fabric_manager() else True
        group = topology.group(targets, fabric_manager)
        return tuple(g for g in inventory.gpus if g.index in group), topology.individually(group, fabric_manager)

    async def preflight(self, targets: Collection[int], inventory: Inventory, *,
                        force: bool = False) -> tuple[tuple[Gpu, ...], list[Blocker]]:
        """The GPUs the reset takes, and what would make it fail now. With force, compute processes
        on those GPUs are not blockers: gpud ends them. Other holders, and processes on GPUs the
        reset does not take, are never ended by gpud: they are services and work an operator runs."""
        gpus, individually = await self.group(targets, inventory)
        found = []
        exclude = set(self._own_pids())
        # A reset that cannot go GPU by GPU needs every GPU of the system free of compute processes.
        for gpu in gpus if individually else inventory.gpus:
            pids = await self.session.call(compute_pids, gpu.index)
            if pids and not (force and gpu in gpus):
                found.append(Blocker(gpu.index, gpu.uuid, _processes_line(gpu, pids, gpu in gpus)))
        for gpu in gpus:
            for line in await asyncio.to_thread(self.host.blockers, gpu, exclude):
                found.append(Blocker(gpu.index, gpu.uuid, line))
        return gpus, sorted(found, key=lambda b: b.gpu)

    async def reset_gpus(self, indices: list[int], *, force: bool = False, why: str = "asked through the API",
                         trying: Callable[[], None] | None = None) -> ResetOutcome:
        """A GPU reset asked for through the API (or by health.auto_reset): the GPUs with their NVLink
        peers, MIG instances brought back afterwards (a reset destroys every one). Refused with
        OperationInProgress (409) while a MIG apply or another reset holds the node. trying: called once
        nothing refuses the reset, before it is tried (a remediation draws its reset budget there; a
        GpudError it raises refuses the reset, nothing changed)."""
        self._operations.claim(Operation.RESET, gpus=sorted(indices))
        try:
            return await self.reset(indices, why, force=force, restore=self._restore, trying=trying)
        except NvmlUnavailable as exc:
            raise nvml_unavailable(str(exc)) from None
        finally:
            self._operations.release()

    async def reset_gpu(self, index: int, why: str) -> ResetOutcome:
        """health.auto_reset's reset of one GPU (with the peers it must be reset with)."""
        return await self.reset_gpus([index], why=why)

    async def reset(self, targets: Collection[int], why: str, *, force: bool = False,
                    restore: Restore | None = None, trying: Callable[[], None] | None = None) -> ResetOutcome:
        """Resets the targets with their NVLink peers, or raises ResetBlocked having changed nothing.
        The caller holds the node's operations lock (reset_gpus, or a MIG apply).

        restore runs after the reset, before gpud's MPS daemons start again (MIG instances come
        back there). ResetFailed when the reset tool refused or failed; NVML is back either way.
        """
        inventory = await self.inventory.refresh("gpu reset requested")
        if inventory is None:
            raise NvmlUnavailable(self.session.error or "no inventory yet: NVML is not available")
        gpus, blockers = await self.preflight(targets, inventory, force=force)
        if blockers:
            log.warning("gpu_reset_refused", gpus=[g.index for g in gpus], why=why,
                        blockers=[f"GPU {b.gpu}: {b.reason}" for b in blockers])
            raise ResetBlocked(blockers, tuple(g.index for g in gpus), tuple(targets))
        # After the blockers, which the operator must free whoever runs gpud; before any change.
        refuse_unless_root("reset", f"resetting GPU {', '.join(str(g.index) for g in gpus)} would fail with "
                                    "Insufficient Permissions. Nothing was changed")
        if trying is not None:
            trying()
        outcome = ResetOutcome(requested=tuple(sorted(targets)), gpus=tuple(g.index for g in gpus), output="")
        if force:
            outcome.ended_pids = await self._end_compute_processes(gpus)
        await self._each(gpus, 0)
        before = self._health_reasons()
        try:
            # The instances a reset destroys come back with restore: until then no file kept for others
            # is written from the snapshots without them (slurmd would register fewer GPUs).
            with self.inventory.in_transition(f"a reset of GPUs {', '.join(str(g.index) for g in gpus)}"):
                outcome.output, after = await self._reset_released(gpus, why)
                for gpu in gpus:
                    self.after_gpu_reset(gpu.uuid)
                if restore is not None:
                    await restore(gpus, after)
        finally:
            await self._each(gpus, 1)
        outcome.cleared = _cleared(before, self._health_reasons())
        for gpu in gpus:
            log.warning("gpu_reset", gpu=gpu.index, uuid=gpu.uuid, bus_id=gpu.pci_bus_id, why=why,
                        together_with=[g.index for g in gpus if g.index != gpu.index],
                        nvlink_peer=gpu.index in outcome.peers)
        return outcome

    def after_gpu_reset(self, uuid: str) -> None:
        """A GPU was reset, by gpud or by the driver (a MIG mode change on an idle Ampere GPU)."""
        self._on_gpu_reset(uuid)

    async def _reset_released(self, gpus: tuple[Gpu, ...], why: str) -> tuple[str, Inventory]:
        """The reset, with gpud's NVML session shut down: its own handles and event sets would
        make the driver refuse (nvidia-smi(1): no monitoring application may use the GPU)."""
        try:
            async with self.session.released(why):
                output = await asyncio.to_thread(self.host.reset, gpus)
        except ResetFailed as exc:
            log.error("gpu_reset_failed", gpus=[g.index for g in gpus], why=why, error=str(exc))
            await self.inventory.refresh("gpu reset failed")
            raise
        return output, await self.inventory.refresh("gpu reset")

    async def _end_compute_processes(self, gpus: tuple[Gpu, ...]) -> dict[str, list[int]]:
        """Forced reset: the compute processes go first (per MIG device on a GPU in MIG mode)."""
        ended = {}
        for gpu in gpus:
            devices = [(d.uuid, d.pids) for d in gpu.mig.devices if d.pids] if gpu.mig.mode == "enabled" else []
            if not devices:
                pids = await self.session.call(compute_pids, gpu.index)
                devices = [(gpu.uuid, pids)] if pids else []
            for uuid, pids in devices:
                log.warning("gpu_reset_processes_ended", gpu=gpu.index, device=uuid, pids=list(pids),
                            why="forced reset")
                await asyncio.to_thread(self.host.end_processes, uuid, pids)
                ended[uuid] = list(pids)
        return ended

    async def _each(self, gpus: tuple[Gpu, ...], which: int) -> None:
        if self._around:
            for gpu in gpus:
                await self._around[which](gpu.uuid)


def _processes_line(gpu: Gpu, pids: tuple[int, ...], in_reset: bool) -> str:
    where = [f"MIG device {d.uuid} (GI {d.gi_id}, CI {d.ci_id}) runs PIDs {', '.join(map(str, d.pids))}"
             for d in gpu.mig.devices if d.pids]
    detail = "; ".join(where) if where else f"compute processes {', '.join(map(str, pids))} run on it"
    if not in_reset:
        detail += (" (it is not reset, but NVLink ties the reset GPUs together, and such a reset needs every "
                   "GPU of the system free of compute processes)")
    return f"{detail}: stop them, or reset with force (gpud ends them: SIGTERM, then SIGKILL)"


def _cleared(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> list[dict]:
    """Reasons a device had before the reset and has no more."""
    cleared = []
    for device, reasons in before.items():
        still = {(r["kind"], r["code"]) for r in after.get(device, ())}
        cleared += [{"device": device, **_brief(r)} for r in reasons if (r["kind"], r["code"]) not in still]
    return cleared


def _brief(reason: dict[str, Any]) -> dict:
    return {key: reason[key] for key in ("kind", "code", "message", "severity", "action")}
