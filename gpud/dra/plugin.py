"""The DRA plugin process: gpud's devices and health published as ResourceSlices, claims prepared for the
kubelet, device health streamed to it.

Started in order, stopped in reverse: the checkpoint is read (claims of an earlier boot dropped; an
unreadable file set aside and the claims rebuilt from the CDI specs they left), the API server's version
asked (which taint effects it takes, which form of slices), the DRA and registration sockets served, then
the loops: gpud's watch stream (a change re-reads /v1/node, /v1/gpus, /v1/health, /v1/cdi, /v1/mig/dynamic
and /v1/claims' shares), the slice publisher, and a look once a second at the sockets (one removed is
served again, so the kubelet finds the plugin again).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpud.base.host import boot_id as host_boot_id
from gpud.base.logs import get_logger
from gpud.base.loops import run_until_stopped, stop_on_signals
from gpud.client import Client
from gpud.device_plugin.follower import DEFAULT_UNREACHABLE_GRACE_S, GpudFollower
from gpud.dra.checkpoint import FILE_NAME, PREPARING, Checkpoint, PreparedClaim, PreparedDevice, load
from gpud.dra.claim_cdi import claim_specs_on_disk
from gpud.dra.devices import PARTITION, DraDevice, counter_sets, node_devices
from gpud.dra.health import (DeviceHealthState, TaintPolicy, device_taints, reasons_by_uuid, states_by_uuid,
                             unmonitored_taint)
from gpud.dra.kube import DraApi
from gpud.dra.owner import GpudOwner
from gpud.dra.prepare import ClaimRef, PoolView, PrepareError, Preparer
from gpud.dra.server import HealthEntry, HealthService, Sockets
from gpud.dra.slices import PoolContent, SlicePublisher
from gpud.kubernetes.node_api import KubeError

log = get_logger("dra_plugin")

SOCKET_CHECK_S = 1.0
OWNER_TIMEOUT_S = 30.0  # a hold that starts an MPS daemon, or sets a time slice with nvidia-smi
CLAIM_READS_AT_ONCE = 16  # a pod with many claims, or many pods at once: the API server is asked this many at a time


@dataclass(frozen=True)
class DraState:
    """What the plugin last read of gpud."""

    devices: tuple[DraDevice, ...] = ()
    left_out: tuple[dict, ...] = ()
    node_spec: dict | None = None
    reasons: dict[str, list[dict]] = field(default_factory=dict)  # by GPU or MIG UUID
    health: dict[str, DeviceHealthState] = field(default_factory=dict)  # by GPU or MIG UUID
    unmonitored: bool = False  # gpud has not answered past the grace period: nothing vouches for the devices
    read_at: float = 0.0

    def device_count(self) -> int:
        return len(self.devices)

    def all_unhealthy(self) -> DraState:
        """What GpudFollower publishes once gpud has been unreachable past its grace period."""
        return replace(self, unmonitored=True)


class DraFollower(GpudFollower):
    """gpud's watch stream says when to read again; each read is the whole of what the plugin needs. A claims
    event (the plugin's own hold or release) changes none of it."""

    ignored_events = frozenset({"heartbeat", "claims"})

    def __init__(self, socket_path: Path | None, publish, sysfs: Path | None,
                 unreachable_grace_s: float = DEFAULT_UNREACHABLE_GRACE_S):
        super().__init__(socket_path, publish, unreachable_grace_s)
        self.sysfs = sysfs

    def lags(self, state: DraState) -> bool:  # type: ignore[override]
        return False  # it names no device by gpud's CDI spec: each claim gets a spec of its own

    def read_state(self) -> DraState:  # type: ignore[override]
        node = self.client.get("/v1/node")
        gpus = self.client.get("/v1/gpus")
        health = self.client.get("/v1/health")
        status, cdi = self.client.request("GET", "/v1/cdi", ok_statuses=(404, 503))
        # a gpud without dynamic MIG or shares answers 404: no dynamic GPUs, no shares
        dynamic_status, dynamic = self.client.request("GET", "/v1/mig/dynamic", ok_statuses=(404,))
        claims_status, claims = self.client.request("GET", "/v1/claims", ok_statuses=(404,))
        shares = claims.get("shares") if claims_status == 200 and isinstance(claims, dict) else None
        # a simulated GPU's bus id is no device of this host: its PCIe root is not looked up
        sysfs = None if node.get("backend") == "simulated" else self.sysfs
        devices, left_out = node_devices(gpus, node, sysfs, dynamic if dynamic_status == 200 else None, shares)
        node_spec = cdi.get("spec") if status == 200 and cdi.get("enabled") else None
        return DraState(tuple(devices), tuple(left_out), node_spec, reasons_by_uuid(health), states_by_uuid(health),
                        read_at=time.time())


class DraPlugin:
    def __init__(self, gpud_socket: Path | None, api: DraApi, kubelet_dir: Path, cdi_dir: Path,
                 no_execute: bool = False, sysfs: Path | None = Path("/sys"),
                 unreachable_grace_s: float = DEFAULT_UNREACHABLE_GRACE_S, boot_id: str | None = None,
                 pod_resources_socket: Path | None = None):
        self.api = api
        self.driver = api.driver
        self.pool = api.node_name
        self.kubelet_dir = kubelet_dir
        self.cdi_dir = cdi_dir
        self.no_execute = no_execute
        self.policy = TaintPolicy(no_execute=no_execute)
        self.state: DraState | None = None
        self.follower = DraFollower(gpud_socket, self.apply, sysfs, unreachable_grace_s)
        # the kubelet's PodResources API: what the device plugin handed out (its default place under the root dir)
        self.owner = GpudOwner(Client(self.follower.client.socket_path, timeout=OWNER_TIMEOUT_S),
                               pod_resources_socket or kubelet_dir / "pod-resources" / "kubelet.sock")
        self.checkpoint_path = kubelet_dir / "plugins" / self.driver / FILE_NAME
        self.boot_id = boot_id if boot_id is not None else (host_boot_id(Path("/proc")) or None)
        if self.boot_id is None:
            log.warning("boot_id_unreadable", path="/proc/sys/kernel/random/boot_id",
                        consequence="claims recorded before a reboot cannot be told apart")
        self.preparer: Preparer | None = None
        self.publisher = SlicePublisher(api, self.desired_devices)
        self.health = HealthService(self.health_entries)
        self.sockets = Sockets(kubelet_dir, self.driver, self.prepare_all, self.unprepare_all, self.health)
        self._lock = asyncio.Lock()  # one claim's Prepare or Unprepare at a time changes the checkpoint
        self._reads = asyncio.Semaphore(CLAIM_READS_AT_ONCE)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def serve(self) -> int:
        stop = stop_on_signals()
        self.preparer = Preparer(self.driver, self.pool, self.cdi_dir, self._load_checkpoint(), self.owner)
        try:
            minor = await self.api.server_minor()
        except KubeError as exc:
            minor = self.policy.server_minor
            log.warning("server_version_unknown", error=str(exc), assuming=f"1.{minor}")
        self.policy = TaintPolicy(no_execute=self.no_execute, server_minor=minor)
        self.publisher.use_server_minor(minor)
        await self.sockets.start()
        log.info("dra_plugin_started", driver=self.driver, node=self.pool, kubelet_dir=str(self.kubelet_dir),
                 cdi_dir=str(self.cdi_dir), server=f"1.{minor}", gpud_socket=str(self.follower.client.socket_path),
                 prepared_claims=len(self.preparer.checkpoint.claims))
        failed = await run_until_stopped([self.follower.run(), self.publisher.run(), self._watch_sockets()], stop,
                                         log, "dra_plugin_failed")
        await self.sockets.stop()
        log.info("dra_plugin_stopped", failed=failed)
        return 1 if failed else 0

    def _load_checkpoint(self) -> Checkpoint:
        checkpoint, corrupt, dropped = load(self.checkpoint_path, self.boot_id)
        if corrupt is not None:
            rebuilt = self._rebuild(checkpoint)
            log.error("checkpoint_unreadable", path=str(self.checkpoint_path), error=corrupt.error,
                      kept_as=str(corrupt.kept_as) if corrupt.kept_as else None, rebuilt_claims=rebuilt,
                      consequence="the claims whose CDI specs are on disk are kept as held until the kubelet "
                      "prepares or unprepares them again")
        if corrupt is not None or dropped:
            checkpoint.save()
        return checkpoint

    def _rebuild(self, checkpoint: Checkpoint) -> int:
        """Claims from the specs they left: held (preparing), so their devices go to nobody else, and done
        again or removed when the kubelet asks."""
        for uid, spec in claim_specs_on_disk(self.cdi_dir, self.driver).items():
            names = [d.get("name", "")[len(uid) + 1:] for d in spec.get("devices") or []
                     if isinstance(d, dict) and str(d.get("name", "")).startswith(uid + "-")]
            checkpoint.claims[uid] = PreparedClaim(uid, "", "", PREPARING, tuple(
                PreparedDevice((), self.pool, name, "", "", ()) for name in names))
        return len(checkpoint.claims)

    async def _watch_sockets(self) -> None:
        while True:
            await asyncio.sleep(SOCKET_CHECK_S)
            if not (self.sockets.socket_is_ours(self.sockets.registration_socket)
                    and self.sockets.socket_is_ours(self.sockets.dra_socket)):
                log.warning("socket_gone", action="serving the sockets again")
                await self.sockets.stop()
                await self.sockets.start()

    # -- gpud's state ------------------------------------------------------------------------------

    async def apply(self, state: DraState) -> None:
        if self.state is None or self.state.left_out != state.left_out:
            log.info("devices_left_out", left_out=list(state.left_out))
        self.state = state
        self.publisher.changed()
        await self.health.changed()

    def desired_devices(self) -> PoolContent | None:
        """The pool as gpud has it. An API server that drops counters (its DRAPartitionableDevices gate is
        off) gets no partitions, whose counters would be all that keeps two claims off the same slices:
        a dynamic GPU is then only its whole GPU, where that is usable."""
        state = self.state
        if state is None:
            return None
        unmonitored = unmonitored_taint(self.driver, self.policy) if state.unmonitored else []
        counters = not self.publisher.counters_refused
        devices = [d for d in state.devices if counters or d.kind != PARTITION]
        return PoolContent(
            [d.slice_entry(device_taints(self.driver, state.reasons.get(d.health_uuid, []), self.policy) + unmonitored,
                           counters) for d in devices],
            [s.entry() for s in counter_sets(devices)] if counters else [])

    def health_entries(self) -> list[HealthEntry]:
        state = self.state
        if state is None:
            return []
        now = time.time()
        entries = []
        for device in state.devices:
            health = state.health.get(device.health_uuid)
            if state.unmonitored or health is None:
                entries.append(HealthEntry(self.pool, device.name, None, "gpud has not answered: nothing vouches "
                                           "for the device", state.read_at))
            else:
                entries.append(HealthEntry(self.pool, device.name, health.healthy, health.message, now))
        return entries

    def view(self) -> PoolView:
        state = self.state or DraState()
        return PoolView({d.name: d for d in state.devices}, state.node_spec)

    # -- the kubelet's calls -----------------------------------------------------------------------

    async def prepare_all(self, refs: list[ClaimRef]) -> dict[str, PreparedClaim | str]:
        answers = await asyncio.gather(*(self._prepare(ref) for ref in refs))
        return dict(zip((r.uid for r in refs), answers))

    async def _prepare(self, ref: ClaimRef) -> PreparedClaim | str:
        assert self.preparer is not None
        done = self.preparer.prepared(ref.uid)
        if done is not None:
            return done
        try:
            async with self._reads:
                claim = await self.api.read_claim(ref.namespace, ref.name)
        except KubeError as exc:
            log.warning("claim_not_read", claim=str(ref), error=str(exc))
            return f"claim {ref}: {exc}"
        async with self._lock:  # gpud's calls block: made on a thread, one claim at a time
            try:
                return await asyncio.to_thread(self.preparer.prepare, ref, claim, self.view())
            except PrepareError as exc:
                log.warning("claim_not_prepared", claim=str(ref), reason=str(exc))
                return str(exc)
            except OSError as exc:  # the checkpoint could not be written
                log.error("claim_not_prepared", claim=str(ref), error=str(exc))
                return f"claim {ref}: {exc.strerror or exc}: {exc.filename or ''}"

    async def unprepare_all(self, refs: list[ClaimRef]) -> dict[str, str]:
        assert self.preparer is not None
        errors = {}
        async with self._lock:
            for ref in refs:
                try:
                    await asyncio.to_thread(self.preparer.unprepare, ref)
                except (PrepareError, OSError) as exc:
                    log.error("claim_not_unprepared", claim=str(ref), error=str(exc))
                    errors[ref.uid] = str(exc)
        return errors


async def run_async(gpud_socket: Path | None, kubeconfig: Path | None, node_name: str, kubelet_dir: Path,
                    driver: str, cdi_dir: Path, no_execute: bool, pod_resources_socket: Path | None,
                    unreachable_grace_s: float) -> int:
    from kubernetes_asyncio.config import ConfigException

    from gpud.kubernetes.node_api import api_client

    try:
        client = await api_client(kubeconfig)
    except (ConfigException, OSError) as exc:
        log.error("no_cluster", error=str(exc))
        return 2
    try:
        plugin = DraPlugin(gpud_socket, DraApi(client, node_name, driver), kubelet_dir, cdi_dir, no_execute,
                           unreachable_grace_s=unreachable_grace_s, pod_resources_socket=pod_resources_socket)
        return await plugin.serve()
    finally:
        await client.close()


def run(gpud_socket: Path | None, kubeconfig: Path | None, node_name: str, kubelet_dir: Path, driver: str,
        cdi_dir: Path, no_execute: bool = False, pod_resources_socket: Path | None = None,
        unreachable_grace_s: float = DEFAULT_UNREACHABLE_GRACE_S) -> int:
    return asyncio.run(run_async(gpud_socket, kubeconfig, node_name, kubelet_dir, driver, cdi_dir, no_execute,
                                 pod_resources_socket, unreachable_grace_s))

