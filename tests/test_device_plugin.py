"""`gpud device-plugin` against a kubelet stand-in (kubelet_stand_in.py: the kubelet's side of the device
plugin API v1beta1, each behaviour from the kubelet's source), with gpud and the plugin as real processes
on a simulated node."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from helpers import REPO, GpudProcess, cli, running_daemons, stand_in_nodes
from kubelet_stand_in import Kubelet

from gpud.config import Config
from gpud.device_plugin.allocation import AllocationRefused, DeviceListStrategy, allocate, preferred
from gpud.device_plugin.api import pb, rpc
from gpud.device_plugin.state import MpsClient, NodeState, PluginDevice, Resource
from gpud.nvml.reader import NodeReader, pci_numa_node
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim.presets import DGX_A100_NUMA_NODES

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
RENAMED = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      rename: nvidia.com/gpu.shared
      devices: [1]
      replicas: 2
"""  # two resources: GPU 0 as nvidia.com/gpu, GPU 1's replicas as nvidia.com/gpu.shared


class Node:
    """A simulated gpud, the kubelet stand-in and `gpud device-plugin`, each its own process or server."""

    def __init__(self, tmp: Path, preset: str, sharing: str, unhealthy_after: float = 30.0, config: str = "",
                 strategy: str | None = None, kubelet: dict | None = None):
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
        self.kubelet = Kubelet(self.kubelet_dir, **(kubelet or {}))
        self.plugin_log = tmp / "plugin.log"
        strategy_args = ["--device-list-strategy", strategy] if strategy else []
        self.plugin_args = [sys.executable, "-m", "gpud", "device-plugin", "--socket", str(self.gpud.socket),
                            "--kubelet-dir", str(self.kubelet_dir), "--unhealthy-after", str(unhealthy_after),
                            "--log-format", "json", "--pod-resources-socket", str(self.kubelet.pod_resources_socket),
                            *strategy_args]
        self.plugin = self.start_plugin()

    def start_plugin(self) -> subprocess.Popen:
        with self.plugin_log.open("a") as log:
            return subprocess.Popen(self.plugin_args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def start_gpud(self) -> GpudProcess:
        gpud = GpudProcess(self.tmp, *self.gpud_args)
        gpud.wait_healthy()
        return gpud

    def sharing_ids(self, resource: str) -> list[str]:
        document = self.gpud.client.get("/v1/sharing")
        (entry,) = [r for r in document["resources"] if r["name"] == resource]
        return [d["id"] for d in entry["devices"]]

    def deadline_allocate(self, resource: str, ids: list[str], timeout: float = 10.0, **allocate):
        """Allocate once the plugin has read what it needs (it follows gpud's events)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.kubelet.allocate(resource, ids, **allocate)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline, \
                    exc.details()
                time.sleep(0.1)

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
    node = node_factory("A100-SXM4-40GB:2", TIME_SLICED.format(strategy="none"),
                        strategy="envvar,cdi-annotations,cdi-cri")
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

    with pytest.raises(grpc.RpcError) as refused:
        node.kubelet.allocate("nvidia.com/gpu", [f"{gpu0}::0"])
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "unhealthy" in refused.value.details()

    node.gpud.client.request("POST", f"/v1/health/{gpu0}/clear", {})
    node.kubelet.frame_where("nvidia.com/gpu", all_healthy, what="Healthy again")

    second_gpu = node.kubelet.allocate("nvidia.com/gpu", [ids[2], ids[3]])
    first = node.kubelet.allocate("nvidia.com/gpu", [ids[0]])
    parent = ids[2].split("::")[0]
    # every strategy at once (--device-list-strategy envvar,cdi-annotations,cdi-cri)
    assert second_gpu.envs["NVIDIA_VISIBLE_DEVICES"] == parent  # two replicas of one GPU: that GPU
    assert first.envs["NVIDIA_VISIBLE_DEVICES"] == gpu0
    cdi = node.gpud.client.get("/v1/cdi")
    assert ids[0] in cdi["devices"]  # the stand-in device nodes exist, so the spec has the replicas
    assert [d.name for d in first.cdi_devices] == [f"{cdi['kind']}={ids[0]}"]
    assert [d.name for d in second_gpu.cdi_devices] == [f"{cdi['kind']}={i}" for i in ids[2:]]
    ((key, value),) = first.annotations.items()
    assert key.startswith("cdi.k8s.io/gpud-device-plugin_") and value == f"{cdi['kind']}={ids[0]}"
    assert len(key.split("/", 1)[1]) <= 63  # CDI's AnnotationKey limit
    assert second_gpu.annotations != first.annotations  # a key of its own per answer: no clash between resources

    with pytest.raises(grpc.RpcError) as unknown:
        node.kubelet.allocate("nvidia.com/gpu", ["GPU-not-there::0"])
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GPU-not-there::0" in unknown.value.details()

    chosen = node.kubelet.preferred("nvidia.com/gpu", ids, 2)
    assert len(chosen) == 2 and {i.split("::")[0] for i in chosen} == {gpu0, parent}
    assert node.kubelet.registered("nvidia.com/gpu") == 1  # health changes re-register nothing

    node.plugin.send_signal(signal.SIGTERM)
    assert node.plugin.wait(10) == 0
    assert not (node.kubelet_dir / registration.endpoint).exists()  # it removes its own socket
    # its stream ended: the kubelet holds every device of the resource Unhealthy
    node.kubelet.wait(lambda: node.kubelet.streams_ended.get("nvidia.com/gpu") == 1, what="the stream's end")
    assert node.kubelet.healthy("nvidia.com/gpu") == [] and len(node.kubelet.devices["nvidia.com/gpu"]) == 4


@pytest.mark.slow
def test_a_mig_change_shows_the_new_devices_within_a_second_without_registering_again(node_factory):
    node = node_factory("dgx-a100", MIG_SINGLE)
    before = node.sharing_ids("nvidia.com/gpu")
    assert len(before) == 8
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: [i for i, _ in f] == before, what="the 8 GPUs")

    # Each GPU with its NUMA node (a DGX A100's: 3 3 1 1 7 7 5 5), and two GPUs preferred on one node
    assert [node.kubelet.numa["nvidia.com/gpu"][i] for i in before] == [[n] for n in DGX_A100_NUMA_NODES]
    assert node.kubelet.preferred("nvidia.com/gpu", before, 2) == before[:2]
    assert node.kubelet.preferred("nvidia.com/gpu", [before[i] for i in (0, 2, 5, 3)], 2) == before[2:4]
    assert node.kubelet.preferred("nvidia.com/gpu", before, 4, must_include=[before[6]]) == [
        before[6], before[0], before[1], before[7]]  # NUMA nodes 5 and 3

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
    gpu_of = {m["uuid"]: g["index"] for g in node.gpud.client.get("/v1/gpus")["gpus"] for m in g["mig"]["devices"]}
    assert all(node.kubelet.numa["nvidia.com/gpu"][i] == [DGX_A100_NUMA_NODES[gpu_of[i]]] for i in after)
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
    node = node_factory("A100-SXM4-40GB:2", RENAMED, unhealthy_after=1.0)
    ids = node.sharing_ids("nvidia.com/gpu")
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: [i for i, _ in f] == ids, what="the devices")
    node.kubelet.frame_where("nvidia.com/gpu.shared", lambda f: len(f) == 2, what="the other resource")

    endpoints = {r.resource_name: r.endpoint for r in node.kubelet.registrations}
    node.kubelet.restart()  # its plugin sockets removed, kubelet.sock a new one
    restarted = time.monotonic()
    assert not any((node.kubelet_dir / endpoint).exists() for endpoint in endpoints.values())
    node.kubelet.wait(lambda: all(node.kubelet.registered(name) >= 2 for name in endpoints), timeout=5,
                      what="every resource registered again within 5 s")
    assert max(node.kubelet.registered_at) - restarted < 5.0
    assert all((node.kubelet_dir / endpoint).is_socket() for endpoint in endpoints.values())
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: [i for i, _ in f] == ids and all_healthy(f),
                             what="the devices on the new stream")

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
    node = node_factory("t4", sharing, strategy="envvar",
                        config=f"mps:\n  enabled: true\n  pipe_root: {mps_tmp / 'mps'}\n"
                               f"  log_root: {mps_tmp / 'mpslog'}\n")
    (daemon,) = running_daemons(node.gpud, 1)
    client_env = node.gpud.client.get(f"/v1/mps/{daemon['name']}/client-env")
    ids = node.sharing_ids("nvidia.com/gpu")
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: [i for i, _ in f] == ids, what="the replicas")
    given = node.deadline_allocate("nvidia.com/gpu", [ids[1]])  # once the plugin has read the daemon's environment
    assert dict(given.envs) == {**client_env["env"], "NVIDIA_VISIBLE_DEVICES": daemon["devices"][0]}
    # the daemon's pipe, and the host's /dev/shm the daemon shares memory through (client-env's host_ipc,
    # which Allocate cannot set): NVIDIA's plugin mounts its daemons' shm the same way (mps.go)
    assert client_env["host_ipc"] is True
    assert [(m.host_path, m.container_path, m.read_only) for m in given.mounts] == [
        (m["source"], m["target"], m["read_only"]) for m in client_env["mounts"]] + [("/dev/shm", "/dev/shm", False)]


MIG_TIME_SLICED = """version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/mig-1g.5gb
      replicas: 2
"""


@pytest.mark.slow
def test_replicas_of_mig_devices_name_the_mig_devices_everywhere(node_factory):
    node = node_factory("A100-SXM4-40GB:2", MIG_TIME_SLICED, strategy="envvar,cdi-annotations,cdi-cri")
    status, _ = node.gpud.client.request("PUT", "/v1/mig?wait=true", {"layout": "all-1g.5gb"})
    assert status == 200
    ids = node.sharing_ids("nvidia.com/mig-1g.5gb")
    node.kubelet.frame_where("nvidia.com/mig-1g.5gb", lambda f: sorted(i for i, _ in f) == sorted(ids),
                             what="the MIG replicas")
    gpus = {g["uuid"]: g for g in node.gpud.client.get("/v1/gpus")["gpus"]}
    mig_a, mig_b = ids[0].split("::")[0], ids[2].split("::")[0]  # two MIG devices of GPU 0
    assert ids[:4] == [f"{mig_a}::0", f"{mig_a}::1", f"{mig_b}::0", f"{mig_b}::1"]

    def cdi_ready() -> bool:
        cdi = node.gpud.client.get("/v1/cdi")
        return {mig_a, mig_b} <= set(cdi["devices"])
    deadline = time.monotonic() + 10
    while not cdi_ready():
        assert time.monotonic() < deadline, "gpud's CDI spec never named the MIG devices"
        time.sleep(0.05)
    given = node.deadline_allocate("nvidia.com/mig-1g.5gb", ids[:3])
    assert given.envs["NVIDIA_VISIBLE_DEVICES"] == f"{mig_a},{mig_b}"
    kind = node.gpud.client.get("/v1/cdi")["kind"]
    named = [d.name.split("=", 1)[1].split("::")[0] for d in given.cdi_devices]
    assert sorted(set(named)) == sorted({mig_a, mig_b}) and all(n.startswith(f"{kind}=")
                                                                for n in [d.name for d in given.cdi_devices])
    (annotation,) = given.annotations.values()
    assert annotation == ",".join(d.name for d in given.cdi_devices)
    answer = json.dumps([dict(given.envs), [d.name for d in given.cdi_devices], dict(given.annotations)])
    assert not [uuid for uuid in gpus if uuid in answer], answer  # no parent GPU anywhere


@pytest.mark.slow
def test_a_slow_kubelet_registers_and_a_hanging_registration_holds_up_no_health(node_factory):
    """Issue 19 point 4: the kubelet may take its whole 10 s dial before Register answers; a Register it
    never answers delays neither the other resources nor an XID's frame; gpud gone fences on time."""
    node = node_factory("A100-SXM4-40GB:2", RENAMED, unhealthy_after=2.0, kubelet={"dial_delay_s": 9.0})
    node.kubelet.hang.add("nvidia.com/gpu.shared")
    gpu0 = node.sharing_ids("nvidia.com/gpu")
    assert len(gpu0) == 1 and len(node.sharing_ids("nvidia.com/gpu.shared")) == 2
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: [i for i, _ in f] == gpu0, timeout=20,
                             what="nvidia.com/gpu registered through a 9 s dial")
    node.kubelet.wait(lambda: any(a.resource_name == "nvidia.com/gpu.shared" for a in node.kubelet.attempts),
                      what="nvidia.com/gpu.shared's registration, hanging")
    assert node.kubelet.registered("nvidia.com/gpu.shared") == 0

    xid = time.monotonic()
    status, _ = node.gpud.client.request("POST", "/v1/sim/xid", {"gpu": 0, "xid": 79})
    assert status == 200
    node.kubelet.frame_where("nvidia.com/gpu", lambda f: not all_healthy(f), what="the XID's frame")
    arrived = node.kubelet.frame_times["nvidia.com/gpu"][-1]
    assert arrived - xid < 1.0, f"the XID took {arrived - xid:.2f} s to reach ListAndWatch"

    node.gpud.client.request("POST", f"/v1/health/{gpu0[0]}/clear", {})
    node.kubelet.frame_where("nvidia.com/gpu", all_healthy, what="Healthy again")
    gone = time.monotonic()  # gpud's stream ends while it stops: no sooner than this
    assert node.gpud.stop() == 0
    node.kubelet.wait(lambda: node.kubelet.healthy("nvidia.com/gpu") == [] and
                      node.kubelet.frame_times["nvidia.com/gpu"][-1] > gone, timeout=10, what="fenced")
    fenced = node.kubelet.frame_times["nvidia.com/gpu"][-1] - gone
    assert 2.0 <= fenced < 3.5, f"fenced after {fenced:.2f} s with --unhealthy-after 2"
    assert node.kubelet.registered("nvidia.com/gpu.shared") == 0  # still hanging all along


def test_the_stand_in_refuses_a_registration_whose_caller_gives_up_first(short_tmp):
    """As the kubelet: its dial back runs on the Register call's context, so a caller deadline shorter
    than the kubelet's dial cancels the registration (the 5 s deadline gpud once had)."""
    kubelet = Kubelet(short_tmp, dial_delay_s=2.0)
    try:
        with grpc.insecure_channel(f"unix://{short_tmp / 'kubelet.sock'}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                rpc.RegistrationStub(channel).Register(pb.RegisterRequest(
                    version="v1beta1", endpoint="nothing.sock", resource_name="example.com/dev"), timeout=1.0)
            # the caller's timer or the kubelet's cancelled dial, whichever fires first
            assert refused.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN)
            with pytest.raises(grpc.RpcError) as version:
                rpc.RegistrationStub(channel).Register(pb.RegisterRequest(
                    version="v1alpha", endpoint="nothing.sock", resource_name="example.com/dev"), timeout=5.0)
            assert "not supported" in version.value.details()
            with pytest.raises(grpc.RpcError) as name:
                rpc.RegistrationStub(channel).Register(pb.RegisterRequest(
                    version="v1beta1", endpoint="nothing.sock", resource_name="gpu"), timeout=5.0)
            assert "invalid" in name.value.details()
        assert kubelet.registrations == []
    finally:
        kubelet.stop()


# -- the command line ----------------------------------------------------------------------------


def test_bad_arguments_are_usage_errors(short_tmp):
    negative = cli("device-plugin", "--unhealthy-after", "-1", "--kubelet-dir", str(short_tmp))
    assert negative.returncode == 2 and "--unhealthy-after" in negative.stderr
    garbage = cli("device-plugin", "--unhealthy-after", "soon")
    assert garbage.returncode == 2 and "invalid float value" in garbage.stderr
    for strategy in ("volume-mounts", "envvar,envvar", "", "cdi-cri,"):
        bad = cli("device-plugin", "--device-list-strategy", strategy, "--kubelet-dir", str(short_tmp))
        assert bad.returncode == 2 and "--device-list-strategy" in bad.stderr, (strategy, bad.stderr)
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


def _whole_gpus(numa_nodes, peers: dict[int, set[int]]) -> tuple[Resource, dict[int, frozenset[int]]]:
    devices = tuple(PluginDevice(f"GPU-{i}", f"GPU-{i}", i, True, node) for i, node in enumerate(numa_nodes))
    return Resource("nvidia.com/gpu", "none", False, devices), {i: frozenset(p) for i, p in peers.items()}


def test_preferred_whole_gpus_are_nvlink_peers_on_one_numa_node():
    everyone = {i: set(range(8)) - {i} for i in range(8)}  # an NVSwitch system
    dgx, peers = _whole_gpus(DGX_A100_NUMA_NODES, everyone)
    ids = [d.id for d in dgx.devices]
    assert preferred(dgx, ids, [], 2, peers) == ["GPU-0", "GPU-1"]
    assert preferred(dgx, ["GPU-0", "GPU-2", "GPU-5", "GPU-3"], [], 2, peers) == ["GPU-2", "GPU-3"]
    assert preferred(dgx, ids, ["GPU-4"], 2, peers) == ["GPU-4", "GPU-5"]
    assert preferred(dgx, ids, ["GPU-4"], 4, peers) == ["GPU-4", "GPU-0", "GPU-1", "GPU-5"]  # two nodes: 7 and 3
    assert preferred(dgx, ids, [], 8, peers) == ids
    # NVLink first: a linked pair across NUMA nodes beats an unlinked pair on one
    pcie, peers = _whole_gpus((0, 1, 0, 0), {0: {1}, 1: {0}})
    assert preferred(pcie, ["GPU-0", "GPU-1", "GPU-2", "GPU-3"], [], 2, peers) == ["GPU-0", "GPU-1"]
    # no NVLink at all: one NUMA node
    assert preferred(pcie, ["GPU-0", "GPU-1", "GPU-3"], [], 2, {}) == ["GPU-0", "GPU-3"]
    # unknown NUMA nodes, no topology: index order; never more than is available; unknown IDs ignored
    plain, _ = _whole_gpus((None,) * 3, {})
    assert preferred(plain, ["GPU-2", "GPU-0", "GPU-1"], ["nonsense"], 2) == ["GPU-0", "GPU-1"]
    assert preferred(plain, ["GPU-2"], [], 3) == ["GPU-2"]


def test_the_numa_node_is_read_from_sysfs(short_tmp):
    simulated = SimulatedNvml("dgx-a100", short_tmp / "sim.json")
    simulated.nvmlInit()
    sysfs = Config().with_overrides(simulate="dgx-a100", sim_state=str(short_tmp / "sim.json")).sysfs_path
    assert sysfs == simulated.sysfs_root  # where gpud looks on a simulated node is where the simulator writes
    try:
        gpus = NodeReader(sysfs=sysfs).read(simulated, {}).gpus
    finally:
        simulated.nvmlShutdown()
    assert [g.numa_node for g in gpus] == list(DGX_A100_NUMA_NODES)
    assert all(g.nvlink_peers == tuple(i for i in range(8) if i != g.index) for g in gpus)  # NVSwitches
    numa = simulated.sysfs_root / "bus/pci/devices/0000:07:00.0/numa_node"
    assert numa.read_text() == "3\n"  # the kernel's file, for GPU 0 at bus 07
    for content, wanted in (("-1\n", None), ("0\n", 0), ("garbage", None)):
        numa.write_text(content)
        assert pci_numa_node(simulated.sysfs_root, "00000000:07:00.0") == wanted
    assert pci_numa_node(simulated.sysfs_root, "00000000:99:00.0") is None  # no such device
    assert pci_numa_node(simulated.sysfs_root, "not a bus id") is None


ALL_STRATEGIES = tuple(DeviceListStrategy)


def test_allocate_refuses_what_it_cannot_give():
    state = NodeState(cdi_kind="gpud.example/gpu", cdi_names=frozenset({"GPU-0", "GPU-1::1", "all"}))
    resource = _resource(unhealthy=("GPU-1::0",))
    given = allocate(state, resource, ["GPU-0::1", "GPU-1::1"], ALL_STRATEGIES)
    assert given.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-0,GPU-1"}
    assert given.cdi_devices == ["gpud.example/gpu=GPU-0", "gpud.example/gpu=GPU-1::1"]  # the replica's own when named
    for ids, words in (([], "no device IDs"), (["GPU-9::0"], "has no devices ['GPU-9::0']"),
                       (["GPU-1::0"], "unhealthy")):
        with pytest.raises(AllocationRefused, match=words.replace("[", r"\[").replace("]", r"\]")):
            allocate(state, resource, ids)
    with pytest.raises(AllocationRefused, match="maximum request size for shared resources is 1"):
        allocate(state, _resource(fail_over_one=True), ["GPU-0::0", "GPU-0::1"])
    # A CDI strategy never hands out a container without its device: no spec, or a spec without it
    with pytest.raises(AllocationRefused, match="no CDI spec"):
        allocate(NodeState(), resource, ["GPU-0::0"])
    with pytest.raises(AllocationRefused, match=r"CDI spec has no devices \['GPU-1'\]"):
        allocate(NodeState(cdi_kind="gpud.example/gpu", cdi_names=frozenset({"GPU-0"})), resource, ["GPU-1::1"])
    assert allocate(NodeState(), resource, ["GPU-0::0"], (DeviceListStrategy.ENVVAR,)).envs == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-0"}  # envvar needs no spec


def test_a_cdi_spec_still_to_come_or_behind_the_devices_has_the_plugin_read_again():
    """No event says when gpud's spec is written: the follower reads again while it lags the devices,
    and while it is still to come (at start, or after a GPU reset gpud's writers wait out)."""
    resources = {"nvidia.com/gpu": _resource()}
    named = frozenset({"GPU-0", "GPU-1"})
    assert NodeState(resources, cdi_pending=True).cdi_behind()
    assert NodeState(resources, "gpud/gpu", frozenset({"GPU-0"})).cdi_behind()
    assert not NodeState(resources, "gpud/gpu", named).cdi_behind()
    assert not NodeState(resources).cdi_behind()  # a gpud that keeps no spec: nothing to wait for


def test_each_strategy_gives_only_its_own_answer():
    state = NodeState(cdi_kind="gpud/gpu", cdi_names=frozenset({"GPU-0", "GPU-1"}))
    resource = _resource(replicas=1)
    ids = ["GPU-0::0", "GPU-1::0"]
    envvar = allocate(state, resource, ids, (DeviceListStrategy.ENVVAR,))
    assert (envvar.envs, envvar.cdi_devices, envvar.annotations) == ({"NVIDIA_VISIBLE_DEVICES": "GPU-0,GPU-1"}, [], {})
    cri = allocate(state, resource, ids, (DeviceListStrategy.CDI_CRI,))
    assert (cri.envs, cri.cdi_devices, cri.annotations) == ({}, ["gpud/gpu=GPU-0", "gpud/gpu=GPU-1"], {})
    annotated = allocate(state, resource, ids)  # the default: cdi-annotations
    ((key, value),) = annotated.annotations.items()
    assert (annotated.envs, annotated.cdi_devices, value) == ({}, [], "gpud/gpu=GPU-0,gpud/gpu=GPU-1")
    prefix, name = key.split("/", 1)
    assert prefix == "cdi.k8s.io" and name.startswith("gpud-device-plugin_") and len(name) <= 63
    assert allocate(state, resource, ids).annotations.keys() != annotated.annotations.keys()


def _mig_resource(replicas: int) -> tuple[Resource, list[str]]:
    """Two MIG devices on GPU-0 and one on GPU-1, as the sharing document lists them (parent: the GPU)."""
    migs = [("MIG-a", "GPU-0", 0), ("MIG-b", "GPU-0", 0), ("MIG-c", "GPU-1", 1)]
    ids = [m if replicas == 1 else f"{m}::{n}" for m, _, _ in migs for n in range(replicas)]
    devices = tuple(PluginDevice(i, gpu, index, True) for m, gpu, index in migs for i in ids if i.startswith(m))
    return Resource("nvidia.com/mig-1g.5gb", "none" if replicas == 1 else "time-slicing", False, devices), ids


@pytest.mark.parametrize("replicas", [1, 2])
def test_mig_devices_are_named_as_themselves_never_their_gpu(replicas):
    """Issue 19 point 3: MIG isolation holds whatever reads the answer (NVIDIA's runtime reads the env)."""
    resource, ids = _mig_resource(replicas)
    state = NodeState(cdi_kind="gpud/gpu", cdi_names=frozenset({"GPU-0", "GPU-1", "MIG-a", "MIG-b", "MIG-c"}))
    wanted = [i for i in ids if i.startswith(("MIG-a", "MIG-b"))]  # both on GPU-0
    given = allocate(state, resource, wanted, ALL_STRATEGIES)
    assert given.envs == {"NVIDIA_VISIBLE_DEVICES": "MIG-a,MIG-b"}
    assert given.cdi_devices == ["gpud/gpu=MIG-a", "gpud/gpu=MIG-b"]
    assert list(given.annotations.values()) == ["gpud/gpu=MIG-a,gpud/gpu=MIG-b"]
    everything = json.dumps([given.envs, given.cdi_devices, given.annotations])
    assert "GPU-0" not in everything


def test_allocate_gives_mps_replicas_their_daemon():
    client = MpsClient("gpu0", "running", {"CUDA_MPS_PIPE_DIRECTORY": "/run/gpud/mps/gpu0/pipe"},
                       (("/run/gpud/mps/gpu0/pipe", "/run/gpud/mps/gpu0/pipe", False),), host_ipc=True)
    resource = _resource(strategy="mps")
    state = NodeState(mps_clients={"GPU-0": client})
    given = allocate(state, resource, ["GPU-0::0"], (DeviceListStrategy.ENVVAR,))
    assert given.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpud/mps/gpu0/pipe"
    assert given.mounts == [*client.mounts, ("/dev/shm", "/dev/shm", False)]  # the memory it shares with its daemon
    with pytest.raises(AllocationRefused, match=r"no MPS daemon of gpud serves \['GPU-1'\]"):
        allocate(state, resource, ["GPU-1::0"], (DeviceListStrategy.ENVVAR,))
    stopped = NodeState(mps_clients={"GPU-0": MpsClient("gpu0", "stopped", {}, ())})
    with pytest.raises(AllocationRefused, match="gpu0 is stopped"):
        allocate(stopped, resource, ["GPU-0::0"], (DeviceListStrategy.ENVVAR,))
    # MPS inside MIG devices: gpud's daemon serves the MIG device, which is what the replica stands for
    mig, ids = _mig_resource(2)
    mig_client = MpsClient("gpu0-gi1-ci0", "running", {}, ())
    given = allocate(NodeState(mps_clients={"MIG-a": mig_client}), replace(mig, strategy="mps"), [ids[0]],
                     (DeviceListStrategy.ENVVAR,))
    assert given.envs == {"NVIDIA_VISIBLE_DEVICES": "MIG-a"} and given.mounts == []


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
