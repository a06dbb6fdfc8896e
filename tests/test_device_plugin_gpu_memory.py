"""The gpu-memory resource of `gpud device-plugin` (issue 23): GPU memory in units, each container's
units on one GPU or MIG device, capped by that device's MPS daemon; and which pods hold the units,
read from the kubelet's PodResources API and reported to gpud.

The unit-level tests take a GET /v1/sharing document in the shape gpud's gpu-memory resource has
(one device entry per unit: `<device uuid>::<n>`, with `units` of its device and its `mps_daemon`);
the end-to-end ones run gpud on a simulated node with NVIDIA's real nvidia-cuda-mps-control, the
plugin as its own process and the kubelet stand-in (test_device_plugin.py's Node)."""

from __future__ import annotations

import asyncio
import json
import signal

import grpc
import pytest
from helpers import running_daemons
from kubelet_stand_in import Kubelet
from test_device_plugin import Node

from gpud.client import Client
from gpud.device_plugin.allocation import AllocationRefused, DeviceListStrategy, allocate, preferred
from gpud.device_plugin.api import podresources_pb, podresources_rpc
from gpud.device_plugin.podresources import AllocationReporter, holders
from gpud.device_plugin.state import MpsClient, NodeState, resources_from_sharing

RESOURCE = "nvidia.com/gpu-memory"
PIPE = "/run/gpud/mps/gpu0/pipe"


def sharing_document(units: dict[str, tuple[str, int, int]], proportional_threads: bool = False,
                     unhealthy: frozenset[str] = frozenset()) -> dict:
    """GET /v1/sharing with the gpu-memory resource: `units` maps a GPU or MIG UUID to (its GPU's UUID,
    the GPU's index, how many 1 GiB units it has)."""
    devices = [{"id": f"{device}::{n}", "parent": parent, "gpu_index": index, "healthy": device not in unhealthy,
                "device": device, "units": count, "mps_daemon": f"mps-{device}"}
               for device, (parent, index, count) in units.items() for n in range(count)]
    return {"resources": [{"name": RESOURCE, "strategy": "gpu-memory", "fail_requests_greater_than_one": False,
                           "unit_mib": 1024, "proportional_threads": proportional_threads,
                           "count": len(devices), "devices": devices}]}


GPUS = {"gpus": [{"uuid": "GPU-0", "index": 0, "numa_node": 1}, {"uuid": "GPU-1", "index": 1, "numa_node": 0}]}
TWO_GPUS = {"GPU-0": ("GPU-0", 0, 40), "GPU-1": ("GPU-1", 1, 40)}


def node_state(document: dict) -> NodeState:
    client = MpsClient("mps-GPU-0", "running", {"CUDA_MPS_PIPE_DIRECTORY": PIPE},
                       ((PIPE, PIPE, False),), host_ipc=True)
    return NodeState(resources_from_sharing(document, GPUS), cdi_kind="gpud.dev/gpu",
                     cdi_names=frozenset({"GPU-0", "GPU-1", "MIG-a"}),
                     mps_clients={"GPU-0": client, "GPU-1": MpsClient("mps-GPU-1", "running", {}, ()),
                                  "MIG-a": MpsClient("mps-MIG-a", "running", {}, ())})


def test_one_device_per_unit_with_its_gpus_numa_node():
    resource = resources_from_sharing(sharing_document(TWO_GPUS), GPUS)[RESOURCE]
    assert (resource.strategy, resource.unit_mib, len(resource.devices)) == ("gpu-memory", 1024, 80)
    assert {(d.device, d.numa_node, d.units) for d in resource.devices} == {("GPU-0", 1, 40), ("GPU-1", 0, 40)}


def test_allocate_of_7_units_is_its_device_with_7_gib_pinned_through_its_mps_daemon():
    state = node_state(sharing_document(TWO_GPUS))
    ids = [f"GPU-0::{n}" for n in range(7)]
    given = allocate(state, state.resources[RESOURCE], ids, (DeviceListStrategy.CDI_CRI,))
    assert given.cdi_devices == ["gpud.dev/gpu=GPU-0"]  # the device's CDI name, once for its 7 units
    assert given.envs == {"CUDA_MPS_PIPE_DIRECTORY": PIPE, "CUDA_VISIBLE_DEVICES": "GPU-0",
                          "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=7168M"}
    assert given.mounts == [(PIPE, PIPE, False), ("/dev/shm", "/dev/shm", False)]


@pytest.mark.parametrize(("units", "percent"), [(7, "18"), (1, "3"), (40, "100")])
def test_proportional_threads_are_the_units_share_of_the_device_rounded_up(units, percent):
    state = node_state(sharing_document(TWO_GPUS, proportional_threads=True))
    given = allocate(state, state.resources[RESOURCE], [f"GPU-1::{n}" for n in range(units)],
                     (DeviceListStrategy.ENVVAR,))
    assert given.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == percent  # 7/40 = 17.5 % -> 18
    assert given.envs["NVIDIA_VISIBLE_DEVICES"] == given.envs["CUDA_VISIBLE_DEVICES"] == "GPU-1"


def test_a_mig_device_is_named_by_its_own_uuid():
    state = node_state(sharing_document({"MIG-a": ("GPU-0", 0, 10)}))
    given = allocate(state, state.resources[RESOURCE], ["MIG-a::0", "MIG-a::1"], (DeviceListStrategy.CDI_CRI,))
    assert given.cdi_devices == ["gpud.dev/gpu=MIG-a"]
    assert given.envs == {"CUDA_VISIBLE_DEVICES": "MIG-a", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M"}
    assert "GPU-0" not in json.dumps(given.envs)


def test_units_of_two_devices_unknown_and_unhealthy_ones_are_refused():
    state = node_state(sharing_document(TWO_GPUS, unhealthy=frozenset({"GPU-1"})))
    resource = state.resources[RESOURCE]
    healthy = node_state(sharing_document(TWO_GPUS))
    with pytest.raises(AllocationRefused, match=r"on 2 devices \(GPU-0, GPU-1\)") as spanning:
        allocate(healthy, healthy.resources[RESOURCE], ["GPU-0::0", "GPU-1::0"])
    assert spanning.value.invalid  # INVALID_ARGUMENT: the kubelet fails the pod
    with pytest.raises(AllocationRefused, match="has no devices") as unknown:
        allocate(state, resource, ["GPU-7::0"])
    assert unknown.value.invalid
    with pytest.raises(AllocationRefused, match="unhealthy") as unhealthy:
        allocate(state, resource, ["GPU-1::0"])
    assert not unhealthy.value.invalid


def test_preferred_keeps_a_request_on_the_fullest_device_that_holds_it():
    resource = resources_from_sharing(sharing_document(TWO_GPUS), GPUS)[RESOURCE]
    free0 = [f"GPU-0::{n}" for n in range(30, 40)]  # GPU 0 has 10 units left, GPU 1 all 40
    free1 = [f"GPU-1::{n}" for n in range(40)]
    assert preferred(resource, free0 + free1, [], 7) == [f"GPU-0::{n}" for n in range(30, 37)]
    assert preferred(resource, free0 + free1, [], 12) == free1[:12]  # GPU 0 cannot hold 12
    assert preferred(resource, free0 + free1, ["GPU-1::5"], 3) == ["GPU-1::5", "GPU-1::0", "GPU-1::1"]
    # no device holds it: the most free units (the kubelet adds the rest, and Allocate says which two)
    assert preferred(resource, free0 + free1[:20], [], 25) == free1[:20]


def test_pod_resources_list_is_the_kubelets_wire_format():
    """Field numbers of the published PodResources v1 API (k8s.io/kubelet podresources/v1/api.proto)."""
    fields = {(message, f.name): f.number for message in ("PodResources", "ContainerResources", "ContainerDevices")
              for f in podresources_pb.DESCRIPTOR.message_types_by_name[message].fields}
    assert fields == {("PodResources", "name"): 1, ("PodResources", "namespace"): 2,
                      ("PodResources", "containers"): 3, ("ContainerResources", "name"): 1,
                      ("ContainerResources", "devices"): 2, ("ContainerResources", "cpu_ids"): 3,
                      ("ContainerResources", "memory"): 4, ("ContainerResources", "dynamic_resources"): 5,
                      ("ContainerDevices", "resource_name"): 1, ("ContainerDevices", "device_ids"): 2,
                      ("ContainerDevices", "topology"): 3}
    assert podresources_pb.DESCRIPTOR.package == "v1"
    assert podresources_pb.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name == "v1.PodResourcesLister"


def test_holders_gather_a_containers_devices_of_the_resource():
    device = podresources_pb.ContainerDevices
    response = podresources_pb.ListPodResourcesResponse(pod_resources=[
        podresources_pb.PodResources(namespace="ml", name="train", containers=[
            podresources_pb.ContainerResources(name="main", devices=[
                device(resource_name=RESOURCE, device_ids=["GPU-0::1"]),
                device(resource_name=RESOURCE, device_ids=["GPU-0::0"]),
                device(resource_name="nvidia.com/gpu", device_ids=["GPU-1"])]),
            podresources_pb.ContainerResources(name="sidecar")])])
    assert holders(response, RESOURCE) == [
        {"namespace": "ml", "pod": "train", "container": "main", "device_ids": ["GPU-0::0", "GPU-0::1"]}]
    assert holders(response, "example.com/other") == []


def test_the_stand_ins_list_without_a_kubelet_socket_is_unavailable_and_the_reporter_goes_on(short_tmp):
    """No pod-resources socket: the report is logged and tried again later, nothing raised."""
    reporter = AllocationReporter(short_tmp / "absent.sock", Client(short_tmp / "no-gpud.sock"), lambda: [RESOURCE],
                                  lambda: None)
    asyncio.run(asyncio.wait_for(reporter.report(), 10))
    assert reporter._reported == {}

    kubelet_dir = short_tmp / "k"
    kubelet_dir.mkdir()
    kubelet = Kubelet(kubelet_dir)
    try:
        kubelet.pod_devices[("ml", "train")] = {"main": {RESOURCE: ["GPU-0::0"]}}
        kubelet.numa[RESOURCE] = {"GPU-0::0": [1]}
        with grpc.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as channel:
            listed = podresources_rpc.PodResourcesListerStub(channel).List(
                podresources_pb.ListPodResourcesRequest(), timeout=5)
        (pod,) = listed.pod_resources
        (container,) = pod.containers
        (devices,) = container.devices
        assert (pod.namespace, pod.name, container.name) == ("ml", "train", "main")
        assert (devices.resource_name, list(devices.device_ids), [n.ID for n in devices.topology.nodes]) == (
            RESOURCE, ["GPU-0::0"], [1])
        # the kubelet's rate limit (100 calls a second, a burst of 10): 50 calls at once cannot all pass
        with grpc.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as channel:
            calls = [podresources_rpc.PodResourcesListerStub(channel).List.future(
                podresources_pb.ListPodResourcesRequest(), timeout=5) for _ in range(50)]
            codes = [call.code() for call in calls]
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
        # the kubelet answers, gpud does not: tried again next time, nothing recorded as reported
        reporter = AllocationReporter(kubelet.pod_resources_socket, Client(short_tmp / "no-gpud.sock"),
                                      lambda: [RESOURCE], lambda: None)
        asyncio.run(asyncio.wait_for(reporter.report(), 10))
        assert reporter._reported == {}
    finally:
        kubelet.stop()


# -- end to end: gpud, the plugin and the kubelet stand-in --------------------------------------------


@pytest.fixture
def gpu_memory_node(mps_tmp):
    """gpud with gpu_memory (`devices`: its setting, e.g. "[1]"), the plugin and the kubelet stand-in."""
    nodes = []

    def make(preset: str, devices: str = "all") -> Node:
        nodes.append(Node(mps_tmp, preset, "version: v1\n", strategy="envvar,cdi-annotations,cdi-cri",
                          config=f"gpu_memory:\n  enabled: true\n  devices: {devices}\n"
                                 f"mps:\n  pipe_root: {mps_tmp / 'mps'}\n  log_root: {mps_tmp / 'mpslog'}\n"))
        return nodes[-1]

    yield make
    for node in nodes:
        node.close()


@pytest.mark.slow
def test_gpu_memory_units_are_listed_preferred_and_allocated_on_one_device(gpu_memory_node):
    node = gpu_memory_node("A100-SXM4-80GB:2")
    daemons = {d["devices"][0]: d for d in running_daemons(node.gpud, 2)}
    gpus = node.gpud.client.get("/v1/gpus")["gpus"]
    ids = node.sharing_ids(RESOURCE)
    assert len(ids) == 2 * 79  # 80 GiB less the driver's reserve, in 1 GiB units, on each GPU
    node.kubelet.frame_where(RESOURCE, lambda f: [i for i, _ in f] == ids, what="one device per unit")
    assert node.kubelet.options[RESOURCE].get_preferred_allocation_available

    gpu0, gpu1 = (gpu["uuid"] for gpu in gpus)
    taken = [f"{gpu0}::{n}" for n in range(70)]  # GPU 0 has 9 units left, GPU 1 all 79
    available = [i for i in ids if i not in taken]
    chosen = node.kubelet.preferred(RESOURCE, available, 7)
    assert chosen == [f"{gpu0}::{n}" for n in range(70, 77)]  # the fullest device that holds 7
    assert {i.split("::")[0] for i in node.kubelet.preferred(RESOURCE, available, 12)} == {gpu1}

    given = node.deadline_allocate(RESOURCE, chosen)  # once the plugin has read the MPS daemons
    client_env = node.gpud.client.get(f"/v1/mps/{daemons[gpu0]['name']}/client-env")
    assert dict(given.envs) == {**client_env["env"], "NVIDIA_VISIBLE_DEVICES": gpu0, "CUDA_VISIBLE_DEVICES": gpu0,
                                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=7168M"}
    assert [(m.host_path, m.container_path, m.read_only) for m in given.mounts] == [
        (m["source"], m["target"], m["read_only"]) for m in client_env["mounts"]] + [("/dev/shm", "/dev/shm", False)]
    cdi = node.gpud.client.get("/v1/cdi")  # the spec names the whole device; its units are not CDI devices
    assert gpu0 in cdi["devices"] and not any("::" in name for name in cdi["devices"])
    assert [d.name for d in given.cdi_devices] == [f"{cdi['kind']}={gpu0}"]  # once, for its 7 units
    assert list(given.annotations.values()) == [f"{cdi['kind']}={gpu0}"]

    with pytest.raises(grpc.RpcError) as spanning:
        node.kubelet.allocate(RESOURCE, [f"{gpu0}::78", f"{gpu1}::0"])
    assert spanning.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert gpu0 in spanning.value.details() and gpu1 in spanning.value.details()


@pytest.mark.slow
def test_a_mig_change_re_advertises_the_units_of_the_new_devices(gpu_memory_node):
    node = gpu_memory_node("A100-SXM4-40GB:2", devices="[1]")  # GPU 1, and its MIG devices once it has them
    before = node.sharing_ids(RESOURCE)
    node.kubelet.frame_where(RESOURCE, lambda f: [i for i, _ in f] == before, what="GPU 1's units")
    status, _ = node.gpud.client.request("PUT", "/v1/mig?wait=true", {"layout": "all-1g.5gb"})
    assert status == 200
    migs = {m["uuid"] for m in node.gpud.client.get("/v1/gpus")["gpus"][1]["mig"]["devices"]}
    frame = node.kubelet.frame_where(RESOURCE, lambda f: {i.split("::")[0] for i, _ in f} == migs,
                                     what="the MIG devices' units")
    assert [i for i, _ in frame] == node.sharing_ids(RESOURCE)
    assert node.kubelet.registered(RESOURCE) == 1  # the same endpoint, new devices


def holders_by_device(node: Node) -> dict[str, list[tuple[str, str, str, int]]]:
    view = node.gpud.client.get("/v1/allocations")
    return {d["device"]: [(h["namespace"], h["pod"], h["container"], h["units"]) for h in d["holders"]]
            for d in view["devices"] if d["holders"]}


@pytest.mark.slow
def test_the_kubelets_pod_resources_reach_gpud_and_restarts_of_either_report_them_again(gpu_memory_node):
    node = gpu_memory_node("A100-SXM4-80GB:2")
    running_daemons(node.gpud, 2)
    gpu0, gpu1 = (gpu["uuid"] for gpu in node.gpud.client.get("/v1/gpus")["gpus"])
    node.kubelet.frame_where(RESOURCE, lambda f: len(f) == 2 * 79, what="the units")
    node.deadline_allocate(RESOURCE, [f"{gpu0}::{n}" for n in range(7)], container=("ml", "train", "main"))
    node.kubelet.allocate(RESOURCE, [f"{gpu1}::{n}" for n in range(3)], container=("ml", "infer", "server"))
    wanted = {gpu0: [("ml", "train", "main", 7)], gpu1: [("ml", "infer", "server", 3)]}
    # shortly after the Allocate, not at the next 10 s read
    node.gpud.wait_for(lambda: holders_by_device(node) == wanted, timeout=5, what="the allocations in gpud")
    first = node.gpud.client.get("/v1/allocations")["reported_at"]

    node.plugin.send_signal(signal.SIGTERM)
    assert node.plugin.wait(10) == 0
    node.plugin = node.start_plugin()  # the kubelet is the record: the new plugin reads List and reports it
    node.gpud.wait_for(lambda: node.gpud.client.get("/v1/allocations")["reported_at"] > first, timeout=10,
                       what="a report from the restarted plugin")
    assert holders_by_device(node) == wanted

    # gpud keeps reports in memory: a restarted gpud gets them again from the plugin, unasked
    assert node.gpud.stop() == 0
    node.gpud = node.start_gpud()  # same simulated node: same UUIDs
    node.gpud.wait_for(lambda: holders_by_device(node) == wanted, timeout=10, what="the allocations after a restart")
    assert "allocations_reported" in {e["event"] for e in node.log_events()}
