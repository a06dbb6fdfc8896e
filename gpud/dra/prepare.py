"""NodePrepareResources and NodeUnprepareResources for one claim, against the plugin's view of gpud (its
devices and CDI node spec) and its checkpoint. No I/O but the checkpoint and the claim's CDI spec: the
claim itself was read from the API server by the caller.

What the kubelet expects (k8s.io/dynamic-resource-allocation kubeletplugin draplugin.go, the DRAPlugin
interface): both calls idempotent; Prepare of a prepared claim answers the same devices; Unprepare of an
unknown claim is success; a device prepared for another claim is refused unless shared by design.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from gpud.base.logs import get_logger
from gpud.device_plugin.allocation import HOST_SHM
from gpud.dra.checkpoint import PREPARED, PREPARING, Checkpoint, PreparedClaim, PreparedDevice
from gpud.dra.claim_cdi import (CLAIM_UID, ClaimSpecError, cdi_device_id, claim_spec, remove_claim_spec, spec_path,
                                write_claim_spec)
from gpud.dra.config import MIG_CONFIG, MPS, ConfigError, DeviceConfig, Sharing, config_for, configs_by_request
from gpud.dra.devices import MIG_TYPE, PARTITION, SHARE, DraDevice
from gpud.dra.dynamic_claims import AllocationRefused, consumed, placements, refuse_overcommitted_counters
from gpud.dra.owner import GpudOwner, OwnerRefused, mps_limits

log = get_logger("dra_plugin")


class PrepareError(Exception):
    """The claim cannot be prepared: the message goes back to the kubelet (and the pod's events)."""


@dataclass(frozen=True)
class PoolView:
    """What the plugin last read of gpud: its devices by name, and gpud's CDI node spec (None: gpud
    writes none, or has not yet)."""

    devices: dict[str, DraDevice] = field(default_factory=dict)
    node_spec: dict | None = None


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


class Preparer:
    def __init__(self, driver: str, pool: str, cdi_dir: Path, checkpoint: Checkpoint, owner: GpudOwner | None = None):
        self.driver = driver
        self.pool = pool
        self.cdi_dir = cdi_dir
        self.checkpoint = checkpoint
        self.owner = owner  # None: no gpud to hold devices in (the prepare logic alone, as its tests run it)

    def prepared(self, uid: str) -> PreparedClaim | None:
        """The claim as prepared, if it is: recorded so, and its spec still there (a kill in the middle of an
        Unprepare leaves the record without the spec: it is prepared again)."""
        claim = self.checkpoint.claims.get(uid)
        if claim is None or claim.state != PREPARED or not spec_path(self.cdi_dir, self.driver, uid).exists():
            return None
        return claim

    def prepare(self, ref: ClaimRef, claim: dict, view: PoolView) -> PreparedClaim:
        """The claim's devices, prepared (its spec written, recorded), or PrepareError."""
        if not CLAIM_UID.fullmatch(ref.uid):
            raise PrepareError(f"claim {ref}: {ref.uid!r} is not a Kubernetes UID")
        done = self.prepared(ref.uid)
        if done is not None:
            return done  # the kubelet asked again (a retry after a timeout): the same answer
        uid = (claim.get("metadata") or {}).get("uid")
        if uid != ref.uid:
            raise PrepareError(f"claim {ref.namespace}/{ref.name} has UID {uid}, not {ref.uid}: it was deleted "
                               "and created again")
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            raise PrepareError(f"claim {ref} is not allocated")
        results = [r for r in (allocation.get("devices") or {}).get("results") or [] if r.get("driver") == self.driver]
        if not results:
            raise PrepareError(f"claim {ref} has no device of driver {self.driver}")
        try:
            configs = configs_by_request((allocation.get("devices") or {}).get("config") or [], self.driver)
        except ConfigError as exc:
            raise PrepareError(f"claim {ref}: {exc}") from None
        chosen: list[tuple[dict, DraDevice, DeviceConfig | None]] = []
        for result in results:
            device = self._device(ref, result, view)
            config = config_for(str(result.get("request", "")), configs)
            self._check_config(ref, device, config)
            chosen.append((result, device, config))
        capacity = self._consumed(ref, chosen)
        sharing = Sharing(MPS, mps={}) if capacity else _claim_sharing(ref, [config for _, _, config in chosen])
        self._refuse_held(ref, [device for _, device, _ in chosen], sharing is not None, results)
        self._refuse_device_plugin_held(ref, [device for _, device, _ in chosen])
        self._refuse_overcommitted(ref, [device for _, device, _ in chosen], view)
        devices = tuple(PreparedDevice(
            request_names=(str(result["request"]).split("/", 1)[0],), pool=self.pool, device=device.name,
            uuid=device.uuid, gpu_uuid=device.gpu_uuid,
            cdi_device_ids=(cdi_device_id(self.driver, ref.uid, device.name),),
            share_id=result.get("shareID")) for result, device, _ in chosen)
        record = PreparedClaim(ref.uid, ref.namespace, ref.name, PREPARING, devices, sharing is not None)
        self.checkpoint.put(record)  # before anything else: a kill from now on leaves a claim Unprepare cleans up
        try:
            record, path = self._prepare_recorded(ref, record, sharing, capacity,
                                                  [device for _, device, _ in chosen], view)
        except (PrepareError, OwnerRefused, ClaimSpecError, OSError) as exc:
            self._roll_back(ref)
            if isinstance(exc, OSError):
                raise PrepareError(f"claim {ref}: {exc.strerror or exc}: {exc.filename or ''}") from None
            raise PrepareError(str(exc) if isinstance(exc, PrepareError) else f"claim {ref}: {exc}") from None
        record = replace(record, state=PREPARED)
        self.checkpoint.put(record)
        log.info("claim_prepared", claim=str(ref), devices=[d.device for d in devices], spec=str(path),
                 sharing=sharing.strategy if sharing else None)
        return record

    def _prepare_recorded(self, ref: ClaimRef, record: PreparedClaim, sharing: Sharing | None,
                          capacity: dict[str, dict], chosen: list[DraDevice],
                          view: PoolView) -> tuple[PreparedClaim, Path]:
        """The claim's dynamic MIG devices made, its devices held in gpud, its MPS clients made, its spec
        written; the record with the UUIDs of the MIG devices made."""
        node_spec = view.node_spec
        if node_spec is None:
            raise PrepareError("gpud has written no CDI spec yet (GET /v1/cdi: cdi.enabled, its error)")
        made = self._make_mig_devices(ref, chosen)
        if made:
            record = replace(record, devices=tuple(replace(d, uuid=made.get(d.device, d.uuid)) for d in record.devices))
            self.checkpoint.put(record)  # the UUIDs gpud gave: what the hold and the spec name
            assert self.owner is not None  # _check_config refused dynamic MIG without gpud
            node_spec = self.owner.node_cdi_spec(made.values())
        uuids = [d.uuid for d in record.devices]
        if self.owner is not None:
            self.owner.hold(ref.uid, ref.namespace, ref.name, self.driver, uuids, sharing, capacity)
        extra: dict[str, dict] = {}
        if sharing is not None and sharing.strategy == MPS:
            assert self.owner is not None  # _check_config refused MPS without gpud
            limits = {uuid: (float(c["compute_percent"]), c["memory_mib"]) for uuid, c in capacity.items()} or \
                mps_limits(sharing, uuids)
            for uuid, (threads, memory) in limits.items():
                extra[uuid] = _mps_edits(self.owner.mps_client(ref.uid, uuid, threads, memory))
        spec = claim_spec(node_spec, self.driver, ref.uid, [(d.device, d.uuid) for d in record.devices], extra)
        return record, write_claim_spec(self.cdi_dir, self.driver, ref.uid, spec)

    def _make_mig_devices(self, ref: ClaimRef, chosen: list[DraDevice]) -> dict[str, str]:
        """Device name -> UUID of the MIG device gpud made (or had made) at each dynamic placement of the claim."""
        wanted = placements(chosen)
        if not wanted:
            return {}
        assert self.owner is not None
        made = self.owner.make_mig_devices(ref.uid, [placement for _, placement in wanted])
        return {device.name: answer["uuid"] for (device, _), answer in zip(wanted, made)}

    def _roll_back(self, ref: ClaimRef) -> None:
        """A Prepare that failed half way holds nothing: spec, gpud's hold and record removed (what cannot be
        stays recorded, for Unprepare or the next Prepare to finish)."""
        try:
            remove_claim_spec(self.cdi_dir, self.driver, ref.uid)
            if self.owner is not None:
                self.owner.release(ref.uid)
                self.owner.destroy_mig_devices(ref.uid)
            self.checkpoint.remove(ref.uid)
        except (OwnerRefused, OSError) as exc:
            log.warning("claim_roll_back_incomplete", claim=str(ref), error=str(exc),
                        consequence="the claim stays recorded as preparing until the kubelet prepares or unprepares it")

    def unprepare(self, ref: ClaimRef) -> None:
        """Removes the claim's spec, its hold in gpud (which stops an MPS daemon only it used), then its
        record; a claim never prepared (or already unprepared) is done."""
        if not CLAIM_UID.fullmatch(ref.uid):
            raise PrepareError(f"claim {ref}: {ref.uid!r} is not a Kubernetes UID")
        removed = remove_claim_spec(self.cdi_dir, self.driver, ref.uid)
        known = ref.uid in self.checkpoint.claims
        if self.owner is not None:
            try:
                self.owner.release(ref.uid)
                # always asked (idempotent): a claim rebuilt from its spec alone may have had MIG devices made
                self.owner.destroy_mig_devices(ref.uid)
            except OwnerRefused as exc:
                raise PrepareError(f"claim {ref}: {exc}") from None
        self.checkpoint.remove(ref.uid)
        if known or removed:
            log.info("claim_unprepared", claim=str(ref), spec_removed=removed)

    # -- checks ------------------------------------------------------------------------------------

    def _device(self, ref: ClaimRef, result: dict, view: PoolView) -> DraDevice:
        if result.get("pool") != self.pool:
            raise PrepareError(f"claim {ref}: device {result.get('device')} is in pool {result.get('pool')}, "
                               f"not this node's ({self.pool})")
        device = view.devices.get(str(result.get("device")))
        if device is None:
            raise PrepareError(f"claim {ref}: device {result.get('device')} is not in this node's pool any more "
                               "(a MIG layout change, or the GPU was lost)")
        return device

    def _check_config(self, ref: ClaimRef, device: DraDevice, config: DeviceConfig | None) -> None:
        if device.kind in (PARTITION, SHARE) and self.owner is None:
            raise PrepareError(f"claim {ref}: device {device.name} is made or counted by gpud, and this plugin has "
                               "no gpud")
        if config is None:
            return
        wanted = MIG_CONFIG if device.type == MIG_TYPE else "GpuConfig"
        if config.kind != wanted:
            raise PrepareError(f"claim {ref}: device {device.name} is a {device.type}; a {config.kind} does not "
                               f"apply to it ({wanted} does)")
        sharing = config.sharing
        if sharing is None:
            return
        if sharing.strategy == MPS and self.owner is None:
            raise PrepareError(f"claim {ref}: MPS sharing needs gpud's MPS daemons, and this plugin has no gpud")

    def _consumed(self, ref: ClaimRef, chosen: list[tuple[dict, DraDevice, DeviceConfig | None]]) -> dict[str, dict]:
        """Device UUID -> the consumed capacity of each share of the claim; {} when it has none. A claim that
        shares a GPU by capacity holds it through MPS with that capacity as its limits: all its devices are
        such shares, and no sharing config says otherwise."""
        try:
            capacity = {device.uuid: c for result, device, _ in chosen if (c := consumed(device, result))}
        except AllocationRefused as exc:
            raise PrepareError(f"claim {ref}: {exc}") from None
        if capacity and len(capacity) != len(chosen):
            raise PrepareError(f"claim {ref}: a claim that shares a GPU by its capacity (memory, compute) holds "
                               "only such shares; ask for the other devices in a claim of their own")
        if capacity and any(config is not None and config.sharing is not None for _, _, config in chosen):
            raise PrepareError(f"claim {ref}: a share's MPS limits are the capacity it asked for (memory, compute); "
                               "a sharing config does not apply to it")
        return capacity

    def _refuse_overcommitted(self, ref: ClaimRef, devices: list[DraDevice], view: PoolView) -> None:
        others = [c for c in self.checkpoint.claims.values() if c.uid != ref.uid]
        try:
            refuse_overcommitted_counters(devices, others, view.devices)
        except AllocationRefused as exc:
            raise PrepareError(f"claim {ref}: {exc}") from None

    def _refuse_held(self, ref: ClaimRef, devices: list[DraDevice], shared: bool, results: list[dict]) -> None:
        """A device (or the GPU of a MIG device, or a MIG device of a GPU) prepared for another claim."""
        admin = all(r.get("adminAccess") for r in results)
        for device in devices:
            for other in self.checkpoint.claims.values():
                if other.uid == ref.uid:
                    continue
                for held in other.devices:
                    # a partition has no UUID until it is made, nor has a device rebuilt from its spec: "" names none
                    same = held.device == device.name or (held.uuid and held.uuid in (device.uuid, device.gpu_uuid)) \
                        or (held.gpu_uuid and held.gpu_uuid == device.uuid)
                    if same and not admin and not (shared and other.shared):
                        through = "" if held.device == device.name else f" through {held.device}"
                        raise PrepareError(f"claim {ref}: device {device.name} is held by claim {other.namespace}/"
                                           f"{other.name} ({other.uid}){through}; neither shares it")

    def _refuse_device_plugin_held(self, ref: ClaimRef, devices: list[DraDevice]) -> None:
        """A device the device plugin gave a pod (the kubelet's PodResources): one owner for both paths. A
        share's GPU may carry gpud's gpu_memory units beside it: both are counted in gpud's one ledger."""
        if self.owner is None:
            return
        try:
            holders = self.owner.device_plugin_holders()
            counted = self.owner.counted_resource() if any(d.kind == SHARE for d in devices) else None
        except OwnerRefused as exc:
            raise PrepareError(f"claim {ref}: {exc}") from None
        for device in devices:
            found = holders.get(device.uuid, []) + holders.get(device.gpu_uuid, [])
            found = [holder for holder, resource in found if not (device.kind == SHARE and resource == counted)]
            if found:
                raise PrepareError(f"claim {ref}: device {device.name} is held by {found[0]} through the device plugin")


def _claim_sharing(ref: ClaimRef, configs: list[DeviceConfig | None]) -> Sharing | None:
    """How the claim shares its devices: one way for all of them, or none (exclusive)."""
    sharings = [config.sharing if config is not None else None for config in configs]
    if any(sharing != sharings[0] for sharing in sharings):
        raise PrepareError(f"claim {ref}: its devices are shared in different ways; gpud holds a claim's devices "
                           "one way (one config for the claim, or the same for each request)")
    return sharings[0]


def _mps_edits(client: dict) -> dict:
    """A client of gpud's MPS daemon as CDI edits: its environment and mounts, and the host's /dev/shm where
    the daemon shares memory with its clients there (the device plugin's mount of it, allocation.py)."""
    mounts = [{"hostPath": m["source"], "containerPath": m["target"],
               "options": ["rbind", "ro" if m.get("read_only") else "rw", "nosuid", "nodev"]} for m in client["mounts"]]
    if client.get("host_ipc"):
        mounts.append({"hostPath": HOST_SHM, "containerPath": HOST_SHM, "options": ["rbind", "rw", "nosuid", "nodev"]})
    return {"env": [f"{k}={v}" for k, v in sorted(client["env"].items())], "mounts": mounts}
