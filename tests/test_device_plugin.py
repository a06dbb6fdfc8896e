"""`gpud device-plugin` against a kubelet stand-in: the kubelet's side of the device plugin API v1beta1
(a Registration server on kubelet.sock; on each Register it connects to the plugin's socket, asks its
options and follows ListAndWatch; the tests call Allocate and GetPreferredAllocation), with gpud and the
plugin as real processes on a simulated node."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from helpers import REPO, GpudProcess, cli, running_daemons, stand_in_nodes

from gpud.device_plugin.allocation import AllocationRefused, allocate, preferred
from gpud.device_plugin.api import pb, rpc
from gpud.device_plugin.state import MpsClient, NodeState, PluginDevice, Resource

TIME_SLICED = """version: v1
flags:
  migStrategy: {strategy}
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 2
"""
MIG_SINGLE = "version: v1\nflags:\n  migStrategy: single\n"
MIG_MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"


class Kubelet:
    """The kubelet's side of the protocol, on <directory>/kubelet.sock."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.registrations: list[pb.RegisterRequest] = []
        self.options: dict[str, pb.DevicePluginOptions] = {}
        self.frames: dict[str, list[list[tuple[str, str]]]] = {}
        self.streams_ended: dict[str, int] = {}
        self._changed = threading.Condition()
        self._server = None
        self.start()

    def start(self) -> None:
        kubelet = self

        class Registration(rpc.RegistrationServicer):
            def Register(self, request, context):
                kubelet._registered(request)
                return pb.Empty()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        rpc.add_RegistrationServicer_to_server(Registration(), self._server)
        self._server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        self._server.start()

    def restart(self) -> None:
        """As a kubelet restart does: kubelet.sock goes away and a new one appears."""
        self._server.stop(0).wait(10)
        (self.directory / "kubelet.sock").unlink(missing_ok=True)
        self.start()

    def stop(self) -> None:
        self._server.stop(0).wait(10)

    def _registered(self, request: pb.RegisterRequest) -> None:
        with self._changed:
            self.registrations.append(request)
            self._changed.notify_all()
        threading.Thread(target=self._follow, args=(request,), daemon=True).start()

    def _follow(self, request: pb.RegisterRequest) -> None:
        with grpc.insecure_channel(f"unix://{self.directory / request.endpoint}") as channel:
            stub = rpc.DevicePluginStub(channel)
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
            with self._changed:
                self.options[request.resource_name] = options
            try:
                for frame in stub.ListAndWatch(pb.Empty()):
                    with self._changed:
                        self.frames.setdefault(request.resource_name, []).append(
                            [(d.ID, d.health) for d in frame.devices])
                        self._changed.notify_all()
            except grpc.RpcError:
                pass  # the plugin went away
            with self._changed:
                self.streams_ended[request.resource_name] = self.streams_ended.get(request.resource_name, 0) + 1
                self._changed.notify_all()

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

    def plugin(self, resource: str):
        """A DevicePlugin client on the endpoint the resource last registered."""
        endpoint = [r.endpoint for r in self.registrations if r.resource_name == resource][-1]
        channel = grpc.insecure_channel(f"unix://{self.directory / endpoint}")
        return channel, rpc.DevicePluginStub(channel)


class Node:
    """A simulated gpud, the kubelet stand-in and `gpud device-plugin`, each its own process or server."""

    def __init__(self, tmp: Path, preset: str, sharing: str, unhealthy_after: float = 30.0, config: str = ""):
        self.tmp = tmp
        (tmp / "sharing.yaml").write_text(sharing)
        stand_in_nodes(tmp / "root", 8)  # the driver's device nodes, MIG capabilities included
        (tmp / "gpud.yaml").write_text(f"sharing:\n  file: {tmp / 'sharing.yaml'}\n"
                                       f"mig:\n  layouts_file: {tmp / 'absent.yaml'}\n"
                                       f"cdi:\n  dev_root: {tmp / 'root'}\n{config}")
        self.gpud_args = ("--simulate", preset, "--sim-state", str(tmp / "sim.json"),
                          "--config", str(tmp / "gpud.yaml"))
        self.gpud = self.start_gpud()
        self.kubelet_dir = tmp / "k"
        self.kubelet_dir.mkdir()
        self.kubelet = Kubelet(self.kubelet_dir)
        self.plugin_log = tmp / "plugin.log"
        with self.plugin_log.open("w") as log:
            self.plugin = subprocess.Popen(
                [sys.executable, "-m", "gpud", "device-plugin", "--socket", str(self.gpud.socket), "--kubelet-dir",
                 str(self.kubelet_dir), "--unhealthy-after", str(unhealthy_after), "--log-format", "json"],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def start_gpud(self) -> GpudProcess:
        gpud = GpudProcess(self.tmp, *self.gpud_args)
        gpud.wait_healthy()
        return gpud

    def sharing_ids(self, resource: str) -> list[str]:
        document = self.gpud.client.get("/v1/sharing")
        (entry,) = [r for r in document["resources"] if r["name"] == resource]
        return [d["id"] for d in entry["devices"]]

    def log_events(self) -> list[dict]:
        return [json.loads(line) for line in self.plugin_log.read_text().splitlines() if line.startswith("{")]

    def close(self) -> None:
        if self.plugin.poll() is None:
            self.plugin.kill()
            self.plugin.wait(10)
        self.kubelet.stop()
        if self.gpud.proc.poll() is None:
            self.gpud.proc.kill()
            self.gpud.proc.wait(10)


@pytest.fixture
def node_factory(short_tmp):
    nodes = []

    def make(*args, **kwargs) -> Node:
        nodes.append(Node(short_tmp, *args, **kwargs))
        return nodes[-1]

    yield make
    for node in nodes:
        node.close()


def all_healthy(frame) -> bool:
    return all(health == "Healthy" for _, health in frame)


# -- against the kubelet stand-in ----------------------------------------------------------------


@pytest.mark.slow
def test_registers_lists_allocates_and_follows_health(node_factory):
    node = node_factory("A100-SXM4-40GB:2", TIME_SLICED.format(strategy="none"))
    ids = node.sharing_ids("nvidia.com/gpu")
    assert len(ids) == 4 and all("::" in i for i in ids)
    frame = node.kubelet.frame_where("nvidia.com/gpu", lambda f: [i for i, _ in f] == ids, what="the devices")
    assert all_healthy(frame)
    (registration,) = node.kubelet.registrations
    assert (registration.version, registration.resource_name) == ("v1beta1", "nvidia.com/gpu")
    assert (node.kubelet_dir / registration.endpoint).is_socket()
    options = node.kubelet.options["nvidia.com/gpu"]
    assert options.get_preferred_allocation_available and not options.pre_start_required

    gpu0 = node.gpud.client.get("/v1/gpus")["gpus"][0]["uuid"]
    assert cli("sim", "xid", "0", "79", socket=node.gpud.socket).returncode == 0
    frame = node.kubelet.frame_where("nvidia.com/gpu", lambda f: not all_healthy(f), what="an Unhealthy frame")
    assert {i for i, health in frame if health == "Unhealthy"} == {f"{gpu0}::0", f"{gpu0}::1"}

    channel, plugin = node.kubelet.plugin("nvidia.com/gpu")
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            plugin.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(
                devices_ids=[f"{gpu0}::0"])]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "unhealthy" in refused.value.details()

        node.gpud.client.request("POST", f"/v1/health/{gpu0}/clear", {})
        node.kubelet.frame_where("nvidia.com/gpu", all_healthy, what="Healthy again")

        answer = plugin.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[ids[2], ids[3]]),
            pb.ContainerAllocateRequest(devices_ids=[ids[0]])]), timeout=5)
        second_gpu, first = answer.container_responses
        parent = ids[2].split("::")[0]
        assert second_gpu.envs["NVIDIA_VISIBLE_DEVICES"] == parent  # two replicas of one GPU: that GPU
        assert first.envs["NVIDIA_VISIBLE_DEVICES"] == gpu0
        cdi = node.gpud.client.get("/v1/cdi")
        assert ids[0] in cdi["devices"]  # the stand-in device nodes exist, so the spec has the replicas
        assert [d.name for d in first.cdi_devices] == [f"{cdi['kind']}={ids[0]}"]
        assert [d.name for d in second_gpu.cdi_devices] == [f"{cdi['kind']}={i}" for i in ids[2:]]

        with pytest.raises(grpc.RpcError) as unknown:
            plugin.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(
                devices_ids=["GPU-not-there::0"])]), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-not-there::0" in unknown.value.details()

        spread = plugin.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)]), timeout=5)
        (chosen,) = spread.container_responses
        assert len(chosen.deviceIDs) == 2 and {i.split("::")[0] for i in chosen.deviceIDs} == {gpu0, parent}
    assert node.kubelet.registered("nvidia.com/gpu") == 1  # health changes re-register nothing

    node.plugin.send_signal(signal.SIGTERM)
    assert node.plugin.wait(10) == 0
    assert not (node.kubelet_dir / registration.endpoint).exists()  # it removes its own socket


@pytest.mark.slow
def test_a_mig_change_shows_the_new_devices_within_a_second_without_registering_again(node_factory):
    node = node_factory("dgx-a100", MIG_SINGLE)
    before = node.sharing_ids("nvidia.com/gpu")
    assert len(before) == 8
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: [i for i, _ in f] == before, what="the 8 GPUs")

    status, _ = node.gpud.client.request("PUT", "/v1/mig?wait=true", {"layout": "all-1g.5gb"})
    assert status == 200
    applied = time.monotonic()
    after = node.sharing_ids("nvidia.com/gpu")
    assert len(after) == 56 and all(i.startswith("MIG-") for i in after)
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: sorted(i for i, _ in f) == sorted(after), timeout=1.0,
                             what="the 56 MIG devices within a second")
    # The acceptance: the CDI spec and the NFD file show exactly the new devices in that second too.
    cdi_path = Path(node.gpud.client.get("/v1/cdi")["path"])
    nfd_path = Path(node.gpud.client.get("/v1/nfd")["path"])

    def spec_mig_devices() -> set[str]:
        spec = json.loads(cdi_path.read_text())
        return {device["name"] for device in spec["devices"] if device["name"].startswith("MIG-")}

    def nfd_labels() -> dict[str, str]:
        return dict(line.split("=", 1) for line in nfd_path.read_text().splitlines() if "=" in line
                    and not line.startswith("#"))

    while spec_mig_devices() != set(after) or nfd_labels().get("nvidia.com/mig.config.state") != "success" \
            or nfd_labels().get("nvidia.com/gpu.count") != "56":
        assert time.monotonic() - applied < 1.0, (sorted(spec_mig_devices())[:3], nfd_labels())
        time.sleep(0.02)
    assert nfd_labels()["nvidia.com/mig.config"] == "all-1g.5gb"
    assert time.monotonic() - applied < 1.0
    assert node.kubelet.registered("nvidia.com/gpu") == 1


@pytest.mark.slow
def test_a_resource_that_appears_registers_and_one_that_goes_ends_empty(node_factory):
    node = node_factory("A100-SXM4-40GB:2", MIG_MIXED)
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: len(f) == 2, what="two GPUs")
    status, _ = node.gpud.client.request("PUT", "/v1/mig?wait=true", {"layout": "all-1g.5gb"})
    assert status == 200
    new = node.sharing_ids("nvidia.com/mig-1g.5gb")
    assert len(new) == 14
    node.kubelet.frame_where("nvidia.com/mig-1g.5gb", lambda f: sorted(i for i, _ in f) == sorted(new),
                             what="the new resource's devices")
    node.kubelet.wait(lambda: node.kubelet.streams_ended.get("nvidia.com/gpu") == 1, what="nvidia.com/gpu ended")
    assert node.kubelet.last_frame("nvidia.com/gpu") == []  # its last word: no devices
    gone = [r.endpoint for r in node.kubelet.registrations if r.resource_name == "nvidia.com/gpu"][0]
    assert not (node.kubelet_dir / gone).exists()


@pytest.mark.slow
def test_kubelet_and_gpud_restarts(node_factory):
    node = node_factory("A100-SXM4-40GB:1", TIME_SLICED.format(strategy="none"), unhealthy_after=1.0)
    ids = node.sharing_ids("nvidia.com/gpu")
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: [i for i, _ in f] == ids, what="the devices")

    node.kubelet.restart()
    node.kubelet.wait(lambda: node.kubelet.registered("nvidia.com/gpu") == 2, what="registered again")
    endpoint = node.kubelet.registrations[-1].endpoint
    (node.kubelet_dir / endpoint).unlink()  # the kubelet removes plugin sockets when it starts
    node.kubelet.wait(lambda: node.kubelet.registered("nvidia.com/gpu") == 3, what="the endpoint restarted")
    assert (node.kubelet_dir / endpoint).is_socket()

    assert node.gpud.stop() == 0
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: f and all(h == "Unhealthy" for _, h in f), timeout=5,
                             what="Unhealthy while gpud is away")
    node.gpud = node.start_gpud()  # same simulated node: same UUIDs
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: [i for i, _ in f] == ids and all_healthy(f), timeout=10,
                             what="Healthy with gpud back")
    assert cli("sim", "xid", "0", "79", socket=node.gpud.socket).returncode == 0
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: not all_healthy(f), what="following the new gpud")
    events = {e["event"] for e in node.log_events()}
    assert {"gpud_unreachable", "devices_unhealthy_gpud_unreachable", "gpud_restarted", "kubelet_socket_changed",
            "endpoint_socket_gone"} <= events


@pytest.mark.slow
def test_mps_replicas_get_their_daemons_environment(node_factory, mps_tmp):
    sharing = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
    node = node_factory("t4", sharing, config=f"mps:\n  enabled: true\n  pipe_root: {mps_tmp / 'mps'}\n"
                                               f"  log_root: {mps_tmp / 'mpslog'}\n")
    (daemon,) = running_daemons(node.gpud, 1)
    client_env = node.gpud.client.get(f"/v1/mps/{daemon['name']}/client-env")
    ids = node.sharing_ids("nvidia.com/gpu")
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: [i for i, _ in f] == ids, what="the replicas")
    channel, plugin = node.kubelet.plugin("nvidia.com/gpu")
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[ids[1]])])
    with channel:
        deadline = time.monotonic() + 10
        while True:  # until the plugin has read the daemon's environment (it follows the mps events)
            try:
                (given,) = plugin.Allocate(request, timeout=5).container_responses
                break
            except grpc.RpcError as exc:
                assert "MPS" in exc.details() and time.monotonic() < deadline, exc.details()
                time.sleep(0.1)
    assert dict(given.envs) == {**client_env["env"], "NVIDIA_VISIBLE_DEVICES": daemon["devices"][0]}
    assert [(m.host_path, m.container_path, m.read_only) for m in given.mounts] == [
        (m["source"], m["target"], m["read_only"]) for m in client_env["mounts"]]


# -- the command line ----------------------------------------------------------------------------


def test_bad_arguments_are_usage_errors(short_tmp):
    negative = cli("device-plugin", "--unhealthy-after", "-1", "--kubelet-dir", str(short_tmp))
    assert negative.returncode == 2 and "--unhealthy-after" in negative.stderr
    garbage = cli("device-plugin", "--unhealthy-after", "soon")
    assert garbage.returncode == 2 and "invalid float value" in garbage.stderr
    missing = subprocess.run([sys.executable, "-m", "gpud", "device-plugin", "--kubelet-dir",
                              str(short_tmp / "nothing"), "--log-format", "json"],
                             capture_output=True, text=True, timeout=30, cwd=REPO)
    assert missing.returncode == 2 and "kubelet_dir_missing" in missing.stdout


# -- allocation, without processes ---------------------------------------------------------------


def _resource(name="nvidia.com/gpu", strategy="time-slicing", replicas=2, gpus=2, fail_over_one=False,
              unhealthy=()) -> Resource:
    devices = tuple(PluginDevice(f"GPU-{g}::{n}", f"GPU-{g}", g, f"GPU-{g}::{n}" not in unhealthy)
                    for g in range(gpus) for n in range(replicas))
    return Resource(name, strategy, fail_over_one, devices)


def test_preferred_allocation_spreads_replicas_and_keeps_what_must_be_included():
    resource = _resource(replicas=3)
    ids = [d.id for d in resource.devices]
    assert preferred(resource, ids, [], 2) == ["GPU-0::0", "GPU-1::0"]
    assert preferred(resource, ids, ["GPU-0::2"], 3) == ["GPU-0::2", "GPU-1::0", "GPU-0::0"]
    # GPU-0 has two of its replicas in use (not available): the next goes to the emptier GPU-1
    assert preferred(resource, ["GPU-0::2", "GPU-1::0", "GPU-1::1"], [], 1) == ["GPU-1::0"]
    assert preferred(resource, ids, ["nonsense"], 1) == ["GPU-0::0"]  # unknown IDs are not invented
    assert preferred(resource, ["GPU-0::0"], [], 4) == ["GPU-0::0"]  # never more than is available
    many = _resource(replicas=12, gpus=1)
    assert preferred(many, [d.id for d in many.devices], [], 11)[-2:] == ["GPU-0::9", "GPU-0::10"]


def test_allocate_refuses_what_it_cannot_give():
    state = NodeState(cdi_kind="gpud.example/gpu", cdi_names=frozenset({"GPU-0", "GPU-1::1", "all"}))
    resource = _resource(unhealthy=("GPU-1::0",))
    given = allocate(state, resource, ["GPU-0::1", "GPU-1::1"])
    assert given.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-0,GPU-1"}
    assert given.cdi_devices == ["gpud.example/gpu=GPU-0", "gpud.example/gpu=GPU-1::1"]  # the replica's own when named
    for ids, words in (([], "no device IDs"), (["GPU-9::0"], "has no devices ['GPU-9::0']"),
                       (["GPU-1::0"], "unhealthy")):
        with pytest.raises(AllocationRefused, match=words.replace("[", r"\[").replace("]", r"\]")):
            allocate(state, resource, ids)
    with pytest.raises(AllocationRefused, match="maximum request size for shared resources is 1"):
        allocate(state, _resource(fail_over_one=True), ["GPU-0::0", "GPU-0::1"])


def test_allocate_gives_mps_replicas_their_daemon():
    client = MpsClient("gpu0", "running", {"CUDA_MPS_PIPE_DIRECTORY": "/run/gpud/mps/gpu0/pipe"},
                       (("/run/gpud/mps/gpu0/pipe", "/run/gpud/mps/gpu0/pipe", False),))
    resource = _resource(strategy="mps")
    state = NodeState(mps_clients={"GPU-0": client})
    given = allocate(state, resource, ["GPU-0::0"])
    assert given.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpud/mps/gpu0/pipe" and given.mounts == list(client.mounts)
    with pytest.raises(AllocationRefused, match=r"no MPS daemon of gpud serves \['GPU-1'\]"):
        allocate(state, resource, ["GPU-1::0"])
    stopped = NodeState(mps_clients={"GPU-0": MpsClient("gpu0", "stopped", {}, ())})
    with pytest.raises(AllocationRefused, match="gpu0 is stopped"):
        allocate(stopped, resource, ["GPU-0::0"])


def test_the_wire_format_is_the_kubelets():
    """Field numbers and names of the published v1beta1 API (k8s.io/kubelet api.proto): the kubelet
    decodes by number, so a renumbered field would be silently lost."""
    fields = {(message, f.name): f.number for message in ("RegisterRequest", "Device", "ContainerAllocateResponse",
                                                          "ContainerPreferredAllocationRequest")
              for f in pb.DESCRIPTOR.message_types_by_name[message].fields}
    assert fields == {
        ("RegisterRequest", "version"): 1, ("RegisterRequest", "endpoint"): 2, ("RegisterRequest", "resource_name"): 3,
        ("RegisterRequest", "options"): 4, ("Device", "ID"): 1, ("Device", "health"): 2, ("Device", "topology"): 3,
        ("ContainerAllocateResponse", "envs"): 1, ("ContainerAllocateResponse", "mounts"): 2,
        ("ContainerAllocateResponse", "devices"): 3, ("ContainerAllocateResponse", "annotations"): 4,
        ("ContainerAllocateResponse", "cdi_devices"): 5,
        ("ContainerPreferredAllocationRequest", "available_deviceIDs"): 1,
        ("ContainerPreferredAllocationRequest", "must_include_deviceIDs"): 2,
        ("ContainerPreferredAllocationRequest", "allocation_size"): 3}
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert [m.name for m in pb.DESCRIPTOR.services_by_name["DevicePlugin"].methods] == [
        "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer"]
