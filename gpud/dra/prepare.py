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

from gpud.dra.checkpoint import PREPARED, PREPARING, Checkpoint, PreparedClaim, PreparedDevice
from gpud.dra.claim_cdi import (CLAIM_UID, ClaimSpecError, cdi_device_id, claim_spec, remove_claim_spec, spec_path,
                                write_claim_spec)
from gpud.dra.config import MIG_CONFIG, TIME_SLICING, ConfigError, DeviceConfig, config_for, configs_by_request
from gpud.dra.devices import MIG_TYPE, DraDevice
from gpud.logs import get_logger

log = get_logger("dra_plugin")


class PrepareError(Exception):
    """The claim cannot be prepared: the message goes back to the kubelet (and the pod's events)."""


@dataclass(frozen=True)
class PoolView:
    """What the plugin last read of gpud: its devices by name, and gpud's CDI node spec (None: gpud
    writes none, or has not yet)."""

    devices: dict[str, DraDevice] = field(default_factory=dict)
    node_spec: dict | None = None
    unhealthy: frozenset[str] = frozenset()  # device names gpud calls unhealthy


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


class Preparer:
    def __init__(self, driver: str, pool: str, cdi_dir: Path, checkpoint: Checkpoint):
        self.driver = driver
        self.pool = pool
        self.cdi_dir = cdi_dir
        self.checkpoint = checkpoint

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
        shared = all(config is not None and config.sharing is not None for _, _, config in chosen)
        self._refuse_held(ref, [device for _, device, _ in chosen], shared, results)
        devices = tuple(PreparedDevice(
            request_names=(str(result["request"]).split("/", 1)[0],), pool=self.pool, device=device.name,
            uuid=device.uuid, gpu_uuid=device.gpu_uuid,
            cdi_device_ids=(cdi_device_id(self.driver, ref.uid, device.name),),
            share_id=result.get("shareID")) for result, device, _ in chosen)
        record = PreparedClaim(ref.uid, ref.namespace, ref.name, PREPARING, devices, shared)
        self.checkpoint.put(record)  # before the spec: a kill now leaves a claim Unprepare can clean up
        if view.node_spec is None:
            raise PrepareError("gpud has written no CDI spec yet (GET /v1/cdi: cdi.enabled, its error)")
        try:
            spec = claim_spec(view.node_spec, self.driver, ref.uid, [(d.device, d.uuid) for d in devices])
        except ClaimSpecError as exc:
            raise PrepareError(f"claim {ref}: {exc}") from None
        path = write_claim_spec(self.cdi_dir, self.driver, ref.uid, spec)
        record = replace(record, state=PREPARED)
        self.checkpoint.put(record)
        log.info("claim_prepared", claim=str(ref), devices=[d.device for d in devices], spec=str(path), shared=shared)
        return record

    def unprepare(self, ref: ClaimRef) -> None:
        """Removes the claim's spec, then its record; a claim never prepared (or already unprepared) is done."""
        if not CLAIM_UID.fullmatch(ref.uid):
            raise PrepareError(f"claim {ref}: {ref.uid!r} is not a Kubernetes UID")
        removed = remove_claim_spec(self.cdi_dir, self.driver, ref.uid)
        known = ref.uid in self.checkpoint.claims
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

    @staticmethod
    def _check_config(ref: ClaimRef, device: DraDevice, config: DeviceConfig | None) -> None:
        if config is None:
            return
        wanted = MIG_CONFIG if device.type == MIG_TYPE else "GpuConfig"
        if config.kind != wanted:
            raise PrepareError(f"claim {ref}: device {device.name} is a {device.type}; a {config.kind} does not "
                               f"apply to it ({wanted} does)")
        sharing = config.sharing
        if sharing is None:
            return
        if sharing.strategy == TIME_SLICING and sharing.interval not in (None, "Default"):
            raise PrepareError(f"claim {ref}: time-slice interval {sharing.interval} is not supported by gpud yet; "
                               "only Default (the driver's own) is")
        if sharing.strategy != TIME_SLICING:
            raise PrepareError(f"claim {ref}: MPS sharing through DRA is not supported by gpud yet (gpud's "
                               "sharing config serves MPS to device-plugin pods)")

    def _refuse_held(self, ref: ClaimRef, devices: list[DraDevice], shared: bool, results: list[dict]) -> None:
        """A device (or the GPU of a MIG device, or a MIG device of a GPU) prepared for another claim."""
        admin = all(r.get("adminAccess") for r in results)
        for device in devices:
            for other in self.checkpoint.claims.values():
                if other.uid == ref.uid:
                    continue
                for held in other.devices:
                    same = held.device == device.name or held.uuid in (device.uuid, device.gpu_uuid) or held.gpu_uuid == device.uuid
                    if same and not admin and not (shared and other.shared):
                        raise PrepareError(f"claim {ref}: device {device.name} is held by claim {other.namespace}/"
                                           f"{other.name} ({other.uid}) ({held.device}); neither shares it")
