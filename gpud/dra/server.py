"""The plugin's two gRPC servers: the registration socket the kubelet's plugin watcher finds
(`<kubelet dir>/plugins_registry/<driver>-reg.sock`, pluginregistration.Registration), and the DRA socket
(`<kubelet dir>/plugins/<driver>/dra.sock`) serving DRAPlugin v1 and v1beta1 (the same calls: a 1.32-1.33
kubelet speaks v1beta1) and v1alpha1.DRAResourceHealth (k8s.io/dynamic-resource-allocation kubeletplugin
draplugin.go, registrationserver.go; facts in k8s.io/kubelet's protos beside this file)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import grpc

from gpud.base.logs import get_logger
from gpud.base.loops import within
from gpud.dra.api import (PLUGIN_TYPE, SUPPORTED_SERVICES, health_pb, health_rpc, registration_pb, registration_rpc,
                          v1_pb, v1_rpc, v1beta1_pb, v1beta1_rpc)
from gpud.dra.checkpoint import PreparedClaim
from gpud.dra.prepare import ClaimRef

log = get_logger("dra_plugin")

STOP_GRACE_S = 1.0
# The kubelet marks a device Unknown 30 s after its last health update (pkg/kubelet/cm/dra/healthinfo.go,
# the default timeout); every device is sent again well inside that, and at once on a change.
HEALTH_REFRESH_S = 10.0
HEALTH_TIMEOUT_S = 30


@dataclass(frozen=True)
class HealthEntry:
    pool: str
    device: str
    healthy: bool | None  # None: unknown
    message: str
    updated_at: float


class Registration(registration_rpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: Path):
        self.driver = driver
        self.endpoint = endpoint

    async def GetInfo(self, request, context):
        return registration_pb.PluginInfo(type=PLUGIN_TYPE, name=self.driver, endpoint=str(self.endpoint),
                                          supported_versions=list(SUPPORTED_SERVICES))

    async def NotifyRegistrationStatus(self, request, context):
        if request.plugin_registered:
            log.info("registered_with_kubelet", driver=self.driver, endpoint=str(self.endpoint))
        else:
            log.error("kubelet_refused_registration", driver=self.driver, error=request.error)
        return registration_pb.RegistrationStatusResponse()


PrepareAll = Callable[[list[ClaimRef]], Awaitable[dict[str, PreparedClaim | str]]]
UnprepareAll = Callable[[list[ClaimRef]], Awaitable[dict[str, str]]]


def _dra_servicer(pb: ModuleType, base: type, prepare: PrepareAll, unprepare: UnprepareAll):
    """A DRAPlugin servicer for one version's generated module (v1 and v1beta1 differ only in package)."""

    class Servicer(base):
        async def NodePrepareResources(self, request, context):
            refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
            answers = await prepare(refs)
            claims = {}
            for ref in refs:
                answer = answers[ref.uid]
                if isinstance(answer, str):
                    claims[ref.uid] = pb.NodePrepareResourceResponse(error=answer)
                    continue
                claims[ref.uid] = pb.NodePrepareResourceResponse(devices=[pb.Device(
                    request_names=list(d.request_names), pool_name=d.pool, device_name=d.device,
                    cdi_device_ids=list(d.cdi_device_ids), **({"share_id": d.share_id} if d.share_id else {}))
                    for d in answer.devices])
            return pb.NodePrepareResourcesResponse(claims=claims)

        async def NodeUnprepareResources(self, request, context):
            refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
            errors = await unprepare(refs)
            return pb.NodeUnprepareResourcesResponse(claims={
                ref.uid: pb.NodeUnprepareResourceResponse(error=errors.get(ref.uid, "")) for ref in refs})

    return Servicer()


class HealthService(health_rpc.DRAResourceHealthServicer):
    """Each message carries every device (the kubelet replaces its view with it: KEP-4680;
    kubernetes/kubernetes pkg/kubelet/cm/dra/healthinfo.go), sent on a change and every
    HEALTH_REFRESH_S."""

    def __init__(self, entries: Callable[[], list[HealthEntry]]):
        self._entries = entries
        self._changed = asyncio.Condition()
        self._version = 0

    async def changed(self) -> None:
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    def _message(self) -> health_pb.NodeWatchResourcesResponse:
        status = {True: health_pb.HEALTHY, False: health_pb.UNHEALTHY, None: health_pb.UNKNOWN}
        return health_pb.NodeWatchResourcesResponse(devices=[health_pb.DeviceHealth(
            device=health_pb.DeviceIdentifier(pool_name=e.pool, device_name=e.device), health=status[e.healthy],
            last_updated_time=int(e.updated_at), health_check_timeout_seconds=HEALTH_TIMEOUT_S, message=e.message)
            for e in self._entries()])

    async def NodeWatchResources(self, request, context):
        sent = None
        while True:
            async with self._changed:
                try:
                    await within(self._changed.wait_for(lambda: self._version != sent), HEALTH_REFRESH_S)
                except asyncio.TimeoutError:
                    pass  # nothing changed: the same list again, with a fresh time
                sent = self._version
            yield self._message()


class Sockets:
    """Starts the DRA server, then the registration server (the kubelet dials the DRA endpoint as soon as
    it sees the registration socket); stops them in reverse, removing each socket it made."""

    def __init__(self, kubelet_dir: Path, driver: str, prepare: PrepareAll, unprepare: UnprepareAll,
                 health: HealthService):
        self.dra_socket = kubelet_dir / "plugins" / driver / "dra.sock"
        self.registration_socket = kubelet_dir / "plugins_registry" / f"{driver}-reg.sock"
        self.registration = Registration(driver, self.dra_socket)
        self._servicers = (_dra_servicer(v1_pb, v1_rpc.DRAPluginServicer, prepare, unprepare),
                           _dra_servicer(v1beta1_pb, v1beta1_rpc.DRAPluginServicer, prepare, unprepare), health)
        self._dra: grpc.aio.Server | None = None
        self._registrar: grpc.aio.Server | None = None
        self._inodes: dict[Path, int] = {}

    async def start(self) -> None:
        self.dra_socket.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        self.registration_socket.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        v1, v1beta1, health = self._servicers
        self._dra = await self._serve(self.dra_socket, lambda server: (
            v1_rpc.add_DRAPluginServicer_to_server(v1, server),
            v1beta1_rpc.add_DRAPluginServicer_to_server(v1beta1, server),
            health_rpc.add_DRAResourceHealthServicer_to_server(health, server)))
        self._registrar = await self._serve(self.registration_socket, lambda server:
                                            registration_rpc.add_RegistrationServicer_to_server(self.registration, server))
        log.info("sockets_serving", registration=str(self.registration_socket), dra=str(self.dra_socket))

    async def _serve(self, path: Path, add) -> grpc.aio.Server:
        path.unlink(missing_ok=True)  # one an earlier run left
        server = grpc.aio.server()
        add(server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        self._inodes[path] = os.stat(path).st_ino
        return server

    def socket_is_ours(self, path: Path) -> bool:
        try:
            return os.stat(path).st_ino == self._inodes.get(path)
        except OSError:
            return False

    async def stop(self) -> None:
        """The registration socket first: its removal is the kubelet's signal that the plugin is gone."""
        for server, path in ((self._registrar, self.registration_socket), (self._dra, self.dra_socket)):
            if self.socket_is_ours(path):
                path.unlink(missing_ok=True)
            if server is not None:
                await server.stop(STOP_GRACE_S)
        self._dra = self._registrar = None

