"""What the DRA plugin publishes of dynamic MIG GPUs (partitionable devices, KEP-4815) and of GPUs shared with
counted memory and compute (consumable capacity, KEP-5075), and the slices it writes of them for 1.34, 1.35
and 1.36 API servers (the Kubernetes API stand-in validates them as each does).

gpud's answers are built as plain dicts from the MIG tables gpud ships (gpud/nvml/data/mig-profiles.yaml:
profiles, placements, memory) and the simulator's catalogue (gpud/nvml/sim/models.yaml: the engines of
each profile), as GET /v1/mig/dynamic answers them. Counters are checked as the scheduler's structured
allocator counts them (k8s.io/dynamic-resource-allocation structured/internal/experimental:
pools_experimental.go getAndValidateCounterSets, validateDeviceCounterConsumption; allocator_experimental.go
checkAvailableCounters: an allocated device's consumption is taken off its set, and a device fits only
while every counter it consumes stays >= 0)."""

from __future__ import annotations

import asyncio
import random
from fractions import Fraction

import pytest
from helpers import until_async
from kube_api_stand_in import KubeApiStandIn, quantity_value, validate_request_policy
from kube_manifests import dra_rbac_rules

from gpud.dra.devices import (PARTITION, SHARE, STATIC_MIG, WHOLE_GPU, counter_sets, node_devices,
                              request_policy)
from gpud.dra.kube import DraApi
from gpud.dra.plugin import DraPlugin, DraState
from gpud.dra.slices import PoolContent, SlicePublisher, plan_slices
from gpud.kubernetes.node_api import KubeError, api_client
from gpud.nvml.mig_tables import shipped_table
from gpud.nvml.sim.models import catalog

NODE, DRIVER = "node-1", "gpu.nvidia.com"
NODE_ANSWER = {"driver_version": "580.65.06", "cuda_version": "13.0"}
# the simulator's model -> (gpud's architecture word, compute capability)
MODELS = {"H100-SXM5-80GB": ("hopper", "9.0"), "A100-SXM4-40GB": ("ampere", "8.0")}
BOTH_GATES = {"DRAPartitionableDevices": True, "DRAConsumableCapacity": True}


def gpu(index: int, model: str = "H100-SXM5-80GB", mig_mode: str = "disabled") -> dict:
    """A GPU as GET /v1/gpus lists it."""
    spec = catalog().models[model]
    return {"index": index, "uuid": f"GPU-{index:08d}-0000-0000-0000-000000000000", "minor_number": index,
            "name": spec.name, "architecture": MODELS[model][0], "cuda_compute_capability": MODELS[model][1],
            "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0", "brand": "NVIDIA", "memory_total_mib": spec.memory_mib,
            "numa_node": index // 4, "mig": {"mode": mig_mode, "devices": []}}


def dynamic_gpu(index: int, model: str = "H100-SXM5-80GB", mig_mode: str = "disabled",
                toggle: bool | None = None) -> dict:
    """A GPU as GET /v1/mig/dynamic lists it: the shipped table's profiles with the simulator's engines."""
    spec = catalog().models[model]
    table = shipped_table(hex(spec.pci_device_id))
    assert table is not None and spec.mig is not None
    engines = {p.id: p for p in spec.mig.gpu_instance_profiles}
    profiles = [{"name": p.name, "gi_profile_id": p.id, "multiprocessors": engines[p.id].multiprocessor_count,
                 "copy_engines": engines[p.id].copy_engines, "decoders": engines[p.id].decoders,
                 "encoders": engines[p.id].encoders, "jpeg_engines": engines[p.id].jpegs,
                 "ofa_engines": engines[p.id].ofas, "memory_mib": p.memory_mib,
                 "placements": [{"start": pl.start, "size": pl.size} for pl in p.placements]}
                for p in table.capabilities.gi_profiles]
    return {"uuid": gpu(index, model)["uuid"], "index": index, "minor_number": index, "mig_mode": mig_mode,
            "mode_toggle_without_reset": not spec.mig.needs_reset if toggle is None else toggle,
            "memory_slices": table.capabilities.memory_slices, "problem": None, "profiles": profiles}


def pool(gpus: list[dict], dynamic: list[dict] | None = None, shares: dict | None = None):
    return node_devices({"gpus": gpus}, NODE_ANSWER, None, {"gpus": dynamic or [], "instances": []}, shares)


def content(devices) -> PoolContent:
    return PoolContent([d.slice_entry() for d in devices], [s.entry() for s in counter_sets(devices)])


# -- counting as the structured allocator does ------------------------------------------------------------


def counters_of(slices: list[dict]) -> tuple[dict[str, dict[str, Fraction]], dict[str, dict]]:
    """The pool's counter sets and devices; the checks the scheduler makes of a pool (pools_experimental.go)."""
    sets: dict[str, dict[str, Fraction]] = {}
    devices = {}
    for slice_ in slices:
        for counter_set in slice_["spec"].get("sharedCounters") or []:
            assert counter_set["name"] not in sets, f"duplicate counter set name {counter_set['name']}"
            sets[counter_set["name"]] = {k: quantity_value(v["value"]) for k, v in counter_set["counters"].items()}
        for device in slice_["spec"].get("devices") or []:
            assert device["name"] not in devices, f"duplicate device name {device['name']}"
            devices[device["name"]] = device
    for device in devices.values():
        for consumption in device.get("consumesCounters") or []:
            assert consumption["counterSet"] in sets, f"counter set {consumption['counterSet']} not found"
            assert set(consumption["counters"]) <= set(sets[consumption["counterSet"]])
    return sets, devices


def fits(sets: dict[str, dict[str, Fraction]], devices: dict[str, dict], names: list[str]) -> bool:
    """Whether the devices can be allocated together (allocator_experimental.go checkAvailableCounters)."""
    available = {name: dict(counters) for name, counters in sets.items()}
    for name in names:
        for consumption in devices[name].get("consumesCounters") or []:
            for counter, value in consumption["counters"].items():
                available[consumption["counterSet"]][counter] -= quantity_value(value["value"])
    return all(v >= 0 for counters in available.values() for v in counters.values())


# -- devices -------------------------------------------------------------------------------------------------


def test_a_dynamic_h100_is_a_counter_set_every_placement_and_the_whole_gpu():
    devices, left_out = pool([gpu(0)], [dynamic_gpu(0)])
    assert left_out == []
    (counter_set,) = counter_sets(devices)
    # partitions.go: one set per GPU, NVIDIA's counter names, each the maximum over the profiles (7g.80gb's)
    assert counter_set.name == "gpu-0-counter-set"
    assert counter_set.counters == {"multiprocessors": "132", "copy-engines": "8", "decoders": "7", "encoders": "0",
                                    "jpeg-engines": "7", "ofa-engines": "1", "memory": "81152Mi",
                                    **{f"memory-slice-{i}": "1" for i in range(8)}}
    whole, *partitions = devices
    # 7 + 7 + 4 + 3 + 2 + 1 + 1 placements of the shipped H100 table
    assert whole.name == "gpu-0" and whole.kind == WHOLE_GPU and len(partitions) == 25
    assert whole.consumes == counter_set.counters  # the whole GPU consumes exactly the set
    assert whole.attributes["uuid"] == {"string": gpu(0)["uuid"]}
    assert whole.capacity["multiprocessors"] == {"value": "132"}  # partitions.go PartCapacities: the maxima
    names = [d.name for d in partitions]
    assert names[:2] == ["gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-1"]
    assert "gpu-0-mig-1g10gb-me-20-6" in names and "gpu-0-mig-1g20gb-15-6" in names and names[-1] == "gpu-0-mig-7g80gb-0-0"
    for device in partitions:
        entry = device.slice_entry()
        assert device.kind == PARTITION and device.type == "mig" and device.uuid == ""
        assert device.health_uuid == whole.uuid == device.gpu_uuid
        assert entry["attributes"]["type"] == {"string": "mig"} and "uuid" not in entry["attributes"]
        assert entry["attributes"]["parentUUID"] == {"string": whole.uuid}
        assert entry["attributes"]["profile"] == {"string": device.partition.profile}
        assert entry["attributes"]["productName"] == whole.attributes["productName"]
        start, size = device.partition.start, device.partition.size
        assert device.name.endswith(f"-{device.partition.gi_profile_id}-{start}")
        slices = {f"memory-slice-{i}" for i in range(start, start + size)}
        assert {k for k in device.consumes if k.startswith("memory-slice")} == slices
        assert {k for k in entry["capacity"] if k.startswith("memorySlice")} == {
            f"memorySlice{i}" for i in range(start, start + size)}
        (consumption,) = entry["consumesCounters"]
        assert consumption["counterSet"] == "gpu-0-counter-set"
        for counter, value in device.consumes.items():  # each placement within the set
            assert quantity_value(value) <= quantity_value(counter_set.counters[counter]), (device.name, counter)
        assert len(entry["attributes"]) + len(entry["capacity"]) <= 32


def test_a_dynamic_partition_says_what_the_static_mig_device_says():
    # the same profile made statically (GET /v1/gpus' MIG device) and offered dynamically
    static = gpu(0, mig_mode="enabled")
    static["mig"]["devices"] = [{"uuid": "MIG-1", "profile": "3g.40gb", "gi_profile_id": 9, "sm_count": 60,
                                 "memory_total_mib": 40448, "placement": {"start": 4, "size": 4},
                                 "engines": {"copy": 3, "decoder": 3, "encoder": 0, "jpeg": 3, "ofa": 0}}]
    (made,), _ = node_devices({"gpus": [static]}, NODE_ANSWER)
    devices, _ = pool([gpu(0)], [dynamic_gpu(0)])
    offered = next(d for d in devices if d.name == made.name)
    assert made.kind == STATIC_MIG and offered.capacity == made.capacity
    assert offered.attributes == {k: v for k, v in made.attributes.items() if k != "uuid"}
    assert (offered.partition.profile, offered.partition.gi_profile_id, offered.partition.start,
            offered.partition.size) == ("3g.40gb", 9, 4, 4)


@pytest.mark.parametrize("model, smallest", [("H100-SXM5-80GB", "1g10gb-19"), ("A100-SXM4-40GB", "1g5gb-19")])
def test_counters_let_seven_smallest_fit_and_nothing_more(model, smallest):
    devices, _ = pool([gpu(0, model)], [dynamic_gpu(0, model)])
    sets, by_name = counters_of([{"spec": {**part}} for part in plan_slices(content(devices), 36)])
    seven = [f"gpu-0-mig-{smallest}-{i}" for i in range(7)]
    assert fits(sets, by_name, seven)
    for other in by_name:
        if other not in seven:  # an eighth of any profile, or the whole GPU, overcommits the set
            assert not fits(sets, by_name, seven + [other]), other
    assert fits(sets, by_name, ["gpu-0"]) and not fits(sets, by_name, ["gpu-0", seven[3]])
    halves = [n for n in by_name if "-mig-3g" in n]
    assert len(halves) == 2 and fits(sets, by_name, halves)
    for name in by_name:  # every device fits alone
        assert fits(sets, by_name, [name])
    # any two placements fit together exactly when their memory slices do not overlap and the SMs suffice
    for a in by_name:
        for b in by_name:
            if a < b:
                ours = [set(k for k in c["counters"] if k.startswith("memory-slice"))
                        for n in (a, b) for c in by_name[n]["consumesCounters"]]
                if ours[0] & ours[1]:
                    assert not fits(sets, by_name, [a, b]), (a, b)


def test_the_whole_gpu_only_where_it_can_be_handed_out():
    # Ampere with MIG on: leaving MIG mode needs a reset (NVIDIA's driver does not announce it either)
    devices, _ = pool([gpu(0, "A100-SXM4-40GB", "enabled")], [dynamic_gpu(0, "A100-SXM4-40GB", "enabled")])
    assert "gpu-0" not in {d.name for d in devices} and len(devices) == 25
    assert counter_sets(devices)[0].name == "gpu-0-counter-set"  # the partitions still consume the set
    devices, _ = pool([gpu(0, mig_mode="enabled")], [dynamic_gpu(0, mig_mode="enabled")])  # H100: no reset
    assert devices[0].name == "gpu-0"
    devices, _ = pool([gpu(0, "A100-SXM4-40GB")], [dynamic_gpu(0, "A100-SXM4-40GB")])  # MIG off
    assert devices[0].name == "gpu-0"


def test_instances_and_static_mig_devices_of_a_dynamic_gpu_are_not_devices_of_their_own():
    made = gpu(0, mig_mode="enabled")
    made["mig"]["devices"] = [{"uuid": "MIG-1", "profile": "1g.10gb", "gi_profile_id": 19, "sm_count": 16,
                               "memory_total_mib": 9984, "placement": {"start": 2, "size": 1}}]
    answer = {"gpus": [dynamic_gpu(0, mig_mode="enabled")], "instances": [
        {"claim": "uid-1", "gpu_uuid": made["uuid"], "gpu_index": 0, "profile": "1g.10gb", "gi_profile_id": 19,
         "placement": {"start": 2, "size": 1}, "state": "prepared", "uuid": "MIG-1", "gi_id": 7, "ci_id": 0}]}
    devices, _ = node_devices({"gpus": [made]}, NODE_ANSWER, None, answer)
    names = [d.name for d in devices]
    assert names.count("gpu-0-mig-1g10gb-19-2") == 1 and len(names) == 26  # still published: its counters count it
    assert all(d.uuid != "MIG-1" for d in devices)


def test_a_dynamic_gpu_gpud_cannot_describe_is_left_out_and_says_why():
    problem, empty, outside, hostile = (dynamic_gpu(i) for i in range(4))
    problem["problem"] = "MIG is not supported by the driver"
    empty["profiles"] = []
    outside["profiles"][0]["placements"].append({"start": 7, "size": 2})
    hostile["profiles"] = [{"name": "1g.10gb", "gi_profile_id": "x"}]
    devices, left_out = pool([gpu(i) for i in range(5)], [problem, empty, outside, hostile])
    assert {d.gpu_index for d in devices} == {4}  # the one GPU gpud does not make dynamic
    reasons = [x["reason"] for x in left_out]
    assert reasons[0] == "dynamic MIG: MIG is not supported by the driver"
    assert reasons[1] == "dynamic MIG: gpud knows no MIG profiles of the GPU"
    assert "outside its 8 memory slices" in reasons[2] and "unusable" in reasons[3]
    # a gpud without the route, or a lost dynamic GPU
    assert [d.name for d in node_devices({"gpus": [gpu(0)]}, NODE_ANSWER, None, None)[0]] == ["gpu-0"]
    lost = {**gpu(0), "lost": True}
    assert pool([lost], [dynamic_gpu(0)]) == ([], [{"device": f"GPU 0 ({lost['uuid']})", "reason": "the GPU is lost"}])


# -- shares --------------------------------------------------------------------------------------------------


def shares(*gpus: dict, default: str | None = None, minimum: str = "1Mi", step: str = "1Mi",
           compute_default: int = 100) -> dict:
    return {"policy": {"memory": {"default": default, "min": minimum, "step": step},
                       "compute": {"default": compute_default, "min": 1, "step": 1}},
            "gpus": [{"uuid": g["uuid"], "index": g["index"], "offered_mib": g["memory_total_mib"],
                      "claims_mib": 0, "gpu_memory_mib": 0, "free_mib": g["memory_total_mib"], "claims": []}
                     for g in gpus]}


def test_a_shared_gpu_offers_its_memory_and_compute_to_many_claims():
    gpus = [gpu(0), gpu(1)]
    offered = shares(gpus[0], default="4Gi")
    offered["gpus"][0]["gpu_memory_mib"] = 1559  # promised to aliyun.com/gpu-mem: not offered again
    (shared, whole), left_out = node_devices({"gpus": gpus}, NODE_ANSWER, None, None, offered)
    assert left_out == [] and whole.kind == WHOLE_GPU and not whole.allow_multiple_allocations
    entry = shared.slice_entry()
    assert shared.kind == SHARE and entry["allowMultipleAllocations"] is True and shared.name == "gpu-0"
    assert entry["capacity"]["memory"] == {"value": "80000Mi", "requestPolicy": {
        "default": "4Gi", "validRange": {"min": "1Mi", "max": "80000Mi", "step": "1Mi"}}}
    assert entry["capacity"]["compute"] == {"value": "100", "requestPolicy": {
        "default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}}
    assert entry["attributes"]["uuid"] == {"string": gpus[0]["uuid"]}
    # no default: a claim that asks nothing gets it all, as NVIDIA's "memory" option does
    (shared, _), _ = node_devices({"gpus": gpus}, NODE_ANSWER, None, None, shares(gpus[0]))
    assert shared.capacity["memory"]["requestPolicy"]["default"] == "81559Mi"


def test_a_share_that_cannot_be_offered_is_left_out_and_says_why():
    gpus = [gpu(0), gpu(1, mig_mode="enabled"), gpu(2)]
    gpus[1]["mig"]["devices"] = [{"uuid": "MIG-1", "profile": "7g.80gb", "gi_profile_id": 0, "sm_count": 132,
                                  "memory_total_mib": 81152, "placement": {"start": 0, "size": 8}}]
    offered = shares(*gpus)
    offered["gpus"][2]["gpu_memory_mib"] = offered["gpus"][2]["offered_mib"]  # all promised to the other path
    devices, left_out = node_devices({"gpus": gpus}, NODE_ANSWER, None, {"gpus": [dynamic_gpu(0)]}, offered)
    assert [d.kind for d in devices][:1] == [WHOLE_GPU] and len([d for d in devices if d.kind == SHARE]) == 0
    assert [x["device"].endswith("as a share") for x in left_out] == [True, True, True]
    assert "dynamic MIG, which wins" in left_out[0]["reason"]
    assert "MIG mode is on" in left_out[1]["reason"]
    assert "cannot be offered for shares" in left_out[2]["reason"]
    bad = shares(gpus[0], default="lots")
    assert "cannot be offered" in node_devices({"gpus": [gpus[0]]}, NODE_ANSWER, None, None, bad)[1][0]["reason"]


def test_request_policies_are_what_the_api_server_accepts():
    rng = random.Random(5075)
    for _ in range(2000):
        capacity, minimum, step = rng.randint(0, 1 << 20), rng.randint(0, 4096), rng.randint(1, 8192)
        default = rng.choice([None, rng.randint(0, 1 << 21)])
        try:
            value, policy = request_policy(capacity, minimum, step, default)
        except ValueError:
            assert minimum + step > capacity
            continue
        assert validate_request_policy(str(value), policy, "p") == [], (capacity, minimum, step, default)
        assert value <= capacity and value + step > capacity  # the largest whole step within the capacity
    # unaligned memory: max rounded down to the step, counted from min
    value, policy = request_policy(81559 << 20, 1 << 20, 1 << 30, None, lambda b: f"{b >> 20}Mi")
    assert policy["validRange"]["max"] == "80897Mi" == policy["default"] and value == 80897 << 20
    with pytest.raises(ValueError, match="step"):
        request_policy(100, 1, 0, None)


# -- slices --------------------------------------------------------------------------------------------------


@pytest.fixture(params=["1.34", "1.35", "1.36"])
def kube(request):
    with KubeApiStandIn(server_version=request.param, feature_gates=BOTH_GATES) as stand_in:
        stand_in.create_node(NODE)
        stand_in.bind_rbac("dra", dra_rbac_rules())
        yield stand_in
        assert stand_in.unmodelled == []


def minor(kube: KubeApiStandIn) -> int:
    return int(kube.server_version.split(".")[1])


def node_state(dynamic_count: int, ampere_mig_on: bool = False) -> DraState:
    gpus = [gpu(i) for i in range(dynamic_count + 2)]
    dynamic = [dynamic_gpu(i) for i in range(dynamic_count)]
    if ampere_mig_on:
        gpus[0] = gpu(0, "A100-SXM4-40GB", "enabled")
        dynamic[0] = dynamic_gpu(0, "A100-SXM4-40GB", "enabled")
    devices, left_out = node_devices({"gpus": gpus}, NODE_ANSWER, None, {"gpus": dynamic},
                                     shares(gpus[-1]))  # the last GPU shared, the one before it whole
    return DraState(tuple(devices), tuple(left_out))


def plugin_for(kube: KubeApiStandIn, client, tmp_path) -> DraPlugin:
    plugin = DraPlugin(None, DraApi(client, NODE, DRIVER), tmp_path / "kubelet", tmp_path / "cdi", sysfs=None)
    plugin.publisher.use_server_minor(minor(kube))
    return plugin


def published(kube: KubeApiStandIn) -> list[dict]:
    return kube.resource_slices(NODE, DRIVER)


def complete(kube: KubeApiStandIn) -> list[dict]:
    """The pool's slices once all of one generation are written (none before)."""
    slices = published(kube)
    pools = {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices}
    return slices if len(pools) == 1 and len(slices) == next(iter(pools))[1] else []


def writes(kube: KubeApiStandIn) -> int:
    return sum(r["verb"] in ("create", "update", "delete") for r in kube.requests)


def check_form(slices: list[dict], server_minor: int) -> None:
    """The form of the server's version, one generation and count in all, and a pool the scheduler takes."""
    assert len({s["spec"]["pool"]["generation"] for s in slices}) == 1
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
    for slice_ in slices:
        spec = slice_["spec"]
        if server_minor >= 35:
            assert not (spec.get("sharedCounters") and spec.get("devices"))
        else:  # 1.34: a device consumes only the sets of its own slice
            own = {c["name"] for c in spec.get("sharedCounters") or []}
            assert all(c["counterSet"] in own for d in spec.get("devices") or [] for c in d.get("consumesCounters") or [])
    counters_of(slices)


async def test_dynamic_and_shared_gpus_are_published_in_the_servers_form_and_republished_on_change(kube, tmp_path):
    client = await api_client(kube.kubeconfig("dra"))
    plugin = plugin_for(kube, client, tmp_path)
    plugin.state = node_state(2)
    task = asyncio.create_task(plugin.publisher.run())
    try:
        await until_async(lambda: complete(kube), what="the pool")
        slices = complete(kube)
        check_form(slices, minor(kube))
        sets, devices = counters_of(slices)
        assert set(sets) == {"gpu-0-counter-set", "gpu-1-counter-set"} and len(devices) == 2 * 26 + 2
        assert devices["gpu-3"]["allowMultipleAllocations"] is True and "allowMultipleAllocations" not in devices["gpu-2"]
        assert len(slices) == (3 if minor(kube) == 34 else 2)  # 2 GPUs' slices + 1, or 1 counter slice + 1 (54 <= 64)
        assert plugin.publisher.problem is None
        before = writes(kube)
        plugin.publisher.changed()  # nothing changed: nothing written
        await asyncio.sleep(0.3)  # fixed time: several coalescing windows, in which no write may come
        assert writes(kube) == before
        restarted = SlicePublisher(plugin.publisher.api, plugin.desired_devices, minor(kube))  # a restart
        again = asyncio.create_task(restarted.run())
        await asyncio.sleep(0.3)  # fixed time: long enough for a write to show, were there one
        again.cancel()
        assert writes(kube) == before
        generation = slices[0]["spec"]["pool"]["generation"]
        plugin.state = node_state(2, ampere_mig_on=True)  # GPU 0 is an A100 in MIG mode now: no whole GPU
        plugin.publisher.changed()

        def changed() -> bool:
            slices = complete(kube)
            return bool(slices) and slices[0]["spec"]["pool"]["generation"] > generation \
                and "gpu-0" not in counters_of(slices)[1]

        await until_async(changed, what="the pool written again with a higher generation")
        check_form(published(kube), minor(kube))
        assert "gpu-0-mig-1g5gb-19-0" in counters_of(published(kube))[1]
    finally:
        task.cancel()
        await client.close()


@pytest.mark.parametrize("version, form", [("1.34", [26] * 16 + [2]), ("1.35", [0, 0] + [64] * 6 + [34]),
                                           ("1.36", [0, 0] + [64] * 6 + [34])])
async def test_sixteen_dynamic_gpus_are_split_to_the_limits(version, form, tmp_path):
    with KubeApiStandIn(server_version=version, feature_gates=BOTH_GATES) as kube:
        kube.create_node(NODE)
        kube.bind_rbac("dra", dra_rbac_rules())
        client = await api_client(kube.kubeconfig("dra"))
        plugin = plugin_for(kube, client, tmp_path)
        plugin.state = node_state(16)
        task = asyncio.create_task(plugin.publisher.run())
        try:
            await until_async(lambda: len(complete(kube)) == len(form), what=f"{len(form)} slices")
            slices = complete(kube)
            check_form(slices, minor(kube))
            assert sorted(len(s["spec"].get("devices") or []) for s in slices) == sorted(form)
            sets = [len(s["spec"].get("sharedCounters") or []) for s in slices]
            assert sorted(sets) == sorted([1] * 16 + [0] if version == "1.34" else [8, 8] + [0] * 7)
            assert len(counters_of(slices)[1]) == 16 * 26 + 2 and plugin.publisher.problem is None
        finally:
            task.cancel()
            await client.close()
        assert kube.unmodelled == []


@pytest.mark.parametrize("version", ["1.34", "1.35"])
async def test_a_server_without_the_gates_gets_whole_gpus_and_no_partitions(version, tmp_path):
    # DRAPartitionableDevices and DRAConsumableCapacity are off by default before 1.36: the server drops the
    # counters and allowMultipleAllocations; partitions without counters would let two claims share slices
    with KubeApiStandIn(server_version=version) as kube:
        kube.create_node(NODE)
        kube.bind_rbac("dra", dra_rbac_rules())
        client = await api_client(kube.kubeconfig("dra"))
        plugin = plugin_for(kube, client, tmp_path)
        plugin.state = node_state(2)
        task = asyncio.create_task(plugin.publisher.run())
        try:
            await until_async(lambda: plugin.publisher.counters_refused and plugin.publisher.shares_refused,
                              what="the dropped fields noticed")

            def whole_gpus_only() -> bool:
                names = {d["name"] for s in published(kube) for d in s["spec"].get("devices") or []}
                return names == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}

            await until_async(whole_gpus_only, what="only whole GPUs")
            await asyncio.sleep(0.3)  # fixed time: long enough for a write loop to show, were there one
            before = writes(kube)
            await asyncio.sleep(0.3)  # fixed time: a write loop would write again within it
            assert writes(kube) == before and plugin.publisher.problem is None
            assert not any(s["spec"].get("sharedCounters") for s in published(kube))
        finally:
            task.cancel()
            await client.close()
        assert kube.unmodelled == []


async def test_the_stand_in_refuses_request_policies_the_api_server_refuses():
    with KubeApiStandIn(server_version="1.36") as kube:
        kube.create_node(NODE)
        client = await api_client(kube.kubeconfig("admin"))
        bad = {"default": "3Mi", "validRange": {"min": "2Mi", "max": "9Mi", "step": "2Mi"}}
        device = {"name": "gpu-0", "allowMultipleAllocations": True,
                  "capacity": {"memory": {"value": "8Mi", "requestPolicy": bad}}}
        publisher = SlicePublisher(DraApi(client, NODE, DRIVER), lambda: PoolContent([device]), 36)
        try:
            with pytest.raises(KubeError) as refused:
                await publisher.publish()
        finally:
            await client.close()
        assert refused.value.status == 422
        assert "max is larger than capacity value: 8Mi" in str(refused.value)
        assert "value is not a multiple of a given step (2Mi) from (2Mi)" in str(refused.value)
