"""`gpud dra-plugin` end to end: a real plugin process, a simulated gpud (in-process), the Kubernetes API
stand-in (tests/kube_api_stand_in.py, resource.k8s.io/v1 validated as the API server does, RBAC exactly as
deploy/kubernetes grants it) and the kubelet stand-in (tests/kubelet_dra_stand_in.py, on the kubelet's own
protos, each behaviour citing the kubelet's source): registration, slices (published, republished after a
MIG change, a lost GPU and the kubelet's wipe), Prepare and Unprepare through the kubelet, health as taints
and as the kubelet's health stream, restarts of each part, and hostile claims."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
from helpers import MPS_CONTROL, REPO, kill_mps_under, mig_config, need, put_layout, start_daemon, stop_daemon, until_async
from kube_api_stand_in import KubeApiStandIn
from kube_manifests import dra_rbac_rules
from kubelet_dra_stand_in import DraKubelet, KubeletDraError
from kubelet_stand_in import Kubelet

from gpud.dra.api import v1_pb, v1_rpc
from gpud.dra.claim_cdi import spec_path

NODE = "gpu-node-1"
DRIVER = "gpu.nvidia.com"
GPU_CLASS = {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
PLUGIN_LOG_TAIL = 60  # lines of the plugin's log a failed test shows


class PluginProcess:
    """`gpud dra-plugin` as a child process, its JSON log in a file."""

    def __init__(self, tmp: Path, kube: KubeApiStandIn, gpud_socket: Path, *args: str):
        self.tmp = tmp
        self.log_path = tmp / f"dra-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpud", "dra-plugin", "--kubeconfig", str(kube.kubeconfig("dra")), "--node-name",
             NODE, "--socket", str(gpud_socket), "--kubelet-dir", str(tmp / "kubelet"), "--cdi-dir", str(tmp / "cdi"),
             "--log-format", "json", "--log-level", "debug", *args],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "KUBECONFIG": ""})

    def events(self) -> list[dict]:
        lines = self.log_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def stop(self, sig=None) -> int:
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            self.proc.wait(20)
        self._log.close()
        return self.proc.returncode


class Node:
    """One node: gpud, the API server, the kubelet and the plugin."""

    def __init__(self, tmp: Path, gpud, kube: KubeApiStandIn, kubelet: DraKubelet):
        self.tmp, self.gpud, self.kube, self.kubelet = tmp, gpud, kube, kubelet
        self.plugin: PluginProcess | None = None
        self.plugin_started_at = float("-inf")  # time.monotonic()

    def start_plugin(self, *args: str) -> PluginProcess:
        self.plugin_started_at = time.monotonic()
        self.plugin = PluginProcess(self.tmp, self.kube, self.tmp / "g.sock", *args)
        return self.plugin

    def slices(self) -> list[dict]:
        return self.kube.resource_slices(NODE, DRIVER)

    def devices(self) -> dict[str, dict]:
        return {d["name"]: d for s in self.slices() for d in s["spec"]["devices"]}

    def generation(self) -> int | None:
        generations = {s["spec"]["pool"]["generation"] for s in self.slices()}
        return max(generations) if generations else None

    def claim(self, name: str, devices: list[str], config: list[dict] | None = None, requests=None) -> tuple:
        requests = requests or [{**GPU_CLASS, "name": f"r{i}"} for i in range(len(devices))]
        results = [{"request": r["name"], "driver": DRIVER, "pool": NODE, "device": d}
                   for r, d in zip(requests, devices)]
        claim = self.kube.create_resource_claim("default", name, requests, results, config=config, node=NODE)
        return ("default", name, claim["metadata"]["uid"])


@contextlib.asynccontextmanager
async def running_node(tmp: Path, preset: str = "hgx-a100-4gpu", server_version: str = "1.36",
                       feature_gates: dict[str, bool] | None = None, **overrides):
    """gpud (in-process, simulated `preset`, gpud.yaml `overrides`), the API server stand-in of
    `server_version` and the kubelet stand-in; the plugin is started by the test."""
    for sub in ("g", "kubelet", "cdi"):
        (tmp / sub).mkdir()
    gpud = await start_daemon(mig_config(tmp, preset).with_overrides(**{"mps.log_root": str(tmp / "mpslog"),
                                                                        **overrides}))
    kube = KubeApiStandIn(server_version=server_version, feature_gates=feature_gates)
    kube.create_node(NODE)
    kube.bind_rbac("dra", dra_rbac_rules())
    kubelet = DraKubelet(tmp / "kubelet", NODE, wipe=kube.wipe_resource_slices, wiping_delay_s=2.0)
    kubelet.start()
    running = Node(tmp, gpud, kube, kubelet)
    try:
        yield running
    finally:
        if running.plugin is not None:
            try:
                running.plugin.stop()
            finally:  # a plugin that outlives its SIGTERM is when its log matters most
                # the plugin's side of a failure, in the failed test's report (pytest shows a passed test's
                # output to no one): its JSON log is a file that goes with the test's directory
                print(f"the plugin's log, last {PLUGIN_LOG_TAIL} lines:",
                      *running.plugin.log_path.read_text().splitlines()[-PLUGIN_LOG_TAIL:], sep="\n")
        kubelet.stop()
        if running.gpud is not None:
            await stop_daemon(running.gpud)
        assert kube.unmodelled == []
        kube.stop()


@pytest.fixture
async def node(short_tmp):
    async with running_node(short_tmp) as running:
        yield running


async def refused(node: Node, claims: list[tuple]) -> str:
    """Why the kubelet failed the pod's start: the plugin's error for its claim."""
    with pytest.raises(KubeletDraError) as refusal:
        await asyncio.to_thread(node.kubelet.prepare, claims)
    return str(refusal.value)


def direct_prepare(node: Node, claims: list[tuple]):
    """NodePrepareResources on the plugin's v1 service with the kubelet's deadline, every claim's answer kept."""
    with grpc.insecure_channel(f"unix://{node.tmp / 'kubelet' / 'plugins' / DRIVER / 'dra.sock'}") as channel:
        return v1_rpc.DRAPluginStub(channel).NodePrepareResources(v1_pb.NodePrepareResourcesRequest(
            claims=[v1_pb.Claim(namespace=n, name=c, uid=u) for n, c, u in claims]), timeout=45)


async def registered(node: Node, timeout: float = 20.0) -> None:
    await until_async(lambda: node.kubelet.connected(DRIVER, node.plugin_started_at), timeout=timeout,
                      what="the plugin started last registered with the kubelet and connected")


def whole_pool(slices: list[dict]) -> list[dict] | None:
    """The slices of one pool when they make it whole: one generation, as many slices as it counts. The plugin
    rewrites its slices one by one when gpud's devices change, and the scheduler's allocator skips a pool caught
    part-way (incomplete: pools_incubating.go GatherPools) until it is whole again."""
    generations = {s["spec"]["pool"]["generation"] for s in slices}
    counts = {s["spec"]["pool"]["resourceSliceCount"] for s in slices}
    return slices if len(generations) == 1 and counts == {len(slices)} else None


async def published(node: Node, count: int, timeout: float = 20.0) -> dict[str, dict]:
    await until_async(lambda: len(node.devices()) == count, timeout=timeout, what=f"{count} devices published")
    return node.devices()


async def test_registers_publishes_and_prepares_through_the_kubelet(node):
    node.start_plugin()
    await registered(node)
    registration = next(r for r in node.kubelet.registrations if r.name == DRIVER)
    assert registration.service == "v1.DRAPlugin"  # the first of its list the kubelet supports
    devices = await published(node, 4)
    (slice_,) = node.slices()
    assert slice_["spec"]["pool"] == {"name": NODE, "generation": slice_["spec"]["pool"]["generation"],
                                      "resourceSliceCount": 1}
    assert slice_["metadata"]["ownerReferences"][0]["kind"] == "Node"
    assert sorted(devices) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    claim = node.claim("one-gpu", ["gpu-1"])
    answer = await asyncio.to_thread(node.kubelet.prepare, [claim])
    (device,) = answer[claim[2]].devices
    assert (device.pool_name, device.device_name, list(device.request_names)) == (NODE, "gpu-1", ["r0"])
    assert list(device.cdi_device_ids) == [f"k8s.gpu.nvidia.com/claim={claim[2]}-gpu-1"]
    assert spec_path(node.tmp / "cdi", DRIVER, claim[2]).exists()
    _, held = await node.gpud.get("/v1/claims")
    assert [(c["uid"], [d["gpu_index"] for d in c["devices"]]) for c in held["claims"]] == [(claim[2], [1])]
    # a conflicting claim fails naming the holder; the first is unchanged
    other = node.claim("same-gpu", ["gpu-1"])
    assert "held by claim default/one-gpu" in await refused(node, [other])
    await asyncio.to_thread(node.kubelet.unprepare, [claim])
    assert not spec_path(node.tmp / "cdi", DRIVER, claim[2]).exists()
    _, held = await node.gpud.get("/v1/claims")
    assert held["claims"] == []
    await asyncio.to_thread(node.kubelet.unprepare, [claim])  # again: success


async def test_a_mig_change_is_republished_within_a_second_with_a_higher_generation(node):
    node.start_plugin()
    await published(node, 4)
    before = node.generation()
    status, answer = await put_layout(node.gpud, "all-balanced")
    assert status == 200, answer
    changed_at = time.monotonic()
    devices = await published(node, 16, timeout=10)
    took = time.monotonic() - changed_at
    assert node.generation() > before and took < 1.0, took
    assert all("-mig-" in name for name in devices)


async def test_slices_the_kubelet_wipes_are_published_again(node):
    node.start_plugin()
    await published(node, 4)
    before = node.generation()
    node.kube.wipe_resource_slices(NODE)
    await published(node, 4, timeout=5)
    assert node.generation() > before


async def test_an_xid_taints_the_device_and_is_unhealthy_on_the_health_stream_within_a_second(node):
    node.start_plugin()
    await registered(node)
    await published(node, 4)
    status, _ = await node.gpud.post("/v1/sim/xid", {"gpu": 2, "xid": 79})
    assert status == 200
    injected = time.monotonic()
    await until_async(lambda: node.kubelet.health(NODE, "gpu-2") == "Unhealthy", timeout=5,
                      what="gpu-2 Unhealthy on the health stream")
    assert time.monotonic() - injected < 1.0
    assert "XID 79" in node.kubelet.health_info(NODE, "gpu-2").message
    await until_async(lambda: node.devices()["gpu-2"].get("taints"), timeout=5, what="gpu-2 tainted")
    (taint,) = node.devices()["gpu-2"]["taints"]
    assert (taint["key"], taint["value"], taint["effect"]) == ("gpu.nvidia.com/xid", "79", "NoSchedule")
    assert all(not d.get("taints") for name, d in node.devices().items() if name != "gpu-2")
    # gpud's recovery: the taint goes, the device is healthy again
    status, _ = await node.gpud.post("/v1/sim/gpu-recover", {"gpu": 2})
    async with node.gpud.http.post("http://localhost/v1/health/2/clear") as response:
        assert response.status == 200
    await until_async(lambda: not node.devices()["gpu-2"].get("taints"), timeout=5, what="gpu-2 untainted")
    await until_async(lambda: node.kubelet.health(NODE, "gpu-2") == "Healthy", timeout=5, what="gpu-2 Healthy")


async def test_a_restarted_plugin_keeps_its_claims_and_the_kubelet_does_not_prepare_again(node):
    plugin = node.start_plugin()
    await registered(node)
    await published(node, 4)
    claim = node.claim("kept", ["gpu-0"])
    await asyncio.to_thread(node.kubelet.prepare, [claim])
    plugin.stop(9)  # killed: no clean shutdown
    node.start_plugin()
    await registered(node)
    await asyncio.to_thread(node.kubelet.restart)  # wipes the node's slices, keeps its prepared claims
    await registered(node)
    await published(node, 4, timeout=10)
    other = node.claim("other", ["gpu-0"])
    assert "held by claim default/kept" in await refused(node, [other])
    await asyncio.to_thread(node.kubelet.unprepare, [claim])
    await asyncio.to_thread(node.kubelet.prepare, [other])


async def test_a_thousand_hostile_claims_at_once_each_get_an_answer(node):
    node.start_plugin()
    await registered(node)
    await published(node, 4)
    real = node.claim("real", ["gpu-3"])
    foreign = node.kube.create_resource_claim("default", "foreign", [GPU_CLASS], [
        {"request": "gpu", "driver": "other.example.com", "pool": NODE, "device": "x"}], node=NODE)
    claims = [real, ("default", "foreign", foreign["metadata"]["uid"]), ("default", "real", str(uuid.uuid4()))]
    claims += [("default", f"missing-{i}", str(uuid.uuid4())) for i in range(997)]
    started = time.monotonic()
    answer = (await asyncio.to_thread(direct_prepare, node, claims)).claims  # each claim's own answer
    assert time.monotonic() - started < 45  # the kubelet's deadline
    assert not answer[real[2]].error
    assert "has no device of driver gpu.nvidia.com" in answer[claims[1][2]].error
    assert "deleted and created again" in answer[claims[2][2]].error
    assert all("not found" in answer[c[2]].error for c in claims[3:])
    assert node.plugin.proc.poll() is None


async def test_a_corrupt_checkpoint_is_set_aside_and_the_claims_rebuilt_from_their_specs(node):
    plugin = node.start_plugin()
    await registered(node)
    await published(node, 4)
    claim = node.claim("kept", ["gpu-2"])
    await asyncio.to_thread(node.kubelet.prepare, [claim])
    plugin.stop()
    checkpoint = node.tmp / "kubelet" / "plugins" / DRIVER / "gpud-checkpoint.json"
    checkpoint.write_text('{"format": "gpud-dra-checkpoint/v1", "claims": {')  # torn by hand
    plugin = node.start_plugin()
    await registered(node)
    await until_async(lambda: any(e.get("event") == "checkpoint_unreadable" for e in plugin.events()), timeout=10,
                      what="the unreadable checkpoint said")
    said = next(e for e in plugin.events() if e.get("event") == "checkpoint_unreadable")
    assert said["rebuilt_claims"] == 1 and checkpoint.with_name(checkpoint.name + ".corrupt").exists()
    other = node.claim("other", ["gpu-2"])
    assert "held by claim" in await refused(node, [other])  # the rebuilt claim still holds its GPU
    await asyncio.to_thread(node.kubelet.unprepare, [claim])
    assert not spec_path(node.tmp / "cdi", DRIVER, claim[2]).exists()
    await asyncio.to_thread(node.kubelet.prepare, [other])
    assert plugin.proc.poll() is None


async def test_the_v1beta1_service_answers_as_v1_does(node):
    from gpud.dra.api import v1beta1_pb, v1beta1_rpc

    node.start_plugin()
    await registered(node)
    await published(node, 4)
    claim = node.claim("beta", ["gpu-0"])
    socket = node.tmp / "kubelet" / "plugins" / DRIVER / "dra.sock"

    def prepare_and_unprepare():
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = v1beta1_rpc.DRAPluginStub(channel)
            request = [v1beta1_pb.Claim(namespace=claim[0], name=claim[1], uid=claim[2])]
            prepared = stub.NodePrepareResources(v1beta1_pb.NodePrepareResourcesRequest(claims=request), timeout=45)
            unprepared = stub.NodeUnprepareResources(v1beta1_pb.NodeUnprepareResourcesRequest(claims=request),
                                                     timeout=45)
            return prepared, unprepared

    prepared, unprepared = await asyncio.to_thread(prepare_and_unprepare)
    (device,) = prepared.claims[claim[2]].devices
    assert device.device_name == "gpu-0" and list(device.cdi_device_ids) == [
        f"k8s.gpu.nvidia.com/claim={claim[2]}-gpu-0"]
    assert unprepared.claims[claim[2]].error == ""


async def test_while_gpud_is_away_every_device_reads_unknown_and_comes_back(node):
    node.start_plugin("--unhealthy-after", "1")
    await registered(node)
    await published(node, 4)
    await until_async(lambda: node.kubelet.health(NODE, "gpu-0") == "Healthy", timeout=5, what="gpu-0 Healthy")
    await stop_daemon(node.gpud)
    node.gpud = None
    await until_async(lambda: all(node.kubelet.health(NODE, f"gpu-{i}") == "Unknown" for i in range(4)),
                      timeout=10, what="every device Unknown while gpud is away")
    await until_async(lambda: all(any(t["key"] == "gpu.nvidia.com/unmonitored" for t in d.get("taints") or [])
                                  for d in node.devices().values()), timeout=10, what="every device unmonitored")
    node.gpud = await start_daemon(mig_config(node.tmp, "hgx-a100-4gpu"))
    try:
        await until_async(lambda: node.kubelet.health(NODE, "gpu-0") == "Healthy", timeout=15,
                          what="gpu-0 Healthy again")
    except AssertionError as exc:  # the kubelet's side of it (CI once saw it never come)
        raise AssertionError(f"{exc}; the kubelet's last health message: {node.kubelet.health_messages[-1:]}; "
                             f"its health streams' ends: {node.kubelet.health_stream_errors[-3:]}") from None
    await until_async(lambda: not any(d.get("taints") for d in node.devices().values()), timeout=10,
                      what="no taint once gpud is back")


def _sharing(strategy: str, **config) -> list[dict]:
    return [{"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": strategy, **config}}}}]


async def test_an_mps_claim_is_a_client_of_gpuds_mps_daemon_with_its_limits(node):
    need(MPS_CONTROL is not None, "nvidia-cuda-mps-control is not installed (apt-get install nvidia-cuda-mps)")
    node.start_plugin()
    await registered(node)
    await published(node, 4)
    claim = node.claim("mps", ["gpu-3"], config=_sharing("MPS", mpsConfig={
        "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"}))
    try:
        await asyncio.to_thread(node.kubelet.prepare, [claim])
        spec = json.loads(spec_path(node.tmp / "cdi", DRIVER, claim[2]).read_text())
        (device,) = spec["devices"]
        env = dict(e.split("=", 1) for e in device["containerEdits"]["env"])
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert "10240M" in env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
        _, mps = await node.gpud.get("/v1/mps")
        (daemon,) = mps["daemons"]
        assert daemon["name"] == "gpu3" and daemon["state"] == "running"
        mounts = {m["containerPath"] for m in device["containerEdits"]["mounts"]}
        assert env["CUDA_MPS_PIPE_DIRECTORY"] in mounts and "/dev/shm" in mounts
        await asyncio.to_thread(node.kubelet.unprepare, [claim])
        await until_async(lambda: _no_daemons(node), timeout=10, what="the claim's MPS daemon gone with it")
    finally:
        kill_mps_under(node.tmp)


async def _no_daemons(node) -> bool:
    _, mps = await node.gpud.get("/v1/mps")
    return mps["daemons"] == []


async def test_a_time_slice_gpud_cannot_set_fails_the_claim_saying_why(node):
    node.start_plugin()
    await registered(node)
    await published(node, 4)
    claim = node.claim("long", ["gpu-2"], config=_sharing("TimeSlicing", timeSlicingConfig={"interval": "Long"}))
    why = await refused(node, [claim])
    assert "time-slice interval Long could not be set" in why and "nvidia-smi" in why
    _, held = await node.gpud.get("/v1/claims")
    assert held["claims"] == [] and not spec_path(node.tmp / "cdi", DRIVER, claim[2]).exists()


async def test_one_owner_for_both_paths_the_device_plugin_and_dra(node):
    """gpud device-plugin beside gpud dra-plugin on one node: a GPU the device plugin gave a pod is refused to
    a claim naming the pod (the kubelet's PodResources), a GPU a claim holds is shown Unhealthy to the device
    manager and refused by Allocate naming the claim."""
    device_plugin_dir = node.tmp / "kubelet" / "device-plugins"
    device_plugin_dir.mkdir()
    device_manager = Kubelet(device_plugin_dir)  # its PodResources socket: <kubelet dir>/pod-resources/kubelet.sock
    with (node.tmp / "device-plugin.log").open("w") as log:
        device_plugin = subprocess.Popen(
            [sys.executable, "-m", "gpud", "device-plugin", "--socket", str(node.tmp / "g.sock"), "--kubelet-dir",
             str(device_plugin_dir), "--device-list-strategy", "envvar", "--log-format", "json"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        node.start_plugin()
        await registered(node)
        await published(node, 4)
        _, gpus = await node.gpud.get("/v1/gpus")
        uuids = [g["uuid"] for g in gpus["gpus"]]
        await asyncio.to_thread(device_manager.frame_where, "nvidia.com/gpu", lambda f: len(f) == 4, 20, "4 GPUs")
        await asyncio.to_thread(device_manager.allocate, "nvidia.com/gpu", [uuids[1]], 5.0, ("team", "old-pod", "main"))
        claim = node.claim("wants-gpu-1", ["gpu-1"])
        why = await refused(node, [claim])
        assert "held by pod team/old-pod container main (nvidia.com/gpu) through the device plugin" in why
        claim = node.claim("gets-gpu-2", ["gpu-2"])
        await asyncio.to_thread(node.kubelet.prepare, [claim])
        frame = await asyncio.to_thread(device_manager.frame_where, "nvidia.com/gpu",
                                        lambda f: dict(f).get(uuids[2]) == "Unhealthy", 10, "GPU 2 Unhealthy")
        assert {i: h for i, h in frame if i != uuids[2]} == {uuids[0]: "Healthy", uuids[1]: "Healthy",
                                                            uuids[3]: "Healthy"}
        with pytest.raises(grpc.RpcError) as refusal:
            await asyncio.to_thread(device_manager.allocate, "nvidia.com/gpu", [uuids[2]])
        assert f"held by DRA claim default/gets-gpu-2 ({claim[2]})" in refusal.value.details()
        await asyncio.to_thread(node.kubelet.unprepare, [claim])  # released: the device plugin's again
        await asyncio.to_thread(device_manager.frame_where, "nvidia.com/gpu",
                                lambda f: dict(f).get(uuids[2]) == "Healthy", 10, "GPU 2 Healthy again")
    finally:
        device_plugin.terminate()
        device_plugin.wait(10)
        device_manager.stop()
