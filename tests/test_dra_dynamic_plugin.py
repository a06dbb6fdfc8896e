"""Dynamic MIG and memory-counted shares end to end: a simulated HGX H100 gpud (in-process) whose GPU 0 is
dynamic (dra.dynamic_mig_gpus) and GPU 1 shared (dra.shared_gpus), the real `gpud dra-plugin` process, the
Kubernetes API stand-in of a 1.35 server with the DRAPartitionableDevices and DRAConsumableCapacity gates on,
the kubelet stand-in, and claims allocated by the scheduler's structured allocator from the slices the plugin
published (tests/structured_allocator.py). Also what the plugin refuses of allocations no such scheduler
would make: a counter set or a GPU's memory overcommitted."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import MPS_CONTROL, kill_mps_under, need, until_async
from structured_allocator import Unschedulable, allocate, allocated_claim, claim_document, store
from test_dra_plugin import DRIVER, NODE, Node, direct_prepare, refused, registered, running_node, whole_pool

from gpud.dra.claim_cdi import spec_path

GATES = {"DRAPartitionableDevices": True, "DRAConsumableCapacity": True}
CLASSES = {name: {"metadata": {"name": name}, "spec": {"selectors": [{"cel": {
    "expression": f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{kind}'"}}]}}
    for name, kind in (("gpu.nvidia.com", "gpu"), ("mig.nvidia.com", "mig"))}


@pytest.fixture
async def node(short_tmp):
    try:
        async with running_node(short_tmp, "hgx-h100", "1.35", GATES, **{
                "dra.dynamic_mig_gpus": (0,), "dra.shared_gpus": (1,)}) as running:
            running.allocated = []  # the claims the scheduler allocated, as its allocator is given them
            yield running
    finally:
        kill_mps_under(short_tmp)  # after gpud stopped: an MPS daemon it left is not left running


async def _partitioned(node: Node) -> None:
    node.start_plugin()
    await registered(node)
    def complete() -> bool:
        slices = whole_pool(node.slices())
        return slices is not None and any(s["spec"].get("sharedCounters") for s in slices)
    await until_async(complete, timeout=20, what="the pool published whole, its counter slice with it")


async def _schedule(node: Node, name: str, request: dict) -> tuple:
    """The claim allocated as the scheduler allocates it, written to the API server: (namespace, name, uid).
    From a whole pool: one caught part-way through a rewrite (a prepared MIG device makes one) is skipped by
    the allocator, and the real scheduler tries again later."""
    document = claim_document("default", name, [request])
    slices = await until_async(lambda: whole_pool(node.slices()), timeout=10, what="the pool whole")
    allocation = allocate(slices, document, node.allocated, NODE, CLASSES, server_version="1.35", gates=GATES)
    created = node.kube.create_resource_claim("default", name, document["spec"]["devices"]["requests"], None)
    store(node.kube, created, allocation, NODE)
    node.allocated.append(allocated_claim(created, allocation))
    return "default", name, created["metadata"]["uid"]


def _mig(profile: str) -> dict:
    return {"name": "mig", "exactly": {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {
        "expression": f"device.attributes['{DRIVER}'].profile == '{profile}'"}}]}}


def _share(memory: str, compute: str) -> dict:
    return {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {
        "expression": "device.allowMultipleAllocations == true"}}], "capacity": {"requests": {
            "memory": memory, "compute": compute}}}}


async def _gpu0(node: Node) -> dict:
    _, gpus = await node.gpud.get("/v1/gpus")
    return gpus["gpus"][0]


async def test_a_claim_for_a_mig_profile_gets_a_device_made_at_its_placement_and_others_untouched(node):
    await _partitioned(node)
    first = await _schedule(node, "first", _mig("3g.40gb"))
    await asyncio.to_thread(node.kubelet.prepare, [first])
    (made,) = (await _gpu0(node))["mig"]["devices"]
    assert made["profile"] == "3g.40gb"
    _, _ = await node.gpud.post("/v1/sim/processes", {"gpu": made["uuid"], "pids": [4242]})

    second = await _schedule(node, "second", _mig("1g.10gb"))
    result = node.kube.resource_claim("default", "second")["status"]["allocation"]["devices"]["results"][0]
    answer = await asyncio.to_thread(node.kubelet.prepare, [second])
    assert list(answer[second[2]].devices[0].cdi_device_ids) == [f"k8s.{DRIVER}/claim={second[2]}-{result['device']}"]
    devices = {m["uuid"]: m for m in (await _gpu0(node))["mig"]["devices"]}
    assert devices[made["uuid"]]["pids"] == [4242] and devices[made["uuid"]]["gi_id"] == made["gi_id"]
    (new,) = [m for u, m in devices.items() if u != made["uuid"]]
    start = int(result["device"].rsplit("-", 1)[1])
    assert (new["profile"], new["placement"]["start"]) == ("1g.10gb", start)
    spec = json.loads(spec_path(node.tmp / "cdi", DRIVER, second[2]).read_text())
    assert any(n["path"].startswith("/dev/nvidia-caps/") for n in spec["devices"][0]["containerEdits"]["deviceNodes"])

    await asyncio.to_thread(node.kubelet.unprepare, [second])
    assert list((m["uuid"], m["pids"]) for m in (await _gpu0(node))["mig"]["devices"]) == [(made["uuid"], [4242])]


async def test_the_plugin_refuses_an_allocation_that_overcommits_a_counter_set(node):
    await _partitioned(node)
    published = {d["name"]: d for s in node.slices() for d in s["spec"].get("devices") or []}
    three = await _schedule(node, "three", _mig("3g.40gb"))
    taken = node.kube.resource_claim("default", "three")["status"]["allocation"]["devices"]["results"][0]["device"]
    await asyncio.to_thread(node.kubelet.prepare, [three])
    # an allocation no counting scheduler makes: a 1g.10gb on a memory slice the 3g.40gb holds
    first_slice = next(c for c in published[taken]["consumesCounters"][0]["counters"] if c.startswith("memory-slice-"))
    (overlapping_device,) = [name for name, d in published.items() if d["attributes"].get("profile") == {"string": "1g.10gb"}
                             and first_slice in d["consumesCounters"][0]["counters"]]
    overlapping = node.claim("overlapping", [overlapping_device], requests=[_mig("1g.10gb")])
    why = await refused(node, [overlapping])
    assert f"needs {first_slice} of gpu-0-counter-set" in why and "use up" in why, why
    assert [m["profile"] for m in (await _gpu0(node))["mig"]["devices"]] == ["3g.40gb"]


async def test_shares_of_one_gpu_hold_their_memory_as_mps_limits_and_never_overcommit_it(node):
    need(MPS_CONTROL is not None, "nvidia-cuda-mps-control is not installed (apt-get install nvidia-cuda-mps)")
    await _partitioned(node)
    (share,) = [d for s in node.slices() for d in s["spec"].get("devices") or [] if d.get("allowMultipleAllocations")]
    total = share["capacity"]["memory"]["value"]
    a = await _schedule(node, "a", _share("10Gi", "30"))
    b = await _schedule(node, "b", _share("20Gi", "50"))
    answers = await asyncio.to_thread(direct_prepare, node, [a, b])
    results = {c[2]: node.kube.resource_claim("default", c[1])["status"]["allocation"]["devices"]["results"][0]
               for c in (a, b)}
    for claim in (a, b):
        (device,) = answers.claims[claim[2]].devices
        assert device.share_id == results[claim[2]]["shareID"] and device.device_name == share["name"]
    env = {c[1]: dict(e.split("=", 1) for e in json.loads(spec_path(node.tmp / "cdi", DRIVER, c[2]).read_text())
                      ["devices"][0]["containerEdits"]["env"]) for c in (a, b)}
    assert (env["a"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["b"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == ("30", "50")
    assert "10240M" in env["a"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    assert "20480M" in env["b"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    with pytest.raises(Unschedulable):  # the scheduler counts the capacity left
        await _schedule(node, "too-much", _share(total, "10"))
    # an allocation no counting scheduler makes: all the memory again, while a and b hold 30Gi of it
    forged = node.claim("forged", [share["name"]], requests=[_share(total, "10")])
    document = node.kube.resource_claim("default", "forged")
    results = document["status"]["allocation"]["devices"]["results"]
    results[0].update(shareID="9e1b4b34-1c41-4a8e-9a39-0a9f3e9b7a11", consumedCapacity={"memory": total, "compute": "10"})
    node.kube.set_claim_allocation("default", "forged", results, node=NODE)
    why = await refused(node, [forged])
    assert "memory-overcommitted" in why or "free of the" in why, why
    _, claims = await node.gpud.get("/v1/claims")
    (gpu,) = claims["shares"]["gpus"]
    assert gpu["claims_mib"] == 30 * 1024 and sorted(gpu["claims"]) == sorted([a[2], b[2]])
