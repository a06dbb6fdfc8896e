"""The kubelet's side of the device plugin API v1beta1, as the kubelet's device manager does it.

No kubelet runs here, so this stands in for kubernetes/kubernetes pkg/kubelet/cm/devicemanager; each
behaviour names the source it copies, and none is kinder than the kubelet:
- Register (plugin/v1beta1/server.go Register): the version must be one of SupportedVersions and the
  resource an extended resource name; then, before answering, it connects to the plugin's socket
  (handler.go connectClient -> client.go Connect -> dial: blocking, context.WithTimeout(ctx, 10 s) on
  the Register call's context) and asks GetDevicePluginOptions with that same context (manager.go
  PluginConnected). A caller whose deadline passes first gets no registration.
- ListAndWatch (client.go Run, with context.TODO(): no deadline): each answer replaces the resource's
  devices (manager.go genericDeviceUpdateCallback). When the stream ends, every device of the resource
  is Unhealthy (manager.go PluginDisconnected -> markResourceUnhealthy); the kubelet never re-dials.
- A restart stops every plugin connection (server.go Stop -> disconnectClient) and, when it starts
  again, removes every socket in its directory but its checkpoint (manager.go CleanupPluginDirectory).
- Allocate and GetPreferredAllocation carry one container request (endpoint.go allocate,
  getPreferredAllocation); Allocate fails on an answer without a container response (manager.go
  allocateContainerResources: "no containers return in allocation response"). An answered Allocate
  records the container's devices (manager.go allocateContainerResources -> podDevices.insert), which
  the kubelet checkpoints: they outlive a kubelet restart.
- PodResources API v1 on <directory>/../pod-resources/kubelet.sock (pkg/kubelet/apis/podresources/
  server_v1.go List): every active pod with its containers, each with the devices allocated to it, one
  ContainerDevices per device ID and NUMA node, without topology where the plugin gave none
  (pkg/kubelet/cm/container_manager_linux.go containerDevicesFromResourceDeviceInstances). Here a pod
  is active from its first Allocate on, and has the containers it was allocated to (the kubelet lists
  the containers of the pod's spec, devices or not; pods that end leave the list). Get and GetAllocatableResources are not served.
  Calls beyond 100 a second (a burst of 10) are refused RESOURCE_EXHAUSTED "rejected by rate limit"
  (pkg/kubelet/apis/podresources/grpc/ratelimit.go DefaultQPS, DefaultBurstTokens).
- Its containers' DRA claims (dynamic_resources: the KubeletPodResourcesDynamicResources gate, beta and on
  from 1.34), as kubernetes/kubernetes @001332b0422071acf4860769f18e34b5e9b7c1bc fills them: one
  DynamicResource per claim the container names, with the pod's namespace (pkg/kubelet/cm/dra/manager.go
  GetContainerClaimInfos: the whole claim, every device of every request, however the container names
  it); in it one ClaimResource per device prepared, by driver (pkg/kubelet/cm/container_manager_linux.go
  GetDynamicResources), whose cdi_devices are that device's CDI IDs after those of the driver's devices
  before it (the list is not emptied between devices there). A claim is listed from its Prepare on
  (prepare_claim).
"""

from __future__ import annotations

import stat
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpud.device_plugin.api import HEALTHY, UNHEALTHY, pb, podresources_pb, podresources_rpc, rpc

SUPPORTED_VERSIONS = ("v1beta1",)  # k8s.io/kubelet pkg/apis/deviceplugin/v1beta1/constants.go
DIAL_TIMEOUT_S = 10.0  # client.go dial
CHECKPOINT = "kubelet_internal_checkpoint"  # devicemanager's checkpoint file, kept by CleanupPluginDirectory
POD_RESOURCES_QPS, POD_RESOURCES_BURST = 100, 10  # podresources/grpc/ratelimit.go


class TokenBucket:
    """golang.org/x/time/rate Limiter.Allow: `rate` tokens a second, at most `burst` held."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens < 1:
                return False
            self.tokens -= 1
            return True


def extended_resource_name(name: str) -> bool:
    """v1helper.IsExtendedResourceName: a domain-prefixed name outside kubernetes.io, not `requests.`."""
    domain, slash, rest = name.partition("/")
    return bool(slash and domain and rest) and "kubernetes.io" not in domain and not name.startswith("requests.")


class Kubelet:
    """The device manager on <directory>/kubelet.sock. dial_delay_s: how long connecting back to a
    plugin takes (a busy kubelet: the dial may take its whole 10 s); hang: resources whose Register
    the kubelet does not answer before the caller gives up."""

    def __init__(self, directory: Path, dial_delay_s: float = 0.0):
        self.directory = directory
        self.dial_delay_s = dial_delay_s
        self.hang: set[str] = set()
        self.attempts: list[pb.RegisterRequest] = []
        self.registrations: list[pb.RegisterRequest] = []
        self.registered_at: list[float] = []
        self.options: dict[str, pb.DevicePluginOptions] = {}
        self.frames: dict[str, list[list[tuple[str, str]]]] = {}
        self.frame_times: dict[str, list[float]] = {}
        self.frame_bytes: dict[str, list[int]] = {}  # each frame's encoded size (the kubelet's limit is 4 MiB)
        self.devices: dict[str, dict[str, str]] = {}  # resource -> ID -> health, as the device manager holds them
        self.numa: dict[str, dict[str, list[int]]] = {}  # resource -> ID -> its NUMA nodes (Device.topology)
        self.streams_ended: dict[str, int] = {}
        self._channels: dict[str, grpc.Channel] = {}  # the connection of each resource's current plugin
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._server = None
        # (namespace, pod) -> container -> resource -> device IDs: what the kubelet allocated (podDevices)
        self.pod_devices: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
        # (namespace, pod) -> container -> the claims it names: (claim name, its prepared devices)
        self.pod_claims: dict[tuple[str, str], dict[str, list[tuple[str, list[PreparedDevice]]]]] = {}
        self.list_delay_s = 0.0  # a kubelet slow to answer List (a test's hang)
        self.pod_resources_socket = directory.parent / "pod-resources" / "kubelet.sock"
        self.pod_resources_socket.parent.mkdir(exist_ok=True)
        self._pod_resources_server = None
        self.start()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._cleanup_plugin_directory()
        self._stopping.clear()
        kubelet = self

        class Registration(rpc.RegistrationServicer):
            def Register(self, request, context):
                return kubelet._register(request, context)

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        rpc.add_RegistrationServicer_to_server(Registration(), self._server)
        self._server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        self._server.start()

        limiter = TokenBucket(POD_RESOURCES_QPS, POD_RESOURCES_BURST)

        class PodResourcesLister(podresources_rpc.PodResourcesListerServicer):
            def List(self, request, context):
                if not limiter.allow():
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
                kubelet._stopping.wait(kubelet.list_delay_s)
                return kubelet._list_pod_resources()

        self._pod_resources_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        podresources_rpc.add_PodResourcesListerServicer_to_server(PodResourcesLister(), self._pod_resources_server)
        self._pod_resources_server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        self._pod_resources_server.start()

    def release(self, resource: str) -> None:
        """Lets the resource's hanging Register go on."""
        with self._changed:
            self.hang.discard(resource)
            self._changed.notify_all()

    def stop(self) -> None:
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()
        with self._changed:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:  # server.go Stop: disconnectClient for every plugin
            channel.close()
        self._server.stop(0).wait(10)
        self._pod_resources_server.stop(0).wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def _cleanup_plugin_directory(self) -> None:
        for path in self.directory.iterdir():
            if path.name != CHECKPOINT and stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink(missing_ok=True)

    # -- Registration ----------------------------------------------------------------------------

    def _register(self, request: pb.RegisterRequest, context) -> pb.Empty:
        with self._changed:
            self.attempts.append(request)
            self._changed.notify_all()
        if request.version not in SUPPORTED_VERSIONS:
            context.abort(grpc.StatusCode.UNKNOWN, f"requested device plugin API version {request.version} is not "
                                                   f"supported by kubelet. Supported versions are {SUPPORTED_VERSIONS}")
        if not extended_resource_name(request.resource_name):
            context.abort(grpc.StatusCode.UNKNOWN, f"the ResourceName {request.resource_name!r} is invalid")
        with self._changed:  # until the caller gives up, unless the test lets this resource through
            released = self._changed.wait_for(
                lambda: request.resource_name not in self.hang or self._stopping.is_set(), _remaining(context, 3600.0))
        if not released or self._stopping.is_set():
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "context deadline exceeded")
        dial_budget = min(DIAL_TIMEOUT_S, _remaining(context, DIAL_TIMEOUT_S))
        if self.dial_delay_s >= dial_budget:
            self._stopping.wait(dial_budget)
            context.abort(grpc.StatusCode.UNKNOWN, "failed to dial device plugin: context deadline exceeded")
        self._stopping.wait(self.dial_delay_s)
        channel = grpc.insecure_channel(f"unix://{self.directory / request.endpoint}")
        try:
            grpc.channel_ready_future(channel).result(timeout=max(0.0, dial_budget - self.dial_delay_s))
            options = rpc.DevicePluginStub(channel).GetDevicePluginOptions(
                pb.Empty(), timeout=_remaining(context, None))
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            channel.close()
            context.abort(grpc.StatusCode.UNKNOWN, f"failed to connect to the plugin: {exc!r}")
        with self._changed:
            old = self._channels.get(request.resource_name)
            self._channels[request.resource_name] = channel
            self.options[request.resource_name] = options
            self.registrations.append(request)
            self.registered_at.append(time.monotonic())
            self._changed.notify_all()
        if old is not None:
            old.close()
        threading.Thread(target=self._follow, args=(request.resource_name, channel), daemon=True).start()
        return pb.Empty()

    def _follow(self, resource: str, channel: grpc.Channel) -> None:
        try:
            for frame in rpc.DevicePluginStub(channel).ListAndWatch(pb.Empty()):
                with self._changed:
                    self.frames.setdefault(resource, []).append([(d.ID, d.health) for d in frame.devices])
                    self.frame_times.setdefault(resource, []).append(time.monotonic())
                    self.frame_bytes.setdefault(resource, []).append(frame.ByteSize())
                    self.devices[resource] = {d.ID: d.health for d in frame.devices}
                    self.numa[resource] = {d.ID: [n.ID for n in d.topology.nodes] for d in frame.devices}
                    self._changed.notify_all()
        except (grpc.RpcError, ValueError):  # the plugin went away, or the kubelet closed the connection
            pass
        with self._changed:
            self.streams_ended[resource] = self.streams_ended.get(resource, 0) + 1
            if self._channels.get(resource) is channel or self._stopping.is_set():
                self.devices[resource] = dict.fromkeys(self.devices.get(resource, {}), UNHEALTHY)
            self._changed.notify_all()

    # -- what tests ask --------------------------------------------------------------------------

    def allocate(self, resource: str, ids: list[str], timeout: float = 5.0,
                 container: tuple[str, str, str] = ("default", "pod", "main")) -> pb.ContainerAllocateResponse:
        """Allocate for `container` (namespace, pod, container), recorded for List once answered."""
        answer = self._stub(resource).Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=timeout)
        if not answer.container_responses:
            raise AssertionError(f"no containers return in allocation response {answer}")
        namespace, pod, name = container
        with self._changed:
            self.pod_devices.setdefault((namespace, pod), {}).setdefault(name, {})[resource] = list(ids)
        return answer.container_responses[0]

    def prepare_claim(self, container: tuple[str, str, str], claim: str, devices: list[PreparedDevice]) -> None:
        """The pod's claim was prepared (its devices as the driver's NodePrepareResources answered them), and
        `container` (namespace, pod, container) names it."""
        namespace, pod, name = container
        with self._changed:
            self.pod_claims.setdefault((namespace, pod), {}).setdefault(name, []).append((claim, list(devices)))

    def _list_pod_resources(self) -> podresources_pb.ListPodResourcesResponse:
        with self._changed:
            pods = {key: sorted({*self.pod_devices.get(key, {}), *self.pod_claims.get(key, {})})
                    for key in {**self.pod_devices, **self.pod_claims}}
            return podresources_pb.ListPodResourcesResponse(pod_resources=[
                podresources_pb.PodResources(namespace=namespace, name=pod, containers=[
                    podresources_pb.ContainerResources(name=container, devices=[
                        device for resource, ids in self.pod_devices.get((namespace, pod), {}).get(container, {}).items()
                        for i in ids for device in self._container_devices(resource, i)],
                        dynamic_resources=[_dynamic_resource(namespace, claim, devices) for claim, devices
                                           in self.pod_claims.get((namespace, pod), {}).get(container, [])])
                    for container in containers])
                for (namespace, pod), containers in pods.items()])

    def _container_devices(self, resource: str, device_id: str) -> list[podresources_pb.ContainerDevices]:
        nodes = self.numa.get(resource, {}).get(device_id)
        if not nodes:
            return [podresources_pb.ContainerDevices(resource_name=resource, device_ids=[device_id])]
        return [podresources_pb.ContainerDevices(resource_name=resource, device_ids=[device_id],
                                                 topology=podresources_pb.TopologyInfo(
                                                     nodes=[podresources_pb.NUMANode(ID=node)]))
                for node in nodes]

    def preferred(self, resource: str, available: list[str], size: int, must_include: list[str] = (),
                  timeout: float = 5.0) -> list[str]:
        answer = self._stub(resource).GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=size,
                                                   must_include_deviceIDs=list(must_include))]), timeout=timeout)
        return list(answer.container_responses[0].deviceIDs)

    def _stub(self, resource: str) -> rpc.DevicePluginStub:
        with self._changed:
            return rpc.DevicePluginStub(self._channels[resource])

    def wait(self, predicate, timeout: float = 10.0, what: str = "condition"):
        with self._changed:
            if not self._changed.wait_for(predicate, timeout):
                raise AssertionError(f"kubelet stand-in: timed out waiting for {what}; registrations "
                                     f"{[r.resource_name for r in self.registrations]}, last frames "
                                     f"{ {k: v[-1][:3] for k, v in self.frames.items()} }")
            return predicate()

    def last_frame(self, resource: str) -> list[tuple[str, str]] | None:
        frames = self.frames.get(resource)
        return frames[-1] if frames else None

    def frame_where(self, resource: str, wanted, timeout: float = 10.0, what: str = "a frame"):
        return self.wait(lambda: (f := self.last_frame(resource)) is not None and wanted(f) and f, timeout, what)

    def registered(self, resource: str) -> int:
        return sum(r.resource_name == resource for r in self.registrations)

    def healthy(self, resource: str) -> list[str]:
        return sorted(i for i, health in self.devices.get(resource, {}).items() if health == HEALTHY)


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as the kubelet keeps it (dra/state DriverState.Devices)."""

    driver: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...] = ()


def _dynamic_resource(namespace: str, claim: str, devices: list[PreparedDevice]) -> podresources_pb.DynamicResource:
    """container_manager_linux.go GetDynamicResources: by driver, each device's ClaimResource with the CDI
    IDs of the driver's devices so far."""
    resources = []
    for driver in dict.fromkeys(device.driver for device in devices):
        cdi: list[podresources_pb.CDIDevice] = []
        for device in (d for d in devices if d.driver == driver):
            cdi += [podresources_pb.CDIDevice(name=i) for i in device.cdi_ids]
            resources.append(podresources_pb.ClaimResource(cdi_devices=list(cdi), driver_name=driver,
                                                           pool_name=device.pool, device_name=device.device))
    return podresources_pb.DynamicResource(claim_name=claim, claim_namespace=namespace, claim_resources=resources)


NO_DEADLINE_S = 1e9  # grpc's server reports "no deadline" as a remaining time of centuries, not None


def _remaining(context, default: float | None) -> float | None:
    """The caller's time left; `default` when it set no deadline (NVIDIA's plugin registers without one)."""
    remaining = context.time_remaining()
    return default if remaining is None or remaining > NO_DEADLINE_S else max(0.0, remaining)
