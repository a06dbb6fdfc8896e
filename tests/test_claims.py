"""gpud as the one owner of its GPUs for both Kubernetes paths: the devices DRA claims hold (/v1/claims),
kept across restarts, refused to other claims and to the device plugin's pods; a claim sharing through MPS
served by gpud's own MPS daemon (NVIDIA's real nvidia-cuda-mps-control) with its per-client limits."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from helpers import cli, mig_config, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi

from gpud.device_plugin.allocation import AllocationRefused, DeviceListStrategy, allocate
from gpud.device_plugin.state import NodeState, claimed_devices, resources_from_sharing, without_claimed
from gpud.nvml.sim.scenarios import started


async def put(node, uid: str, body: dict):
    async with node.http.put(f"http://localhost/v1/claims/{uid}", json=body) as response:
        return response.status, await response.json()


async def delete(node, uid: str):
    async with node.http.delete(f"http://localhost/v1/claims/{uid}") as response:
        return response.status, await response.json()


def body(devices, name="c", **extra) -> dict:
    return {"namespace": "ns", "name": name, "driver": "gpu.nvidia.com", "devices": devices, **extra}


def claims_config(tmp):
    return mig_config(tmp, "hgx-a100-4gpu").with_overrides(**{"mps.log_root": str(tmp / "mpslog"),
                                                              "mps.check_interval_s": 0.2})


async def test_a_claim_holds_its_devices_across_restarts_and_alone(short_tmp):
    node = await start_daemon(claims_config(short_tmp))
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    try:
        _, gpus = await node.get("/v1/gpus")
        gpu0, gpu1 = gpus["gpus"][0]["uuid"], gpus["gpus"][1]["uuid"]
        status, held = await put(node, first, body([gpu0]))
        assert status == 200 and held["devices"] == [{"uuid": gpu0, "gpu_uuid": gpu0, "gpu_index": 0, "mps_daemon": None}]
        assert_matches_openapi("PUT", "/v1/claims/{uid}", 200, held)
        assert (await put(node, first, body([gpu0])))[0] == 200  # the same again: nothing changes
        status, refused = await put(node, second, body([gpu1, gpu0], name="other"))
        assert status == 409 and refused["error"]["code"] == "device-held"
        assert f"held by DRA claim ns/c ({first})" in refused["error"]["message"]
        # both time-slicing: shared by design
        shared = {"sharing": {"strategy": "TimeSlicing"}}
        third, fourth = str(uuid.uuid4()), str(uuid.uuid4())
        assert (await put(node, third, body([gpu1], name="t1", **shared)))[0] == 200
        assert (await put(node, fourth, body([gpu1], name="t2", **shared)))[0] == 200
        assert (await put(node, second, body([gpu1], name="other")))[0] == 409
        for bad, code in ((body(["GPU-nonexistent"]), 422), (body([]), 400), (body([gpu0], namespace="NS!"), 400),
                          (body([gpu0], sharing={"strategy": "Magic"}), 400),
                          (body([gpu0], sharing={"strategy": "MPS", "interval": "Long"}), 400),
                          ({**body([gpu0]), "extra": 1}, 400)):
            assert (await put(node, str(uuid.uuid4()), bad))[0] == code, bad
        assert (await put(node, "../../etc", body([gpu0])))[0] in (400, 404)
        _, view = await node.get("/v1/claims")
        assert_matches_openapi("GET", "/v1/claims", 200, view)
        assert [c["uid"] for c in view["claims"]] == [first, third, fourth]
        shown = await asyncio.to_thread(cli, "claims", socket=short_tmp / "g.sock")
        assert shown.returncode == 0 and f"ns/c   {first}  GPU 0" in shown.stdout, shown.stdout
        assert shown.stdout.count("TimeSlicing") == 2
    finally:
        await stop_daemon(node)
    node = await start_daemon(claims_config(short_tmp))  # a gpud restart keeps every hold
    try:
        _, view = await node.get("/v1/claims")
        assert [c["uid"] for c in view["claims"]] == [first, third, fourth]
        assert await delete(node, first) == (200, {"uid": first, "released": True})
        assert await delete(node, first) == (200, {"uid": first, "released": False})
        assert (await put(node, second, body([gpu0], name="other")))[0] == 200  # free again
    finally:
        await stop_daemon(node)


async def test_the_device_plugin_refuses_and_hides_what_a_claim_holds(short_tmp):
    node = await start_daemon(claims_config(short_tmp))
    try:
        _, gpus = await node.get("/v1/gpus")
        held = gpus["gpus"][2]["uuid"]
        claim = str(uuid.uuid4())
        assert (await put(node, claim, body([held])))[0] == 200
        _, sharing = await node.get("/v1/sharing")
        _, claims = await node.get("/v1/claims")
    finally:
        await stop_daemon(node)
    claimed = claimed_devices(claims)
    resources = without_claimed(resources_from_sharing(sharing, gpus), claimed)
    resource = resources["nvidia.com/gpu"]
    assert [d.healthy for d in resource.devices] == [d.device != held for d in resource.devices]
    state = NodeState(resources, claimed=claimed)
    with pytest.raises(AllocationRefused, match=f"held by DRA claim ns/c \\({claim}\\)"):
        allocate(state, resource, [held])
    free = next(d.id for d in resource.devices if d.device != held)
    given = allocate(state, resource, [free], (DeviceListStrategy.ENVVAR,))  # the others are handed out as before
    assert given.envs["NVIDIA_VISIBLE_DEVICES"] == free


async def test_a_claim_sharing_through_mps_gets_gpuds_daemon_with_its_limits(mps_tmp):
    node = await start_daemon(claims_config(mps_tmp))
    try:
        _, gpus = await node.get("/v1/gpus")
        gpu = gpus["gpus"][3]["uuid"]
        claim = str(uuid.uuid4())
        status, held = await put(node, claim, body([gpu], sharing={"strategy": "MPS"}))
        assert status == 200 and held["devices"][0]["mps_daemon"] == "gpu3"
        for _ in range(500):
            _, mps = await node.get("/v1/mps")
            if any(d["name"] == "gpu3" and d["state"] == "running" for d in mps["daemons"]):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(mps)
        status, client = await node.get("/v1/mps/gpu3/client-env?memory_mib=2048&threads_percent=25")
        assert status == 200 and client["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert "2048M" in client["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
        assert (await delete(node, claim))[0] == 200
        for _ in range(500):  # the daemon only the claim used goes with it
            _, mps = await node.get("/v1/mps")
            if not mps["daemons"]:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(mps)
    finally:
        await stop_daemon(node)


async def test_a_reboot_drops_every_hold(short_tmp):
    config = claims_config(short_tmp)
    node = await start_daemon(config)
    try:
        _, gpus = await node.get("/v1/gpus")
        assert (await put(node, str(uuid.uuid4()), body([gpus["gpus"][0]["uuid"]])))[0] == 200
    finally:
        await stop_daemon(node)
    sim = started("hgx-a100-4gpu", short_tmp / "sim.json")  # the simulated node reboots while gpud is down
    sim.nvmlShutdown()
    sim.sim_reboot()
    node = await start_daemon(config)
    try:
        _, view = await node.get("/v1/claims")
        assert view["claims"] == []  # the kubelet prepares its pods' claims again after a reboot
    finally:
        await stop_daemon(node)
