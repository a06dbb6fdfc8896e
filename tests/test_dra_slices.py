"""The slice publisher (gpud/dra/slices.py) against the Kubernetes API stand-in, which validates slices as
the API server does: a pool split to the per-slice limits, every change with a higher generation, a
shrinking pool's extra slices deleted, nothing written while nothing changed, and slices deleted by
someone else (the kubelet's wipe) written again."""

from __future__ import annotations

import asyncio

import pytest
from helpers import until_async
from kube_api_stand_in import KubeApiStandIn
from kube_manifests import dra_rbac_rules

from gpud.dra.kube import DraApi
from gpud.dra.slices import (MAX_DEVICES, MAX_DEVICES_WITH_TAINTS_OR_COUNTERS, PoolContent, SlicePublisher,
                             plan_slices, split_devices)
from gpud.kubernetes.node_api import api_client

NODE, DRIVER = "node-1", "gpu.nvidia.com"


def devices(count: int, tainted: int = 0) -> list[dict]:
    found = []
    for i in range(count):
        entry = {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}, "index": {"int": i}},
                 "capacity": {"memory": {"value": "80Gi"}}}
        if i < tainted:
            entry["taints"] = [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}]
        found.append(entry)
    return found


def test_split_keeps_to_the_limits():
    assert [len(c) for c in split_devices(devices(300))] == [MAX_DEVICES, MAX_DEVICES, 44]
    assert [len(c) for c in split_devices(devices(100, tainted=1))] == [MAX_DEVICES_WITH_TAINTS_OR_COUNTERS, 36]
    counting = devices(100)
    counting[99]["consumesCounters"] = [{"counterSet": "gpu-99-counter-set", "counters": {"memory": {"value": "1"}}}]
    assert [len(c) for c in split_devices(counting)] == [MAX_DEVICES_WITH_TAINTS_OR_COUNTERS, 36]
    assert split_devices([]) == []
    assert plan_slices(PoolContent([]), 34) == plan_slices(PoolContent([]), 36) == [{"devices": []}]  # never no slice


@pytest.fixture
def kube():
    with KubeApiStandIn(server_version="1.36") as stand_in:
        stand_in.create_node(NODE)
        stand_in.bind_rbac("dra", dra_rbac_rules())
        yield stand_in
        assert stand_in.unmodelled == []


async def test_a_pool_is_split_republished_shrunk_and_written_again_after_a_wipe(kube):
    client = await api_client(kube.kubeconfig("dra"))
    wanted = {"devices": devices(300)}
    api = DraApi(client, NODE, DRIVER)
    publisher = SlicePublisher(api, lambda: PoolContent(wanted["devices"]), 36)
    task = asyncio.create_task(publisher.run())

    def pool() -> list[tuple[int, int, int]]:
        return sorted((s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"],
                       len(s["spec"]["devices"])) for s in kube.resource_slices(NODE, DRIVER))

    try:
        await until_async(lambda: len(pool()) == 3, what="three slices")
        assert pool() == [(1, 3, 44), (1, 3, 128), (1, 3, 128)]
        names = {d["name"] for s in kube.resource_slices(NODE, DRIVER) for d in s["spec"]["devices"]}
        assert names == {f"gpu-{i}" for i in range(300)}
        writes = sum(r["verb"] in ("create", "update", "delete") for r in kube.requests)
        publisher.changed()  # nothing changed: nothing written
        await asyncio.sleep(0.3)  # fixed time: several coalescing windows, in which no write may come
        assert sum(r["verb"] in ("create", "update", "delete") for r in kube.requests) == writes
        wanted["devices"] = devices(70, tainted=2)  # a MIG change: fewer devices, two tainted
        publisher.changed()
        await until_async(lambda: pool() == [(2, 2, 6), (2, 2, 64)], what="the pool shrunk to two slices")
        tainted = [d["name"] for s in kube.resource_slices(NODE, DRIVER) for d in s["spec"]["devices"] if d.get("taints")]
        assert sorted(tainted) == ["gpu-0", "gpu-1"]
        kube.wipe_resource_slices(NODE)
        await until_async(lambda: [(count, size) for _, count, size in pool()] == [(2, 6), (2, 64)]
                          and len({g for g, _, _ in pool()}) == 1 and pool()[0][0] > 2,
                          what="the pool written again after the wipe, with a higher generation")
        assert publisher.problem is None
    finally:
        task.cancel()
        await client.close()


async def test_a_server_without_device_taints_is_said_once_and_served_without_them(kube):
    with KubeApiStandIn(server_version="1.35") as old:  # DRADeviceTaints off by default before 1.36
        old.create_node(NODE)
        old.bind_rbac("dra", dra_rbac_rules())
        client = await api_client(old.kubeconfig("dra"))
        publisher = SlicePublisher(DraApi(client, NODE, DRIVER), lambda: PoolContent(devices(4, tainted=1)), 35)
        task = asyncio.create_task(publisher.run())
        try:
            await until_async(lambda: old.resource_slices(NODE, DRIVER), what="a slice")
            await until_async(lambda: publisher.taints_refused, what="the dropped taints noticed")
            await asyncio.sleep(0.3)  # fixed time: long enough for a write loop to show, were there one
            (slice_,) = old.resource_slices(NODE, DRIVER)
            assert len(slice_["spec"]["devices"]) == 4 and publisher.problem is None
            assert slice_["spec"]["pool"]["generation"] <= 2  # no write loop over the dropped field
        finally:
            task.cancel()
            await client.close()
