"""GPUs shared by DRA claims with counted memory (gpud.yaml dra.shared_gpus, KEP-5075 consumable capacity),
gpud's side: PUT /v1/claims/{uid} with `capacity`, one ledger of each GPU's memory over the claims and
gpu_memory's units (no MiB promised twice, in either order), the units withdrawn from the device plugin while
claims hold memory, the policies and ledger GET /v1/claims publishes, and all of it kept across a restart."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest
from helpers import mig_config, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi

from gpud.config import ConfigError, DraConfig, ShareComputePolicy, ShareMemoryPolicy, parse_config
from gpud.device_plugin.allocation import AllocationRefused, allocate
from gpud.device_plugin.state import (NodeState, claimed_devices, counted_shares, resources_from_sharing,
                                      without_claimed)

RESOURCE = "nvidia.com/gpu-memory"
UNIT_MIB = 1024


# -- the config ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "key"), [
    ("share_memory: {min: lots}", "dra.share_memory.min"),
    ("share_memory: {step: 1.5Ki}", "dra.share_memory.step"),  # not whole MiB: MPS limits are in MiB
    ("share_memory: {step: 0Mi}", "dra.share_memory.step"),
    ("share_memory: {min: -1Gi}", "dra.share_memory.min"),
    ("share_memory: {default: 10Gi0}", "dra.share_memory.default"),
    ("share_memory: {default: 1Gi, min: 2Gi}", "dra.share_memory.default"),  # below min
    ("share_memory: {default: 3Mi, step: 2Mi}", "dra.share_memory.default"),  # not a multiple of step
    ("share_memory: {min: 1048576}", "dra.share_memory.min"),  # a quantity is a string
    ("share_memory: {max: 1Gi}", "dra.share_memory.max"),
    ("share_compute: {default: 0}", "dra.share_compute.default"),
    ("share_compute: {default: 101}", "dra.share_compute.default"),
    ("share_compute: {min: 50, default: 40}", "dra.share_compute.default"),
    ("share_compute: {step: 30}", "dra.share_compute.default"),  # 100 is no multiple of 30
    ("share_compute: {step: '5'}", "dra.share_compute.step"),
    ("shared_gpus: [true]", "dra.shared_gpus[0]"),
    ("shared_gpus: some", "dra.shared_gpus"),
])
def test_bad_share_settings_are_refused_naming_the_key(text, key):
    with pytest.raises(ConfigError) as refused:
        parse_config(f"dra:\n  {text}\n")
    assert refused.value.key == key


def test_share_settings_are_taken_as_written():
    dra = parse_config("dra:\n  shared_gpus: all\n  share_memory: {default: 4Gi, min: 512Mi, step: 512Mi}\n"
                       "  share_compute: {default: 50, min: 10, step: 10}\n").dra
    assert dra == DraConfig(("all",), ShareMemoryPolicy("4Gi", "512Mi", "512Mi"), ShareComputePolicy(50, 10, 10))
    assert parse_config("").dra == DraConfig((), ShareMemoryPolicy(None, "1Mi", "1Mi"), ShareComputePolicy(100, 1, 1))


# -- a node ----------------------------------------------------------------------------------------

def shares_config(tmp, shared=(0, 1), gpu_memory=True):
    # the MPS control binary is absent: the daemons fail to start, which these tests do not need
    config = mig_config(tmp, "A100-SXM4-80GB:4").with_overrides(**{
        "mps.control_binary": str(tmp / "absent"), "gpu_memory.enabled": gpu_memory,
        "gpu_memory.unit_mib": UNIT_MIB})
    return dataclasses.replace(config, dra=DraConfig(shared_gpus=shared))


async def put(node, uid: str, body: dict):
    async with node.http.put(f"http://localhost/v1/claims/{uid}", json=body) as response:
        return response.status, await response.json()


async def delete(node, uid: str):
    async with node.http.delete(f"http://localhost/v1/claims/{uid}") as response:
        return response.status, await response.json()


async def put_allocations(node, pods: list[dict]):
    body = {"resource": RESOURCE, "read_at": 1_790_000_000, "pods": pods}
    async with node.http.put("http://localhost/v1/allocations", json=body) as response:
        return response.status, await response.json()


def share(device: str, memory_mib: int, compute_percent: int = 100, name: str = "c", **extra) -> dict:
    return {"namespace": "ns", "name": name, "driver": "gpu.nvidia.com", "devices": [device],
            "sharing": {"strategy": "MPS"},
            "capacity": {device: {"memory_mib": memory_mib, "compute_percent": compute_percent}}, **extra}


async def ledger(node, index: int) -> dict:
    status, view = await node.get("/v1/claims")
    assert status == 200
    assert_matches_openapi("GET", "/v1/claims", 200, view)
    return next(gpu for gpu in view["shares"]["gpus"] if gpu["index"] == index)


async def units(node, device: str) -> list[tuple[str, bool]]:
    """gpu_memory's units of a device as /v1/sharing serves them: (ID, healthy)."""
    _, sharing = await node.get("/v1/sharing")
    (resource,) = [r for r in sharing["resources"] if r["name"] == RESOURCE]
    return [(d["id"], d["healthy"]) for d in resource["devices"] if d["device"] == device]


def healthy_units(served: list[tuple[str, bool]]) -> int:
    return sum(healthy for _, healthy in served)


# -- holding shares --------------------------------------------------------------------------------

async def test_shares_fill_a_gpu_up_to_what_it_offers_and_no_further(short_tmp):
    node = await start_daemon(shares_config(short_tmp))
    try:
        _, view = await node.get("/v1/claims")
        assert_matches_openapi("GET", "/v1/claims", 200, view)
        assert view["shares"]["policy"] == {"memory": {"default": None, "min": "1Mi", "step": "1Mi"},
                                            "compute": {"default": 100, "min": 1, "step": 1}}
        assert [g["index"] for g in view["shares"]["gpus"]] == [0, 1]  # dra.shared_gpus, not 2 and 3
        gpu0 = view["shares"]["gpus"][0]
        device, offered = gpu0["uuid"], gpu0["offered_mib"]
        assert gpu0 == {"uuid": device, "index": 0, "offered_mib": offered, "claims_mib": 0, "gpu_memory_mib": 0,
                        "free_mib": offered, "claims": []}
        all_units = offered // UNIT_MIB
        assert healthy_units(await units(node, device)) == all_units

        first, second, third = (str(uuid.uuid4()) for _ in range(3))
        status, held = await put(node, first, share(device, 10_240, name="first"))
        assert status == 200, held
        assert_matches_openapi("PUT", "/v1/claims/{uid}", 200, held)
        assert held["capacity"] == {device: {"memory_mib": 10_240, "compute_percent": 100}}
        assert held["strategy"] == "MPS" and held["devices"][0]["mps_daemon"] == "gpu0"
        assert await ledger(node, 0) == {**gpu0, "claims_mib": 10_240, "free_mib": offered - 10_240, "claims": [first]}
        served = await units(node, device)  # the last units, covering the claim's memory, are withdrawn
        assert healthy_units(served) == (offered - 10_240) // UNIT_MIB
        assert [healthy for _, healthy in served] == sorted((healthy for _, healthy in served), reverse=True)

        assert (await put(node, first, share(device, 10_240, name="first")))[0] == 200  # again: counted once
        assert (await ledger(node, 0))["claims_mib"] == 10_240

        free = offered - 10_240
        status, refused = await put(node, second, share(device, free + 1, name="second"))
        assert status == 409 and refused["error"]["code"] == "memory-overcommitted", refused
        message = refused["error"]["message"]
        assert f"has {free} MiB free of the {offered} MiB" in message and "DRA claim ns/first (10240 MiB)" in message
        assert (await ledger(node, 0))["claims"] == [first]  # nothing held of the refused claim

        # compute percentages may add up past 100 (MPS allows it): only memory is counted
        assert (await put(node, second, share(device, free, compute_percent=100, name="second")))[0] == 200
        assert (await ledger(node, 0))["free_mib"] == 0
        assert healthy_units(await units(node, device)) == 0
        status, refused = await put(node, third, share(device, 1, name="third"))
        assert status == 409 and "has 0 MiB free" in refused["error"]["message"]
        assert "ns/second" in refused["error"]["message"]

        # a claim's hold grown in place is counted without its old self
        assert (await put(node, first, share(device, 10_241, name="first")))[0] == 409
        assert (await put(node, first, share(device, 5_120, name="first")))[0] == 200
        assert (await ledger(node, 0))["free_mib"] == 5_120

        assert await delete(node, second) == (200, {"uid": second, "released": True})
        assert (await ledger(node, 0))["free_mib"] == offered - 5_120
        assert healthy_units(await units(node, device)) == (offered - 5_120) // UNIT_MIB
        assert (await delete(node, first))[0] == 200
        assert healthy_units(await units(node, device)) == all_units  # every unit back
        _, allocations = await node.get("/v1/allocations")
        assert_matches_openapi("GET", "/v1/allocations", 200, allocations)
        assert allocations["problems"] == []
    finally:
        await stop_daemon(node)


async def test_the_device_plugins_units_and_the_claims_never_overcommit_in_either_order(short_tmp):
    node = await start_daemon(shares_config(short_tmp))
    try:
        gpu0, gpu1 = await ledger(node, 0), await ledger(node, 1)
        # the device plugin first: its pods' units are promised, a claim gets only the rest
        ids = [unit for unit, _ in await units(node, gpu0["uuid"])]
        status, _ = await put_allocations(node, [
            {"namespace": "ml", "pod": "train-0", "container": "main", "device_ids": ids[:30]}])
        assert status == 200
        assert (await ledger(node, 0))["gpu_memory_mib"] == 30 * UNIT_MIB
        free = gpu0["offered_mib"] - 30 * UNIT_MIB
        claim = str(uuid.uuid4())
        status, refused = await put(node, claim, share(gpu0["uuid"], free + 1))
        assert status == 409 and refused["error"]["code"] == "memory-overcommitted"
        assert "pod ml/train-0 of gpu_memory (30720 MiB)" in refused["error"]["message"]
        assert (await put(node, claim, share(gpu0["uuid"], free)))[0] == 200
        served = dict(await units(node, gpu0["uuid"]))
        assert all(served[unit] for unit in ids[:30])  # the pod's units stay healthy; every other one withdrawn
        assert healthy_units(list(served.items())) == 30
        assert (await ledger(node, 0))["free_mib"] == 0

        # the claim first: the units left are those that fit beside it, and a report past them is a problem
        other = str(uuid.uuid4())
        assert (await put(node, other, share(gpu1["uuid"], gpu1["offered_mib"] - 4 * UNIT_MIB, name="o")))[0] == 200
        served = await units(node, gpu1["uuid"])
        assert healthy_units(served) == 4
        withdrawn = [unit for unit, healthy in served if not healthy]
        assert withdrawn == [unit for unit, _ in served][4:]  # the last units
        pods = [{"namespace": "ml", "pod": "train-0", "container": "main", "device_ids": ids[:30]},
                {"namespace": "ml", "pod": "late", "container": "main", "device_ids": withdrawn[:5]}]
        assert (await put_allocations(node, pods))[0] == 200  # the kubelet is the record: taken, and reported
        _, allocations = await node.get("/v1/allocations")
        (problem,) = allocations["problems"]
        assert problem.startswith(f"{gpu1['uuid']}: overcommitted by {5 * UNIT_MIB - 4 * UNIT_MIB} MiB")
        assert "DRA claim ns/o" in problem and "pod ml/late of gpu_memory (5120 MiB)" in problem
        device = next(d for d in allocations["devices"] if d["device"] == gpu1["uuid"])
        assert device["claims_mib"] == gpu1["offered_mib"] - 4 * UNIT_MIB and device["allocated_units"] == 5
        assert (await ledger(node, 1))["free_mib"] == -UNIT_MIB
        # the claim's Prepare asked again is answered as before; only more memory is refused
        assert (await put(node, other, share(gpu1["uuid"], gpu1["offered_mib"] - 4 * UNIT_MIB, name="o")))[0] == 200
        assert (await put(node, other, share(gpu1["uuid"], gpu1["offered_mib"] - 3 * UNIT_MIB, name="o")))[0] == 409
        async with node.http.get("http://localhost/metrics") as response:
            metrics = await response.text()
        assert 'path="dra"' in metrics and "gpud_gpu_memory_promised_bytes" in metrics
        line = next(line for line in metrics.splitlines() if line.startswith("gpud_gpu_memory_promised_bytes")
                    and f'UUID="{gpu1["uuid"]}"' in line and 'path="device_plugin"' in line)
        assert float(line.rsplit(" ", 1)[1]) == 5 * UNIT_MIB << 20
        assert (await put_allocations(node, pods[:1]))[0] == 200  # the late pod gone: no problem left
        _, allocations = await node.get("/v1/allocations")
        assert allocations["problems"] == []
    finally:
        await stop_daemon(node)


async def test_shares_without_gpu_memory_count_the_claims_alone(short_tmp):
    node = await start_daemon(shares_config(short_tmp, shared=("all",), gpu_memory=False))
    try:
        gpus = [await ledger(node, index) for index in range(4)]  # "all": every GPU outside MIG mode
        claims = [str(uuid.uuid4()) for _ in range(3)]
        half = gpus[3]["offered_mib"] // 2
        assert (await put(node, claims[0], share(gpus[3]["uuid"], half, 60, name="a")))[0] == 200
        assert (await put(node, claims[1], share(gpus[3]["uuid"], half, 60, name="b")))[0] == 200
        assert (await put(node, claims[2], share(gpus[3]["uuid"], gpus[3]["offered_mib"] - 2 * half + 1)))[0] == 409
        assert (await ledger(node, 3))["claims"] == claims[:2]
    finally:
        await stop_daemon(node)


async def test_the_device_plugin_serves_a_shared_gpus_units_as_gpud_withdraws_them(short_tmp):
    """A GPU a share holds is the claims' for every resource of the device plugin but gpu_memory's: there,
    only the units gpud withdrew for the claims' memory are not handed out."""
    node = await start_daemon(shares_config(short_tmp))
    try:
        shared = await ledger(node, 0)
        assert (await put(node, str(uuid.uuid4()), share(shared["uuid"], shared["offered_mib"] - 3 * UNIT_MIB)))[0] == 200
        _, sharing = await node.get("/v1/sharing")
        _, gpus = await node.get("/v1/gpus")
        _, claims = await node.get("/v1/claims")
    finally:
        await stop_daemon(node)
    claimed, counted = claimed_devices(claims), counted_shares(claims)
    assert counted == {shared["uuid"]}
    resources = without_claimed(resources_from_sharing(sharing, gpus), claimed, counted)
    state = NodeState(resources, claimed=claimed, counted=counted)
    whole = resources["nvidia.com/gpu"]
    assert [d.healthy for d in whole.devices] == [d.device != shared["uuid"] for d in whole.devices]
    with pytest.raises(AllocationRefused, match="held by DRA claim ns/c"):
        allocate(state, whole, [shared["uuid"]])
    memory = [d for d in resources[RESOURCE].devices if d.device == shared["uuid"]]
    assert [d.healthy for d in memory] == [True] * 3 + [False] * (len(memory) - 3)
    with pytest.raises(AllocationRefused, match="unhealthy"):
        allocate(state, resources[RESOURCE], [memory[3].id])
    with pytest.raises(AllocationRefused) as refused:  # the units left get as far as the CDI spec (none written here)
        allocate(state, resources[RESOURCE], [d.id for d in memory[:3]])
    assert "CDI spec" in str(refused.value)


# -- what is refused -------------------------------------------------------------------------------

async def test_bad_capacities_are_refused_naming_the_field(short_tmp):
    node = await start_daemon(shares_config(short_tmp))
    try:
        shared = (await ledger(node, 0))["uuid"]
        _, gpus = await node.get("/v1/gpus")
        not_shared = gpus["gpus"][2]["uuid"]

        def capacity(value) -> dict:
            return {**share(shared, 1), "capacity": value}

        def of_shared(value) -> dict:
            return capacity({shared: value})

        refusals = [
            (capacity([1]), 400, "invalid-field"),  # top-level type: read_json_object's refusal
            (capacity({"GPU-unknown": {"memory_mib": 1, "compute_percent": 1}}), 400, "not one of the claim's devices"),
            (of_shared("1Gi"), 400, "takes 'memory_mib' and 'compute_percent'"),
            (of_shared({"memory_mib": 1}), 400, "both and only"),
            (of_shared({"memory_mib": 1, "compute_percent": 1, "extra": 1}), 400, "both and only"),
            (of_shared({"memory_mib": "1", "compute_percent": 1}), 400, "memory_mib must be an integer"),
            (of_shared({"memory_mib": 1.0, "compute_percent": 1}), 400, "memory_mib must be an integer"),
            (of_shared({"memory_mib": True, "compute_percent": 1}), 400, "memory_mib must be an integer"),
            (of_shared({"memory_mib": 0, "compute_percent": 1}), 400, "memory_mib must be an integer from 1"),
            (of_shared({"memory_mib": -5, "compute_percent": 1}), 400, "memory_mib must be an integer from 1"),
            (of_shared({"memory_mib": 1 << 40, "compute_percent": 1}), 400, "memory_mib must be an integer from 1"),
            (of_shared({"memory_mib": 1, "compute_percent": 0}), 400, "compute_percent must be an integer from 1 to 100"),
            (of_shared({"memory_mib": 1, "compute_percent": 101}), 400, "compute_percent"),
            (of_shared({"memory_mib": 1, "compute_percent": None}), 400, "compute_percent"),
            ({**share(shared, 1), "sharing": None}, 400, "capacity-needs-mps"),
            ({**share(shared, 1), "sharing": {"strategy": "TimeSlicing"}}, 400, "capacity-needs-mps"),
            (share(not_shared, 1), 409, "gpu-not-shared"),
            ({**share(shared, 1), "capacity": None}, 409, "gpu-shared"),  # a shared GPU is held only as a share
            ({**share(shared, 1), "capacity": {}, "sharing": None}, 409, "gpu-shared"),
        ]
        for body, status, says in refusals:
            answer_status, answer = await put(node, str(uuid.uuid4()), body)
            assert answer_status == status, (body, answer)
            assert says in answer["error"]["code"] + " " + answer["error"]["message"], (body, answer)
        _, refused = await put(node, str(uuid.uuid4()), share(not_shared, 1))
        assert "dra.shared_gpus" in refused["error"]["message"]
        _, view = await node.get("/v1/claims")
        assert view["claims"] == [] and all(g["claims_mib"] == 0 for g in view["shares"]["gpus"])
        # an exclusive hold of a GPU that is not shared is as before
        assert (await put(node, str(uuid.uuid4()), {**share(not_shared, 1), "capacity": None, "sharing": None}))[0] == 200
    finally:
        await stop_daemon(node)


# -- across a restart ------------------------------------------------------------------------------

async def test_shares_and_the_ledger_are_kept_across_a_gpud_restart(short_tmp):
    config = shares_config(short_tmp)
    node = await start_daemon(config)
    claims = [str(uuid.uuid4()) for _ in range(2)]
    try:
        device = (await ledger(node, 1))["uuid"]
        assert (await put(node, claims[0], share(device, 20_000, 30, name="a")))[0] == 200
        assert (await put(node, claims[1], share(device, 7_000, 80, name="b")))[0] == 200
        before, served, (_, view) = await ledger(node, 1), await units(node, device), await node.get("/v1/claims")
    finally:
        await stop_daemon(node)
    node = await start_daemon(config)
    try:
        assert await ledger(node, 1) == before and before["claims_mib"] == 27_000
        assert await units(node, device) == served
        _, again = await node.get("/v1/claims")
        assert again["claims"] == view["claims"]
        assert again["claims"][1]["capacity"] == {device: {"memory_mib": 7_000, "compute_percent": 80}}
        status, refused = await put(node, str(uuid.uuid4()), share(device, before["free_mib"] + 1, name="c"))
        assert status == 409 and "ns/a (20000 MiB)" in refused["error"]["message"]
        assert (await delete(node, claims[0]))[0] == 200
        assert (await ledger(node, 1))["free_mib"] == before["free_mib"] + 20_000
    finally:
        await stop_daemon(node)


async def test_a_shared_gpus_mps_daemon_runs_without_default_limits(short_tmp):
    """Each claim brings its limits (its capacity), as gpu_memory's pods do; other GPUs keep mps' defaults."""
    config = shares_config(short_tmp, gpu_memory=False).with_overrides(**{
        "mps.enabled": True, "mps.pinned_memory_limit_mib": 1000, "mps.active_thread_percentage": 50.0})
    node = await start_daemon(config)
    try:
        for _ in range(500):  # the daemons are brought up one after another, after the first inventory
            _, mps = await node.get("/v1/mps")
            if len(mps["daemons"]) == 4:
                break
            await asyncio.sleep(0.02)
        limits = {d["name"]: (d["active_thread_percentage"], d["pinned_memory_limit_mib"]) for d in mps["daemons"]}
        assert limits == {"gpu0": (None, [None]), "gpu1": (None, [None]), "gpu2": (50.0, [1000]), "gpu3": (50.0, [1000])}
    finally:
        await stop_daemon(node)
