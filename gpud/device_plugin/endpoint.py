"""One resource's DevicePlugin gRPC server on its own socket in the kubelet's directory."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import grpc

from gpud.device_plugin.allocation import AllocationRefused, allocate, preferred
from gpud.device_plugin.api import API_VERSION, HEALTHY, UNHEALTHY, pb, rpc
from gpud.device_plugin.state import NodeState, Resource
from gpud.logs import get_logger

log = get_logger("device_plugin")

SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
REGISTER_TIMEOUT_S = 5.0
STOP_GRACE_S = 1.0


def socket_name(kubelet_dir: Path, resource_name: str) -> str:
    """gpud-<resource>.sock, with the resource's `/` made `_`; a digest of it where the path would be
    too long for a Unix socket."""
    name = f"gpud-{resource_name.replace('/', '_')}.sock"
    if len(os.fsencode(kubelet_dir / name)) > SOCKET_PATH_MAX:
        name = f"gpud-{hashlib.sha256(resource_name.encode()).hexdigest()[:16]}.sock"
    return name


class Endpoint(rpc.DevicePluginServicer):
    def __init__(self, resource: Resource, kubelet_dir: Path, state: Callable[[], NodeState]):
        self.resource = resource
        self.kubelet_dir = kubelet_dir
        self.socket = kubelet_dir / socket_name(kubelet_dir, resource.name)
        self._state = state
        self._frame = self._frame_of(resource)
        self._version = 0  # counts the frames: each ListAndWatch stream sends every new one
        self._changed = asyncio.Condition()
        self._closing = False
        self._server: grpc.aio.Server | None = None
        self.socket_inode: int | None = None
        self.registered = False
        self._failed_registrations = 0

    @staticmethod
    def _frame_of(resource: Resource) -> pb.ListAndWatchResponse:
        return pb.ListAndWatchResponse(devices=[pb.Device(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY)
                                                for d in resource.devices])

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.socket.unlink(missing_ok=True)  # one left by an earlier run of the plugin
        self._closing = False
        server = grpc.aio.server()
        rpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server
        self.socket_inode = os.stat(self.socket).st_ino
        self.registered = False
        log.info("endpoint_started", resource=self.resource.name, socket=str(self.socket),
                 devices=len(self.resource.devices))

    async def stop(self, why: str) -> None:
        """Ends the ListAndWatch streams (after the last frame), stops serving, removes its own socket."""
        async with self._changed:
            self._closing = True
            self._changed.notify_all()
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
            self._server = None
        if self.socket_is_ours():
            self.socket.unlink(missing_ok=True)
        self.registered = False
        log.info("endpoint_stopped", resource=self.resource.name, socket=str(self.socket), why=why)

    def socket_is_ours(self) -> bool:
        try:
            return os.stat(self.socket).st_ino == self.socket_inode
        except OSError:
            return False

    async def register(self, kubelet_socket: Path) -> bool:
        request = pb.RegisterRequest(version=API_VERSION, endpoint=self.socket.name,
                                     resource_name=self.resource.name, options=OPTIONS)
        try:
            async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
                await rpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self._failed_registrations += 1
            report = log.warning if self._failed_registrations == 1 else log.debug  # once, not every second
            report("registration_failed", resource=self.resource.name, kubelet=str(kubelet_socket),
                   code=exc.code().name, reason=exc.details(), attempts=self._failed_registrations,
                   retry="every second")
            return False
        self.registered = True
        self._failed_registrations = 0
        log.info("registered", resource=self.resource.name, endpoint=self.socket.name, kubelet=str(kubelet_socket))
        return True

    async def update(self, resource: Resource) -> None:
        """Takes the resource's current devices; a changed list or health goes out as a new frame."""
        self.resource = resource
        frame = self._frame_of(resource)
        if frame == self._frame:
            return
        async with self._changed:
            self._frame = frame
            self._version += 1
            self._changed.notify_all()
        log.info("devices_changed", resource=resource.name, devices=len(resource.devices),
                 unhealthy=sorted(d.id for d in resource.devices if not d.healthy))

    # -- the DevicePlugin service ----------------------------------------------------------------

    async def GetDevicePluginOptions(self, request, context):
        return OPTIONS

    async def ListAndWatch(self, request, context):
        sent = None
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self._version != sent or self._closing)
                frame, version = self._frame, self._version
            if version != sent:
                sent = version
                yield frame
            if self._closing:
                return

    async def GetPreferredAllocation(self, request, context):
        return pb.PreferredAllocationResponse(container_responses=[
            pb.ContainerPreferredAllocationResponse(deviceIDs=preferred(
                self.resource, list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size))
            for r in request.container_requests])

    async def Allocate(self, request, context):
        responses = []
        for container in request.container_requests:
            try:
                allocation = allocate(self._state(), self.resource, list(container.devices_ids))
            except AllocationRefused as exc:
                log.warning("allocate_refused", resource=self.resource.name, ids=list(container.devices_ids),
                            reason=str(exc))
                code = grpc.StatusCode.INVALID_ARGUMENT if exc.unknown else grpc.StatusCode.FAILED_PRECONDITION
                await context.abort(code, str(exc))
            log.info("allocated", resource=self.resource.name, ids=list(container.devices_ids),
                     cdi_devices=allocation.cdi_devices)
            responses.append(pb.ContainerAllocateResponse(
                envs=allocation.envs, cdi_devices=[pb.CDIDevice(name=n) for n in allocation.cdi_devices],
                mounts=[pb.Mount(host_path=host, container_path=inside, read_only=read_only)
                        for host, inside, read_only in allocation.mounts]))
        return pb.AllocateResponse(container_responses=responses)

    async def PreStartContainer(self, request, context):
        return pb.PreStartContainerResponse()
