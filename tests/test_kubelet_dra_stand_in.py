"""The DRA kubelet stand-in (kubelet_dra_stand_in.py) checked against a small DRA plugin served here, so
that tests of gpud's plugin can trust what it accepts and refuses."""

from __future__ import annotations

import os
import queue
import shutil
import stat
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from kubelet_dra_stand_in import V1, V1BETA1, DraKubelet, KubeletDraError

from gpud.dra.api import (HEALTH_SERVICE, PLUGIN_TYPE, health_pb, health_rpc, registration_pb, registration_rpc,
                          v1_pb, v1_rpc, v1beta1_pb, v1beta1_rpc)

DRIVER = "gpu.example.com"
NODE = "node-1"


class FakePlugin:
    """A DRA kubelet plugin: the registration socket in the kubelet's plugins_registry, the DRA socket (v1,
    v1beta1 and, with `health`, v1alpha1.DRAResourceHealth) under plugins/<driver>/ unless `shared`."""

    def __init__(self, kubelet_dir: Path, name: str = DRIVER, plugin_type: str = PLUGIN_TYPE,
                 versions=(V1, V1BETA1), shared: bool = False, health: bool = False, reg_name: str | None = None,
                 advertise: Path | None = None):
        self.name, self.plugin_type, self.versions, self.health = name, plugin_type, list(versions), health
        self.reg_socket = kubelet_dir / "plugins_registry" / (reg_name or f"{name}-reg.sock")
        self.dra_socket = self.reg_socket if shared else kubelet_dir / "plugins" / name / "dra.sock"
        self.shared = shared
        self.advertise = advertise  # the endpoint GetInfo names, when not its own
        self.notifications: list[tuple[bool, str]] = []
        self.calls: list[tuple[str, str, list[tuple[str, str, str]], float]] = []  # method, package, claims, deadline
        self.answer = None  # claims -> {uid: (devices, error)}; default: every claim, one device
        self.health_updates: queue.Queue = queue.Queue()
        self._servers: list[grpc.Server] = []
        self.changed = threading.Condition()

    def _dra_servicer(self, package: str, pb, rpc):
        plugin = self

        class Servicer(rpc.DRAPluginServicer):
            def NodePrepareResources(self, request, context):
                return plugin._prepare(package, pb, request, context)

            def NodeUnprepareResources(self, request, context):
                claims = [(c.namespace, c.name, c.uid) for c in request.claims]
                plugin._record("NodeUnprepareResources", package, claims, context)
                return pb.NodeUnprepareResourcesResponse(
                    claims={uid: pb.NodeUnprepareResourceResponse() for _, _, uid in claims})

        return Servicer()

    def _record(self, method, package, claims, context) -> None:
        with self.changed:
            self.calls.append((method, package, claims, context.time_remaining()))
            self.changed.notify_all()

    def _prepare(self, package, pb, request, context):
        claims = [(c.namespace, c.name, c.uid) for c in request.claims]
        self._record("NodePrepareResources", package, claims, context)
        answer = self.answer(claims) if self.answer else {uid: ([f"gpu-{i}"], "") for i, (_, _, uid) in
                                                          enumerate(claims)}
        return pb.NodePrepareResourcesResponse(claims={
            uid: pb.NodePrepareResourceResponse(
                devices=[pb.Device(request_names=["gpu"], pool_name=NODE, device_name=d,
                                   cdi_device_ids=[f"example.com/gpu={uid}-{d}"]) for d in devices], error=error)
            for uid, (devices, error) in answer.items()})

    def start(self) -> FakePlugin:
        plugin = self

        class Registration(registration_rpc.RegistrationServicer):
            def GetInfo(self, request, context):
                endpoint = "" if plugin.shared else str(plugin.advertise or plugin.dra_socket)
                return registration_pb.PluginInfo(type=plugin.plugin_type, name=plugin.name, endpoint=endpoint,
                                                  supported_versions=plugin.versions)

            def NotifyRegistrationStatus(self, request, context):
                with plugin.changed:
                    plugin.notifications.append((request.plugin_registered, request.error))
                    plugin.changed.notify_all()
                return registration_pb.RegistrationStatusResponse()

        class Health(health_rpc.DRAResourceHealthServicer):
            def NodeWatchResources(self, request, context):
                while context.is_active():
                    try:
                        update = plugin.health_updates.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    if update is None:  # the plugin ends the stream
                        return
                    yield update

        dra = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        v1_rpc.add_DRAPluginServicer_to_server(self._dra_servicer("v1", v1_pb, v1_rpc), dra)
        v1beta1_rpc.add_DRAPluginServicer_to_server(self._dra_servicer("v1beta1", v1beta1_pb, v1beta1_rpc), dra)
        if self.health:
            health_rpc.add_DRAResourceHealthServicer_to_server(Health(), dra)
        if self.shared:
            registration_rpc.add_RegistrationServicer_to_server(Registration(), dra)
        self.dra_socket.parent.mkdir(parents=True, exist_ok=True)
        self.dra_socket.unlink(missing_ok=True)
        dra.add_insecure_port(f"unix:{self.dra_socket}")
        dra.start()
        self._servers.append(dra)
        if not self.shared:
            reg = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            registration_rpc.add_RegistrationServicer_to_server(Registration(), reg)
            self.reg_socket.parent.mkdir(parents=True, exist_ok=True)
            self.reg_socket.unlink(missing_ok=True)
            reg.add_insecure_port(f"unix:{self.reg_socket}")
            reg.start()
            self._servers.append(reg)
        return self

    def stop(self) -> None:
        """As DRAL's helper stops: the registration socket goes first, then the servers."""
        self.reg_socket.unlink(missing_ok=True)
        self.health_updates.put(None)
        for server in self._servers:
            server.stop(0).wait(5)
        self._servers = []
        self.dra_socket.unlink(missing_ok=True)

    def wait(self, predicate, timeout: float = 10.0, what: str = "condition"):
        with self.changed:
            assert self.changed.wait_for(predicate, timeout), f"fake plugin: timed out waiting for {what}"

    def prepares(self) -> list:
        return [c for c in self.calls if c[0] == "NodePrepareResources"]


@pytest.fixture
def kubelet_dir():
    directory = Path(tempfile.mkdtemp(prefix="dra-kl-", dir="/tmp"))  # unix socket paths are short
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def started():
    """Starts kubelets and plugins and stops them whatever the test's outcome."""
    things = []

    def start(thing):
        things.append(thing)
        thing.start()
        return thing

    yield start
    for thing in reversed(things):
        thing.stop()


def wipes(kubelet: DraKubelet, driver) -> int:
    return sum(d == driver for d, _ in kubelet.wipes)


def registered(kubelet: DraKubelet, driver: str = DRIVER):
    return kubelet.wait(lambda: kubelet.connected(driver), 10, f"{driver} registered and connected")


# -- registration --------------------------------------------------------------------------------

def test_registration_accepted_and_startup_wipe(kubelet_dir, started):
    calls = []
    kubelet = started(DraKubelet(kubelet_dir, NODE, wipe=lambda node, driver: calls.append((node, driver))))
    registry = kubelet_dir / "plugins_registry"
    assert stat.S_IMODE(registry.stat().st_mode) == 0o755 & ~_umask()
    kubelet.wait(lambda: kubelet.wipes, 5, "the start's wipe")
    assert calls == [(NODE, None)]
    plugin = started(FakePlugin(kubelet_dir))
    registered(kubelet)
    plugin.wait(lambda: plugin.notifications, 5, "a notification")
    assert plugin.notifications == [(True, "")]
    [reg] = kubelet.registrations
    assert (reg.name, reg.endpoint, reg.service, reg.versions) == (DRIVER, str(plugin.dra_socket), V1, (V1, V1BETA1))
    assert reg.socket == str(plugin.reg_socket) and not kubelet.rejections
    assert calls == [(NODE, None)]  # a connected driver is not wiped


def test_existing_socket_registers_at_start_and_hidden_or_plain_files_are_ignored(kubelet_dir, started):
    (kubelet_dir / "plugins_registry").mkdir(parents=True)
    plugin = started(FakePlugin(kubelet_dir, reg_name="sub/gpu.example.com-reg.sock"))
    hidden = started(FakePlugin(kubelet_dir, name="hidden.example.com", reg_name=".hidden-reg.sock"))
    (kubelet_dir / "plugins_registry" / "not-a-socket.sock").write_text("")
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    registered(kubelet)  # found by the start's walk, in a subdirectory
    time.sleep(1.2)  # fixed time: a reconcile period more, in which nothing else may register
    assert [r.name for r in kubelet.registrations] == [DRIVER]
    assert [s for s, _ in kubelet.attempts] == [str(plugin.reg_socket)]
    assert not hidden.notifications and not kubelet.rejections


def test_wrong_type_is_refused_and_retried(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    plugin = started(FakePlugin(kubelet_dir, plugin_type="CSIPlugin"))
    kubelet.wait(lambda: len(kubelet.rejections) >= 2, 6, "the refusal, and its retry after the backoff")
    reason = (f"RegisterPlugin error -- no handler registered for plugin type: CSIPlugin at socket "
              f"{plugin.reg_socket}")
    assert plugin.notifications[:2] == [(False, reason)] * 2
    assert kubelet.rejections[0].reason == reason and not kubelet.registrations
    gap = kubelet.rejections[1].at - kubelet.rejections[0].at
    assert gap >= 0.5  # goroutinemap's backoff


@pytest.mark.parametrize("versions, wanted", [
    ([], "empty list of supported gRPC services (aka supported versions)"),
    (["v1alpha4.Node", HEALTH_SERVICE], 'none of services supported by the plugin (["v1alpha4.Node" '
                                        '"v1alpha1.DRAResourceHealth"]) are supported by the kubelet '
                                        '(["v1.DRAPlugin" "v1beta1.DRAPlugin"])'),
])
def test_no_supported_version_is_refused(kubelet_dir, started, versions, wanted):
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    plugin = started(FakePlugin(kubelet_dir, versions=versions))
    plugin.wait(lambda: plugin.notifications, 5, "the refusal")
    endpoint = plugin.dra_socket
    assert plugin.notifications[0] == (False, "RegisterPlugin error -- plugin validation failed with err: invalid "
                                              f"supported gRPC versions of DRA driver plugin {DRIVER} at endpoint "
                                              f"{endpoint}: {wanted}")
    assert not kubelet.registrations


def test_driver_name_not_a_dns_subdomain_is_refused(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    plugin = started(FakePlugin(kubelet_dir, name="GPU_example"))
    plugin.wait(lambda: plugin.notifications, 5, "the refusal")
    assert plugin.notifications[0][0] is False and "stand-in: driver name 'GPU_example'" in plugin.notifications[0][1]
    assert not kubelet.registrations


@pytest.mark.parametrize("kubelet_services, plugin_versions, chosen", [
    ((V1, V1BETA1), [V1BETA1], V1BETA1),  # a v1beta1-only plugin on a 1.34 kubelet
    ((V1, V1BETA1), [V1BETA1, V1], V1BETA1),  # the plugin's order counts, not the kubelet's
    ((V1BETA1,), [V1, V1BETA1], V1BETA1),  # a 1.32-1.33 kubelet
    ((V1, V1BETA1), [HEALTH_SERVICE, V1, V1BETA1], V1),
])
def test_first_supported_service_of_the_plugin_list_is_used(kubelet_dir, started, kubelet_services,
                                                           plugin_versions, chosen):
    kubelet = started(DraKubelet(kubelet_dir, NODE, supported_services=kubelet_services))
    plugin = started(FakePlugin(kubelet_dir, versions=plugin_versions))
    registered(kubelet)
    assert kubelet.registrations[0].service == chosen
    kubelet.prepare([("default", "claim", "uid-1")])
    assert [c[1] for c in plugin.prepares()] == [chosen.split(".")[0]]


def test_empty_endpoint_is_the_registration_socket(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    plugin = started(FakePlugin(kubelet_dir, shared=True))
    registered(kubelet)
    assert kubelet.registrations[0].endpoint == str(plugin.reg_socket)
    assert set(kubelet.prepare([("default", "claim", "uid-1")])) == {"uid-1"}


def test_same_endpoint_twice_is_refused(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    first = started(FakePlugin(kubelet_dir))
    registered(kubelet)
    second = FakePlugin(kubelet_dir, reg_name="second-reg.sock", advertise=first.dra_socket)
    second.dra_socket = kubelet_dir / "plugins" / "second" / "dra.sock"
    started(second)
    second.wait(lambda: second.notifications, 5, "the refusal")
    assert second.notifications[0] == (False, "RegisterPlugin error -- plugin registration failed with err: "
                                               f"endpoint {first.dra_socket} already registered for DRA driver "
                                               f"plugin {DRIVER}")


# -- prepare / unprepare ---------------------------------------------------------------------------

def test_prepare_sends_the_kubelets_deadline(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    plugin = started(FakePlugin(kubelet_dir))
    registered(kubelet)
    answer = kubelet.prepare([("default", "a", "uid-a"), ("default", "b", "uid-b")])
    assert sorted(answer) == ["uid-a", "uid-b"] and answer["uid-a"].devices[0].device_name == "gpu-0"
    [(_, package, claims, deadline)] = plugin.prepares()
    assert package == "v1" and claims == [("default", "a", "uid-a"), ("default", "b", "uid-b")]
    assert 40 < deadline <= 45.5  # grpc rounds the timeout up; one call for all claims of the driver, 45 s deadline


@pytest.mark.parametrize("answer, message", [
    (lambda claims: {claims[0][2]: (["gpu-0"], "")}, "NodePrepareResources skipped 1 ResourceClaims"),
    (lambda claims: {"uid-x": (["gpu-0"], ""), **{u: ([], "") for _, _, u in claims}},
     "NodePrepareResources returned result for unknown claim UID uid-x"),
    (lambda claims: {u: ([], "GPU is busy" if n == "b" else "") for _, n, u in claims},
     "NodePrepareResources failed for ResourceClaim b: GPU is busy"),
])
def test_a_bad_prepare_answer_fails_and_prepares_nothing(kubelet_dir, started, answer, message):
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    plugin = started(FakePlugin(kubelet_dir))
    registered(kubelet)
    plugin.answer = answer
    with pytest.raises(KubeletDraError, match="^prepare dynamic resources: " + message.replace("(", r"\(")):
        kubelet.prepare([("default", "a", "uid-a"), ("default", "b", "uid-b")])
    assert not kubelet.prepared("uid-a") and not kubelet.prepared("uid-b")
    plugin.answer = None  # the kubelet tries again: both are sent again
    kubelet.prepare([("default", "a", "uid-a"), ("default", "b", "uid-b")])
    assert [len(c[2]) for c in plugin.prepares()] == [2, 2]


def test_prepare_of_an_unregistered_driver_fails(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    with pytest.raises(KubeletDraError, match="DRA driver gpu.example.com is not registered"):
        kubelet.prepare([("default", "a", "uid-a")], driver=DRIVER)


def test_prepared_claims_are_not_prepared_again_even_after_restart(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    plugin = started(FakePlugin(kubelet_dir))
    registered(kubelet)
    claim = ("default", "a", "uid-a")
    kubelet.prepare([claim])
    assert kubelet.prepare([claim]) == {}  # a second pod of the claim
    kubelet.restart()
    kubelet.wait(lambda: wipes(kubelet, None) == 2, 5, "the second start's wipe")
    registered(kubelet)
    assert len(kubelet.registrations) == 2  # re-registered from the walk
    assert kubelet.prepare([claim]) == {}
    assert len(plugin.prepares()) == 1
    with pytest.raises(KubeletDraError, match="old ResourceClaim with same name a and different UID uid-a"):
        kubelet.prepare([("default", "a", "uid-new")])
    assert set(kubelet.unprepare([claim])) == {"uid-a"}  # the last pod left
    assert kubelet.unprepare([claim]) == {}  # no longer held: no call
    assert [c[0] for c in plugin.calls] == ["NodePrepareResources", "NodeUnprepareResources"]
    kubelet.prepare([claim])
    assert len(plugin.prepares()) == 2


# -- connections and wiping ------------------------------------------------------------------------

def test_driver_slices_are_wiped_after_the_delay_when_its_plugin_goes(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE, wiping_delay_s=0.5))
    plugin = started(FakePlugin(kubelet_dir))
    registered(kubelet)
    assert wipes(kubelet, DRIVER) == 0
    gone = time.monotonic()
    plugin.stop()  # the connection ends at once, the deregistration follows within a reconcile period
    kubelet.wait(lambda: wipes(kubelet, DRIVER) == 1, 5, "the driver's wipe")
    wiped_at = next(at for d, at in kubelet.wipes if d == DRIVER)
    assert wiped_at - gone >= 0.45
    kubelet.wait(lambda: kubelet.deregistrations, 5, "the deregistration")


def test_reregistering_within_the_delay_cancels_the_wipe(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE, wiping_delay_s=2.5))
    plugin = started(FakePlugin(kubelet_dir))
    registered(kubelet)
    plugin.stop()
    kubelet.wait(lambda: kubelet.wipe_pending(DRIVER), 5, "a pending wipe")
    started(FakePlugin(kubelet_dir))
    kubelet.wait(lambda: len(kubelet.registrations) == 2 and kubelet.connected(DRIVER), 5, "the re-registration")
    assert not kubelet.wipe_pending(DRIVER)
    time.sleep(2.7)  # fixed time: past the 2.5 s wiping delay, in which no wipe may come
    assert wipes(kubelet, DRIVER) == 0


def test_a_dead_dra_socket_is_wiped_although_still_registered(kubelet_dir, started):
    """Connection state, not registration, counts: the DRA server dies, the registration socket stays."""
    kubelet = started(DraKubelet(kubelet_dir, NODE, wiping_delay_s=0.3))
    plugin = started(FakePlugin(kubelet_dir))
    registered(kubelet)
    plugin._servers[0].stop(0).wait(5)  # the DRA server
    kubelet.wait(lambda: wipes(kubelet, DRIVER) == 1, 5, "the driver's wipe")
    assert not kubelet.deregistrations


# -- health --------------------------------------------------------------------------------------

def device_health(device: str, health, timeout_s: int = 0, message: str = ""):
    return health_pb.DeviceHealth(device=health_pb.DeviceIdentifier(pool_name=NODE, device_name=device),
                                  health=health, last_updated_time=int(time.time()),
                                  health_check_timeout_seconds=timeout_s, message=message)


def test_health_goes_unknown_after_its_timeout_and_messages_are_cut(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE, health_timeout_s=30.0))
    plugin = started(FakePlugin(kubelet_dir, health=True, versions=(V1, HEALTH_SERVICE)))
    registered(kubelet)
    sent = time.monotonic()
    plugin.health_updates.put(health_pb.NodeWatchResourcesResponse(devices=[
        device_health("gpu-0", health_pb.HEALTHY, timeout_s=1), device_health("gpu-1", health_pb.UNHEALTHY,
                                                                              message="é" * 1500)]))
    kubelet.wait(lambda: kubelet.health_messages, 5, "a health message")
    assert kubelet.health_messages[0].at - sent < 1.0
    assert kubelet.health(NODE, "gpu-0") == "Healthy"
    info = kubelet.health_info(NODE, "gpu-1")
    assert info.health == "Unhealthy" and len(info.message.encode()) <= 1024 and info.message.endswith("...")
    assert kubelet.health(NODE, "gpu-9") == "Unknown"
    time.sleep(1.2)  # fixed time: past gpu-0's own 1 s timeout
    assert kubelet.health_info(NODE, "gpu-0").health == "Unknown"  # its own 1 s timeout
    assert kubelet.health_info(NODE, "gpu-0").message == ""
    assert kubelet.health(NODE, "gpu-1") == "Unhealthy"  # the default 30 s
    plugin.health_updates.put(None)  # the stream ends: the driver's cache goes
    kubelet.wait(lambda: kubelet.health_stream_errors, 5, "the stream's end")
    assert kubelet.health(NODE, "gpu-1") == "Unknown"


def test_health_stream_is_opened_whatever_the_plugin_advertises(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE))
    started(FakePlugin(kubelet_dir))  # no DRAResourceHealth: 1.34-1.36 ask all the same
    registered(kubelet)
    kubelet.wait(lambda: kubelet.health_stream_errors, 5, "the failed stream")
    assert "Unimplemented" in kubelet.health_stream_errors[0][1]


def test_health_gate_off_opens_no_stream(kubelet_dir, started):
    kubelet = started(DraKubelet(kubelet_dir, NODE, resource_health_status=False))
    plugin = started(FakePlugin(kubelet_dir, health=True))
    registered(kubelet)
    plugin.health_updates.put(health_pb.NodeWatchResourcesResponse(devices=[device_health("gpu-0", 1)]))
    time.sleep(0.5)  # fixed time: long enough for a stream to be opened and answered
    assert not kubelet.health_messages and not kubelet.health_stream_errors


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask



# -- NVIDIA's real kubelet plugin ------------------------------------------------------------------

@pytest.mark.slow
def test_nvidia_kubelet_plugin_registers_prepares_and_outlives_a_kubelet_restart():
    """NVIDIA's gpu-kubelet-plugin (../shared/nvidia-dra-driver) on the mock H100 node, against an API
    server stand-in: the stand-in registers it, wipes its slices at each start (it publishes them again),
    prepares a claim once, and not again after a restart."""
    from dra_side_by_side import DRA_RULES, NvidiaDraPlugin, allocated_claim, devices_of, driver_root, mock_config
    from dra_side_by_side import nvidia_missing
    from helpers import mock_nvml_library, need
    from kube_api_stand_in import KubeApiStandIn

    why = nvidia_missing()
    need(why is None, why or "")
    need(shutil.which("gcc") is not None and shutil.which("ldconfig", path="/usr/sbin:/sbin") is not None,
         "gcc and ldconfig make the driver root's stub libcuda and its ld.so.cache")
    config = mock_config("h100")
    need(config.exists(), f"{config} is absent")
    driver, node = "gpu.nvidia.com", "node1"
    work = Path(tempfile.mkdtemp(prefix="kdn", dir="/tmp"))
    kube = KubeApiStandIn(server_version="1.34")
    plugin = kubelet = None
    try:
        kube.create_node(node)
        kube.bind_rbac("dra", DRA_RULES)
        root = driver_root(work / "root", mock_nvml_library(), 8)
        plugin = NvidiaDraPlugin(work / "nvidia", kube.kubeconfig("dra"), node, root, config)
        kubelet = DraKubelet(plugin.kubelet_dir, node, wipe=kube.wipe_resource_slices).start()
        kubelet.wait(lambda: kubelet.connected(driver), 60, "NVIDIA's plugin registered")
        reg = kubelet.registrations[0]
        assert (reg.name, reg.service, reg.endpoint) == (driver, V1, str(plugin.dra_socket))

        def published(count: int = 8) -> None:
            deadline = time.monotonic() + 60
            while len(devices_of(kube, node)) < count:
                plugin.alive()
                assert time.monotonic() < deadline, f"not {count} devices published: {sorted(devices_of(kube, node))}"
                time.sleep(0.1)

        kubelet.wait(lambda: kubelet.wipes, 30, "the start's wipe")
        published()  # after the start's wipe too: the plugin publishes again what the kubelet deleted
        claim = allocated_claim(kube, "c1", "gpu-0", node)
        answer = kubelet.prepare([claim], driver=driver)
        assert [d.device_name for d in answer[claim[2]].devices] == ["gpu-0"]
        kubelet.restart()
        kubelet.wait(lambda: len(kubelet.wipes) == 2, 30, "the second start's wipe")
        kubelet.wait(lambda: len(kubelet.registrations) == 2 and kubelet.connected(driver), 30, "re-registration")
        published()
        assert kubelet.prepare([claim], driver=driver) == {}  # prepared before the restart: not sent again
        assert set(kubelet.unprepare([claim])) == {claim[2]}
        assert kubelet.rejections == []
    finally:
        if kubelet is not None:
            kubelet.stop()
        if plugin is not None:
            plugin.stop()
        kube.stop()
        shutil.rmtree(work, ignore_errors=True)
    assert kube.unmodelled == []
