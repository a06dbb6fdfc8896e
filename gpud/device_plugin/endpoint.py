"""One resource's DevicePlugin gRPC server on its own socket in the kubelet's directory, and its own
registration with the kubelet: a registration that hangs holds up neither the other resources'
registrations nor any ListAndWatch frame."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import grpc

from gpud.base.logs import get_logger
from gpud.device_plugin.allocation import DEFAULT_STRATEGIES, AllocationRefused, DeviceListStrategy, allocate, \
    preferred
from gpud.device_plugin.api import API_VERSION, HEALTHY, UNHEALTHY, pb, rpc
from gpud.device_plugin.state import NodeState, Resource

log = get_logger("device_plugin")

SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
# Before Register answers, the kubelet dials the plugin's socket for up to 10 s and then asks
# GetDevicePluginOptions, both under the Register call's context (kubernetes pkg/kubelet/cm/devicemanager/
# plugin/v1beta1/server.go Register -> handler.go connectClient -> client.go Connect: dial's
# context.WithTimeout(ctx, 10*time.Second), then manager.go PluginConnected). A shorter deadline here
# cancels a registration a slow kubelet would have completed.
REGISTER_TIMEOUT_S = 30.0
STOP_GRACE_S = 1.0


def socket_name(kubelet_dir: Path, resource_name: str) -> str:
    """gpud-<resource>.sock, with the resource's `/` made `_`; a digest of it where the path would be
    too long for a Unix socket."""
    name = f"gpud-{resource_name.replace('/', '_')}.sock"
    if len(os.fsencode(kubelet_dir / name)) > SOCKET_PATH_MAX:
        name = f"gpud-{hashlib.sha256(resource_name.encode()).hexdigest()[:16]}.sock"
    return name


class Endpoint(rpc.DevicePluginServicer):
    def __init__(self, resource: Resource, kubelet_dir: Path, state: Callable[[], NodeState],
                 strategies: tuple[DeviceListStrategy, ...] = DEFAULT_STRATEGIES,
                 gpu_memory_allocated: Callable[[], None] = lambda: None):
        self.resource = resource
        self._gpu_memory_allocated = gpu_memory_allocated  # the pods holding its units are to be read again
        self.strategies = strategies
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
        self._registration_wanted = asyncio.Event()
        self._registrar: asyncio.Task | None = None
        self.registering = False

    @staticmethod
    def _frame_of(resource: Resource) -> pb.ListAndWatchResponse:
        return pb.ListAndWatchResponse(devices=[pb.Device(
            ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY,
            topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa_node)]) if d.numa_node is not None else None)
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
        if self._registrar is not None:
            self._registrar.cancel()
            self._registrar = None
        self._registration_wanted.clear()
        self.registering = False
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

    def register_soon(self, kubelet_socket: Path) -> None:
        """Asks for a registration with the kubelet, made by this endpoint's own task: the caller does not
        wait for it. One asked for while another is in flight follows it (the kubelet may have restarted)."""
        self._registration_wanted.set()
        if self._registrar is None or self._registrar.done():
            self._registrar = asyncio.create_task(self._register_when_wanted(kubelet_socket),
                                                  name=f"register {self.resource.name}")

    async def _register_when_wanted(self, kubelet_socket: Path) -> None:
        while self._registration_wanted.is_set():
            self._registration_wanted.clear()
            self.registering = True
            try:
                await self._register(kubelet_socket)
            finally:
                self.registering = False

    async def _register(self, kubelet_socket: Path) -> None:
        request = pb.RegisterRequest(version=API_VERSION, endpoint=self.socket.name,
                                     resource_name=self.resource.name, options=OPTIONS)
        started = asyncio.get_running_loop().time()
        try:
            async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
                await rpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self.registered = False
            self._failed_registrations += 1
            report = log.warning if self._failed_registrations == 1 else log.debug  # once, not every second
            report("registration_failed", resource=self.resource.name, kubelet=str(kubelet_socket),
                   code=exc.code().name, reason=exc.details(), attempts=self._failed_registrations,
                   retry="every second")
            return
        self.registered = True
        self._failed_registrations = 0
        log.info("registered", resource=self.resource.name, endpoint=self.socket.name, kubelet=str(kubelet_socket),
                 took_s=round(asyncio.get_running_loop().time() - started, 3))

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
                self.resource, list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size,
                self._state().nvlink_peers))
            for r in request.container_requests])

    async def Allocate(self, request, context):
        responses = []
        for container in request.container_requests:
            try:
                allocation = allocate(self._state(), self.resource, list(container.devices_ids),
                                      self.strategies)
            except AllocationRefused as exc:
                log.warning("allocate_refused", resource=self.resource.name, ids=list(container.devices_ids),
                            reason=str(exc))
                code = grpc.StatusCode.INVALID_ARGUMENT if exc.invalid else grpc.StatusCode.FAILED_PRECONDITION
                await context.abort(code, str(exc))
            log.info("allocated", resource=self.resource.name, ids=list(container.devices_ids),
                     envs=sorted(allocation.envs), cdi_devices=allocation.cdi_devices,
                     annotations=allocation.annotations)
            responses.append(pb.ContainerAllocateResponse(
                envs=allocation.envs, annotations=allocation.annotations,
                cdi_devices=[pb.CDIDevice(name=n) for n in allocation.cdi_devices],
                mounts=[pb.Mount(host_path=host, container_path=inside, read_only=read_only)
                        for host, inside, read_only in allocation.mounts]))
        if self.resource.strategy == "gpu-memory":
            self._gpu_memory_allocated()
        return pb.AllocateResponse(container_responses=responses)

    async def PreStartContainer(self, request, context):
        return pb.PreStartContainerResponse()
