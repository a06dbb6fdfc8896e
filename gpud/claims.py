"""The GPUs and MIG devices Kubernetes DRA claims hold on this node, as `gpud dra-plugin` reports them
(PUT/DELETE /v1/claims/{uid}): gpud is the node's one owner of its GPUs, so a device a claim holds is
refused to the device plugin's pods (and shown Unhealthy to the kubelet there), and a device the device
plugin handed out is refused to a claim by the DRA plugin (it reads the kubelet's PodResources). A claim
that shares its devices through MPS gets gpud's own supervised MPS daemon for each (per-client limits,
kept across gpud restarts, as gpu_memory's are); one that time-slices with an interval has it set on its
GPUs, as NVIDIA's DRA driver does (nvidia-smi compute-policy --set-timeslice, cmd/gpu-kubelet-plugin
sharing.go). Kept in the state directory with the boot id: a restart of gpud keeps every hold, a
reboot drops them all (the kubelet prepares its pods' claims again, and the plugin drops its own record
of an earlier boot the same way). Written atomically but without fsync: a power loss is a reboot.

A GPU of `dra.shared_gpus` is shared with counted memory (KEP-5075 consumable capacity): every claim on it
holds the memory and compute percentage its allocation consumed (its MPS client limits), and the memory
is counted in one ledger with gpu_memory's units (gpud/sharing/gpu_memory.py), so no MiB is promised twice.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from gpud.base.errors import ErrorKind, GpudError
from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile, read_json, write_failed, write_json_atomic
from gpud.config import DraConfig
from gpud.inventory import InventoryService
from gpud.model.inventory import Gpu, Inventory
from gpud.model.mps import daemon_name
from gpud.sharing.gpu_memory import ClaimedMemory, GpuMemory, PromisedMemory
from gpud.sharing.resources import Device

log = get_logger("claims")

# Every hold is checked against the others and the whole list saved on each change, on the event loop: the
# count is bounded well above a node's (the kubelet's default is 110 pods, each with a few claims).
MAX_CLAIMS = 1024


@dataclass(frozen=True)
class Share:
    """What a claim consumed of a shared GPU (its allocation's consumedCapacity): its MPS client limits."""

    memory_mib: int
    compute_percent: int  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: the claims' sum may pass 100 (MPS allows it)


@dataclass(frozen=True)
class Hold:
    uid: str
    namespace: str
    name: str
    driver: str
    devices: tuple[str, ...]  # GPU or MIG UUIDs
    strategy: str | None = None  # None: exclusive; TimeSlicing | MPS: shared with claims that share too
    interval: str | None = None  # TimeSlicing's, if asked
    held_since: float = 0.0
    capacity: Mapping[str, Share] = field(default_factory=dict)  # device UUID -> its share (dra.shared_gpus)

    def describe(self) -> str:
        return f"DRA claim {self.namespace}/{self.name} ({self.uid})"


def _hold(document: dict) -> Hold:
    capacity = {str(uuid): Share(int(share["memory_mib"]), int(share["compute_percent"]))
                for uuid, share in (document.get("capacity") or {}).items()}
    return Hold(str(document["uid"]), str(document["namespace"]), str(document["name"]), str(document["driver"]),
                tuple(str(d) for d in document["devices"]), document.get("strategy"), document.get("interval"),
                float(document.get("held_since", 0.0)), capacity)


def _gpu_of(inventory: Inventory, uuid: str):
    """(GPU, MIG device or None) of a UUID that can be handed out: a GPU not in MIG mode, or a MIG device."""
    for gpu in inventory.gpus:
        if gpu.uuid == uuid and gpu.mig.mode != "enabled" and not gpu.lost:
            return gpu, None
        for mig in gpu.mig.devices if gpu.mig.mode == "enabled" else ():
            if mig.uuid == uuid:
                return gpu, mig
    return None


def shared_gpus(dra: DraConfig, inventory: Inventory) -> list[Gpu]:
    """The GPUs `dra.shared_gpus` selects: by index or UUID, or every one ("all"), outside MIG mode."""
    selectors = {str(selector) for selector in dra.shared_gpus}
    return [gpu for gpu in inventory.gpus if gpu.mig.mode != "enabled" and not gpu.lost
            and ("all" in selectors or str(gpu.index) in selectors or gpu.uuid in selectors)]


class ClaimRegistry(Component):
    name = "claims"

    def __init__(self, path: Path, inventory: InventoryService, boot_id: Callable[[], str],
                 notify: Callable[[str, dict], object] = lambda kind, data: None,
                 converge_mps: Callable[[str], Awaitable[None]] | None = None,
                 set_time_slice: Callable[[list[int], str], Awaitable[str | None]] | None = None, *,
                 gpu_memory: GpuMemory, dra: DraConfig = DraConfig()):
        self.path = path
        self.inventory = inventory
        self.dra = dra
        self._gpu_memory = gpu_memory  # the other path's units, in one ledger with the claims' memory
        self._notify = notify
        self._converge_mps = converge_mps  # brings gpud's MPS daemons to the claims held
        self._set_time_slice = set_time_slice  # (GPU indices, interval) -> why it failed, or None
        self._boot_id = boot_id  # the node's boot id, read when needed: a simulated node's exists once NVML is up
        self.corrupt_files: list[CorruptFile] = []
        self._saved_boot: str | None = None
        self.holds: dict[str, Hold] = {}

    async def start(self, tasks: Tasks) -> None:
        saved, corrupt = read_json(self.path, lambda d: (d.get("boot_id"), {h["uid"]: _hold(h) for h in d["claims"]}))
        self.corrupt_files = [corrupt] if corrupt else []
        self._saved_boot, self.holds = saved or (None, {})

    async def start_with_gpus(self, tasks: Tasks) -> None:
        """The node's boot id is known now (a simulated node's once NVML is up)."""
        self.drop_earlier_boots()

    def problems(self) -> list[str]:
        return [file.message() for file in self.corrupt_files]

    def drop_earlier_boots(self) -> None:
        """Drops the holds saved in another boot than this one."""
        now = self._boot_id()
        if self.holds and self._saved_boot != now:
            log.info("claims_of_an_earlier_boot_dropped", claims=len(self.holds), saved_boot_id=self._saved_boot,
                     boot_id=now)
            self.holds = {}

    # -- what others ask -------------------------------------------------------------------------

    def holder_of(self, uuid: str) -> Hold | None:
        return next((h for h in self.holds.values() if uuid in h.devices), None)

    def mps_devices(self, inventory: Inventory) -> frozenset[str]:
        """Devices a claim shares through MPS, and the shared GPUs (whose claims' limits are their capacity,
        so their daemons are up before a claim comes, as gpu_memory's are): each gets a daemon with
        per-client limits (MpsManager)."""
        return frozenset(d for h in self.holds.values() if h.strategy == "MPS" for d in h.devices) | frozenset(
            gpu.uuid for gpu in shared_gpus(self.dra, inventory))

    def claimed_memory(self) -> dict[str, tuple[ClaimedMemory, ...]]:
        """Device UUID -> the memory the claims hold on it (gpu_memory's ledger)."""
        claimed: dict[str, tuple[ClaimedMemory, ...]] = {}
        for hold in sorted(self.holds.values(), key=lambda h: h.held_since):
            for uuid, share in hold.capacity.items():
                claimed[uuid] = claimed.get(uuid, ()) + (
                    ClaimedMemory(hold.uid, hold.namespace, hold.name, share.memory_mib),)
        return claimed

    def view(self) -> dict:
        inventory = self.inventory.current
        return {"claims": [self._claim_view(h, inventory) for h in sorted(self.holds.values(), key=lambda h: h.held_since)],
                "shares": self._shares_view(inventory)}

    def _shares_view(self, inventory: Inventory | None) -> dict:
        """The request policies the DRA plugin publishes the shared GPUs with, and each one's ledger."""
        memory, compute = self.dra.share_memory, self.dra.share_compute
        gpus = []
        claimed = self.claimed_memory()
        for gpu in shared_gpus(self.dra, inventory) if inventory is not None else ():
            ledger = self._ledger(gpu, claimed.get(gpu.uuid, ()))
            gpus.append({"uuid": gpu.uuid, "index": gpu.index, "offered_mib": ledger.offered_mib,
                         "claims_mib": ledger.claims_mib, "gpu_memory_mib": ledger.gpu_memory_mib,
                         "free_mib": ledger.free_mib, "claims": [claim.uid for claim in ledger.claims]})
        return {"policy": {"memory": {"default": memory.default, "min": memory.min, "step": memory.step},
                           "compute": {"default": compute.default, "min": compute.min, "step": compute.step}},
                "gpus": gpus}

    def _ledger(self, gpu: Gpu, claims: tuple[ClaimedMemory, ...]) -> PromisedMemory:
        return self._gpu_memory.promised(Device(gpu), claims)

    def _claim_view(self, hold: Hold, inventory: Inventory | None) -> dict:
        view = asdict(hold)
        view["devices"] = []
        for uuid in hold.devices:
            found = _gpu_of(inventory, uuid) if inventory is not None else None
            gpu, mig = found if found else (None, None)
            view["devices"].append({
                "uuid": uuid, "gpu_uuid": gpu.uuid if gpu else None, "gpu_index": gpu.index if gpu else None,
                "mps_daemon": daemon_name(gpu, mig) if gpu is not None and hold.strategy == "MPS" else None})
        return view

    # -- holding and releasing -------------------------------------------------------------------

    async def hold(self, wanted: Hold) -> dict:
        """PUT /v1/claims/{uid}: the claim holds these devices (the same again: nothing changes)."""
        hold = self._checked(wanted)
        uid = hold.uid
        previous = self.holds.get(uid)
        if previous is not None and (previous.devices, previous.strategy, previous.interval, previous.capacity) == (
                hold.devices, hold.strategy, hold.interval, hold.capacity):
            return self._claim_view(previous, self.inventory.current)
        if previous is None and len(self.holds) >= MAX_CLAIMS:
            raise GpudError(ErrorKind.CONFLICT, "too-many-claims", f"gpud keeps at most {MAX_CLAIMS} claims")
        inventory = self.inventory.current
        if hold.interval is not None and self._set_time_slice is not None and inventory is not None:
            indices = sorted({_gpu_of(inventory, d)[0].index for d in hold.devices})
            failed = await self._set_time_slice(indices, hold.interval)
            if failed:
                raise GpudError(ErrorKind.TOOL_FAILED, "time-slice-not-set",
                                f"the time-slice interval {hold.interval} could not be "
                                f"set on GPUs {indices}: {failed}")
        self.holds[uid] = hold
        self._save(f"claim {uid}")
        log.info("claim_held", claim=hold.describe(), devices=list(hold.devices), strategy=hold.strategy,
                 memory_mib={uuid: share.memory_mib for uuid, share in hold.capacity.items()})
        self._notify("claims", {"uid": uid, "held": True, "devices": list(hold.devices)})
        if hold.strategy == "MPS" or (previous is not None and previous.strategy == "MPS"):
            await self._mps_changed(f"DRA claim {uid}")
        return self._claim_view(hold, inventory)

    async def release(self, uid: str) -> dict:
        """DELETE /v1/claims/{uid}: idempotent; an unknown claim is released already."""
        hold = self.holds.pop(uid, None)
        if hold is None:
            return {"uid": uid, "released": False}
        try:
            self._save(f"the release of claim {uid}")
        except GpudError:
            self.holds[uid] = hold
            raise
        log.info("claim_released", claim=hold.describe(), devices=list(hold.devices))
        self._notify("claims", {"uid": uid, "held": False, "devices": list(hold.devices)})
        if hold.strategy == "MPS":
            await self._mps_changed(f"DRA claim {uid} released")
        return {"uid": uid, "released": True}

    async def _mps_changed(self, why: str) -> None:
        if self._converge_mps is not None:
            await self._converge_mps(why)

    def _save(self, what: str) -> None:
        try:
            write_json_atomic(self.path, {"boot_id": self._boot_id(), "claims": [asdict(h) for h in self.holds.values()]},
                              durable=False)
        except OSError as exc:
            raise write_failed(self.path, exc, what) from None

    def _checked(self, wanted: Hold) -> Hold:
        """The hold `wanted` (its fields checked by the API) as it would be now: refused without an
        inventory, for a device not on this node, or for one another claim holds and does not share."""
        inventory = self.inventory.current
        if inventory is None:
            raise GpudError(ErrorKind.UNAVAILABLE, "no-inventory", "gpud has not read the GPUs yet")
        unknown = [d for d in wanted.devices if _gpu_of(inventory, d) is None]
        if unknown:
            raise GpudError(ErrorKind.REFUSED, "unknown-device",
                            f"no GPU (outside MIG mode) or MIG device {unknown[0][:80]!r} on "
                            "this node (GET /v1/gpus)")
        hold = replace(wanted, devices=tuple(dict.fromkeys(wanted.devices)), held_since=time.time())
        self._check_shares(hold, inventory)
        for other in self.holds.values():
            shared = hold.strategy is not None and other.strategy == hold.strategy
            for device in hold.devices:
                # a GPU in MIG mode is never held whole (_gpu_of), so a MIG device and its GPU cannot both be
                if other.uid != hold.uid and device in other.devices and not shared:
                    raise GpudError(ErrorKind.CONFLICT, "device-held", f"device {device} is held by {other.describe()}",
                                    holder={"namespace": other.namespace, "name": other.name, "uid": other.uid})
        return hold

    def _check_shares(self, hold: Hold, inventory: Inventory) -> None:
        """A share (a hold with capacity) only of shared GPUs, a shared GPU only by shares, and each shared
        GPU's memory promised at most once over: the claims' memory and gpu_memory's units at most what it
        offers. Compute is not counted: MPS lets the active thread percentages of clients add up past 100
        (NVIDIA's MPS documentation, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)."""
        shared = {gpu.uuid: gpu for gpu in shared_gpus(self.dra, inventory)}
        for uuid in hold.devices:
            if uuid in hold.capacity and uuid not in shared:
                raise GpudError(ErrorKind.CONFLICT, "gpu-not-shared",
                                f"device {uuid} is not shared with counted memory (gpud.yaml dra.shared_gpus): "
                                "a claim holds it without capacity", device=uuid)
            if uuid in shared and uuid not in hold.capacity:
                raise GpudError(ErrorKind.CONFLICT, "gpu-shared",
                                f"GPU {shared[uuid].index} ({uuid}) is shared with counted memory (gpud.yaml "
                                "dra.shared_gpus): a claim holds it with capacity (memory and compute)", device=uuid)
        claimed = self.claimed_memory()
        previous = self.holds.get(hold.uid)
        for uuid, share in hold.capacity.items():
            held = previous.capacity.get(uuid) if previous is not None else None
            if held is not None and share.memory_mib <= held.memory_mib:
                continue  # held already: a Prepare asked again is answered as before, even on an overcommitted GPU
            others = tuple(claim for claim in claimed.get(uuid, ()) if claim.uid != hold.uid)
            ledger = self._ledger(shared[uuid], others)
            if share.memory_mib > ledger.free_mib:
                raise GpudError(ErrorKind.CONFLICT, "memory-overcommitted",
                                f"GPU {shared[uuid].index} ({uuid}) has {max(ledger.free_mib, 0)} MiB free of the "
                                f"{ledger.offered_mib} MiB it offers, {share.memory_mib} MiB asked; the rest is "
                                f"held by {ledger.holders()}", device=uuid, free_mib=max(ledger.free_mib, 0),
                                offered_mib=ledger.offered_mib)
