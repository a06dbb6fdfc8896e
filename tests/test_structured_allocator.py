"""The structured allocator stand-in (tests/structured_allocator.py) against slices shaped as NVIDIA's DRA
driver publishes dynamic MIG (kubernetes-sigs/dra-driver-nvidia-gpu cmd/gpu-kubelet-plugin/partitions.go:
one counter set gpu-<minor>-counter-set per GPU, a counter per capacity and one per memory slice; the whole
GPU consumes all; a placement its profile and its slices; driver.go: one slice for 1.34, a counter slice
plus a device slice per GPU for 1.35+) and memory-counted shares (consumable_shares.go). Profile figures:
H100 SXM5 80GB, nvidia-smi mig -lgip (driver 580)."""

from __future__ import annotations

import random
import re

import pytest
from kube_api_stand_in import KubeApiStandIn, decode_slice, drop_disabled_fields, validate_slice
from structured_allocator import (CANNOT_ALLOCATE, INVALID_POOLS, AllocatorError, NotModelled, Quantity,
                                  Unschedulable, allocate, allocate_claims, allocated_claim, claim_document, store)

DRIVER, NODE = "gpu.nvidia.com", "node-a"
MIB = 1024 * 1024
# profile: (GI profile id, placement starts, memory slices, SMs, copy engines, decoders, JPEG, OFA, memory MiB)
H100_PROFILES = {
    "1g.10gb": (19, range(7), 1, 16, 1, 1, 1, 0, 9984),
    "1g.20gb": (15, (0, 2, 4, 6), 2, 26, 1, 1, 1, 0, 20096),
    "2g.20gb": (14, (0, 2, 4), 2, 32, 2, 2, 2, 0, 20096),
    "3g.40gb": (9, (0, 4), 4, 60, 3, 3, 3, 0, 40448),
    "4g.40gb": (5, (0,), 4, 64, 4, 4, 4, 0, 40448),
    "7g.80gb": (0, (0,), 8, 132, 8, 7, 7, 1, 81152),
}
MEMORY_SLICES = 8
# the whole GPU: the largest of every figure over the profiles (deviceinfo.go maxCapacities)
WHOLE = {"multiprocessors": 132, "copyEngines": 8, "decoders": 7, "encoders": 0, "jpegEngines": 7, "ofaEngines": 1,
         "memory": 81152 * MIB}
COUNTER_NAMES = {"multiprocessors": "multiprocessors", "copyEngines": "copy-engines", "decoders": "decoders",
                 "encoders": "encoders", "jpegEngines": "jpeg-engines", "ofaEngines": "ofa-engines",
                 "memory": "memory"}  # partitions.go capacitiesToCounters (camelToDNSName)

CLASSES = {  # deploy/kubernetes/deviceclasses.yaml, NVIDIA's selectors
    "gpu.nvidia.com": {"metadata": {"name": "gpu.nvidia.com"}, "spec": {"selectors": [{"cel": {"expression":
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"}}]}},
    "mig.nvidia.com": {"metadata": {"name": "mig.nvidia.com"}, "spec": {"selectors": [{"cel": {"expression":
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"}}]}},
}


def quantity(value: int) -> str:
    return str(Quantity(value, "BinarySI"))  # resource.NewQuantity(v, BinarySI), as NVIDIA writes them


def counters(figures: dict[str, int], start: int, size: int) -> dict:
    out = {COUNTER_NAMES[name]: {"value": quantity(value)} for name, value in figures.items()}
    out.update({f"memory-slice-{i}": {"value": "1"} for i in range(start, start + size)})
    return out


def h100_devices(minor: int) -> list[dict]:
    counter_set = f"gpu-{minor}-counter-set"
    devices = [{"name": f"gpu-{minor}", "attributes": {"type": {"string": "gpu"}},
                "capacity": {name: {"value": quantity(value)} for name, value in WHOLE.items()},
                "consumesCounters": [{"counterSet": counter_set, "counters": counters(WHOLE, 0, MEMORY_SLICES)}]}]
    for profile, (gi, starts, size, sms, ces, decs, jpegs, ofas, mib) in H100_PROFILES.items():
        figures = {"multiprocessors": sms, "copyEngines": ces, "decoders": decs, "encoders": 0,
                   "jpegEngines": jpegs, "ofaEngines": ofas, "memory": mib * MIB}
        for start in starts:
            devices.append({
                "name": f"gpu-{minor}-mig-{profile.replace('.', '')}-{gi}-{start}",
                "attributes": {"type": {"string": "mig"}, "profile": {"string": profile}},
                "capacity": {name: {"value": quantity(value)} for name, value in figures.items()},
                "consumesCounters": [{"counterSet": counter_set, "counters": counters(figures, start, size)}]})
    return sorted(devices, key=lambda d: d["name"])  # driver.go: "Stable sort order by devicename"


def counter_set(minor: int) -> dict:
    return {"name": f"gpu-{minor}-counter-set", "counters": counters(WHOLE, 0, MEMORY_SLICES)}


def a_slice(name: str, count: int, node: str = NODE, generation: int = 1, **spec) -> dict:
    return {"metadata": {"name": name}, "spec": {"driver": DRIVER, "nodeName": node, **spec,
                                                 "pool": {"name": node, "generation": generation,
                                                          "resourceSliceCount": count}}}


def split_slices(gpus: int = 1, node: str = NODE, generation: int = 1) -> list[dict]:
    """1.35+: one slice with the counter sets, one with each GPU's devices (driver.go generateSplitResourceSlices)."""
    slices = [a_slice(f"{node}-{DRIVER}-0", gpus + 1, node, generation,
                      sharedCounters=[counter_set(m) for m in range(gpus)])]
    return slices + [a_slice(f"{node}-{DRIVER}-{m + 1}", gpus + 1, node, generation, devices=h100_devices(m))
                     for m in range(gpus)]


def combined_slices(gpus: int = 1, node: str = NODE) -> list[dict]:
    """1.34: a slice per GPU with its counter set and its devices (driver.go generateCombinedResourceSlices)."""
    return [a_slice(f"{node}-{DRIVER}-{m}", gpus, node, sharedCounters=[counter_set(m)], devices=h100_devices(m))
            for m in range(gpus)]


def mig_claim(name: str, profile: str | None = None, **request) -> dict:
    selectors = [{"cel": {"expression": f"device.attributes['gpu.nvidia.com'].profile == '{profile}'"}}]
    return claim_document("default", name, [{"name": "mig", "deviceClassName": "mig.nvidia.com",
                                             **({"selectors": selectors} if profile else {}), **request}])


def gpu_claim(name: str, **request) -> dict:
    return claim_document("default", name, [{"name": "gpu", "deviceClassName": "gpu.nvidia.com", **request}])


class Cluster:
    """Claims allocated one after the other, as successive scheduling cycles do."""

    def __init__(self, slices: list[dict], version: str = "1.36", gates: dict | None = None):
        self.slices, self.version, self.gates = slices, version, gates
        self.allocated: list[dict] = []

    def allocate(self, claim: dict) -> dict:
        allocation = allocate(self.slices, claim, self.allocated, NODE, CLASSES, self.version, self.gates)
        self.allocated.append(allocated_claim(claim, allocation))
        return allocation

    def devices(self, claim: dict) -> list[str]:
        return [r["device"] for r in self.allocate(claim)["devices"]["results"]]


PARTITIONABLE = {"DRAPartitionableDevices": True}


def test_the_test_slices_are_what_the_api_server_accepts():
    for version, slices in (("1.34", combined_slices(2)), ("1.35", split_slices(2)), ("1.36", split_slices(2))):
        for slice_ in slices:
            assert validate_slice(decode_slice(slice_), None, version) == [], (version, slice_["metadata"]["name"])


def test_placements_are_taken_first_fit_until_the_counters_are_exhausted():
    cluster = Cluster(split_slices())
    placed = [cluster.devices(mig_claim(f"c{i}", "1g.10gb"))[0] for i in range(7)]
    assert placed == [f"gpu-0-mig-1g10gb-19-{start}" for start in range(7)]
    with pytest.raises(Unschedulable) as refused:
        cluster.allocate(mig_claim("c7", "1g.10gb"))
    assert refused.value.reason == CANNOT_ALLOCATE
    # memory slice 7 is free, but no 1g.10gb placement uses it; 1g.20gb at 6 needs slice 6 too
    with pytest.raises(Unschedulable):
        cluster.allocate(mig_claim("c8", "1g.20gb"))


def test_a_whole_gpu_and_its_partitions_exclude_each_other_through_counters():
    cluster = Cluster(split_slices())
    assert cluster.devices(gpu_claim("whole")) == ["gpu-0"]
    with pytest.raises(Unschedulable):
        cluster.allocate(mig_claim("small", "1g.10gb"))
    cluster = Cluster(split_slices())
    assert cluster.devices(mig_claim("small", "1g.10gb")) == ["gpu-0-mig-1g10gb-19-0"]
    with pytest.raises(Unschedulable):
        cluster.allocate(gpu_claim("whole"))


def test_memory_slices_make_overlapping_placements_impossible():
    cluster = Cluster(split_slices())
    assert cluster.devices(mig_claim("a", "3g.40gb")) == ["gpu-0-mig-3g40gb-9-0"]
    # 60 + 64 SMs fit in 132, but 4g.40gb has only placement 0, whose memory slices 0-3 are taken
    with pytest.raises(Unschedulable):
        cluster.allocate(mig_claim("b", "4g.40gb"))
    assert cluster.devices(mig_claim("c", "1g.20gb")) == ["gpu-0-mig-1g20gb-15-4"]
    with pytest.raises(Unschedulable):  # 2g.20gb starts at 0, 2 or 4: all overlap
        cluster.allocate(mig_claim("d", "2g.20gb"))
    assert cluster.devices(mig_claim("e", "1g.10gb")) == ["gpu-0-mig-1g10gb-19-6"]


def placement(device: str) -> tuple[str, int, int]:
    profile, start = re.fullmatch(r"gpu-0-mig-(\w+)-\d+-(\d)", device).groups()
    size = {p.replace(".", ""): spec[2] for p, spec in H100_PROFILES.items()}[profile]
    return profile, int(start), size


@pytest.mark.parametrize("seed", range(20))
def test_random_claims_never_overcommit_a_counter_set(seed):
    rng = random.Random(seed)
    cluster = Cluster(split_slices())
    used_slices: set[int] = set()
    sms = 0
    for i in range(12):
        profile = rng.choice(list(H100_PROFILES))
        try:
            device = cluster.devices(mig_claim(f"c{i}", profile))[0]
        except Unschedulable:
            continue
        name, start, size = placement(device)
        taken = set(range(start, start + size))
        assert not taken & used_slices, (device, used_slices)
        used_slices |= taken
        sms += H100_PROFILES[profile][3]
        assert sms <= 132


def test_split_and_combined_slices_give_the_same_allocations():
    """The same claims on 1.34 (one slice per GPU with its counters) and 1.35 (separate counter slice)."""
    sequence = ["3g.40gb", "1g.10gb", "2g.20gb", "3g.40gb", "1g.10gb", "7g.80gb", "1g.20gb", "1g.10gb"]
    outcomes = {}
    for version, slices in (("1.34", combined_slices(2)), ("1.35", split_slices(2)), ("1.36", split_slices(2))):
        cluster = Cluster(slices, version, PARTITIONABLE if version != "1.36" else None)
        outcome = []
        for i, profile in enumerate(sequence):
            try:
                outcome.append(cluster.devices(mig_claim(f"c{i}", profile)))
            except Unschedulable:
                outcome.append(None)
        outcomes[version] = outcome
    assert outcomes["1.34"] == outcomes["1.35"] == outcomes["1.36"]
    assert outcomes["1.36"][-3:] == [None, ["gpu-0-mig-1g20gb-15-6"], ["gpu-1-mig-1g10gb-19-2"]]


def test_without_the_partitionable_gate_devices_that_consume_counters_are_not_allocated():
    with pytest.raises(Unschedulable):
        allocate(split_slices(), mig_claim("c", "1g.10gb"), [], NODE, CLASSES, "1.35")


def test_only_the_highest_generation_of_a_pool_is_used():
    old = split_slices(generation=1)
    new = split_slices(generation=2)
    for slice_ in new:
        slice_["metadata"]["name"] += "-new"
    new[1]["spec"]["devices"] = [d for d in new[1]["spec"]["devices"] if "3g40gb" not in d["name"]]
    assert allocate(old + new, mig_claim("c", "1g.10gb"), [], NODE, CLASSES)["devices"]["results"][0]["device"] \
        == "gpu-0-mig-1g10gb-19-0"
    with pytest.raises(Unschedulable):  # generation 1 still lists 3g.40gb: not used
        allocate(old + new, mig_claim("d", "3g.40gb"), [], NODE, CLASSES)


def test_an_incomplete_pool_is_not_allocated_from_since_1_35():
    incomplete = split_slices()[1:]  # the counter slice is missing
    with pytest.raises(Unschedulable) as refused:
        allocate(incomplete, gpu_claim("c"), [], NODE, CLASSES)
    assert refused.value.reason == CANNOT_ALLOCATE
    with pytest.raises(AllocatorError, match=r"asks for all devices, but resource pool gpu.nvidia.com/node-a is "
                                             r"currently being updated"):
        allocate(incomplete, gpu_claim("c", allocationMode="All"), [], NODE, CLASSES)
    # v0.34 allocated from incomplete pools: only "All" waited for them
    one_of_two = combined_slices(2)[:1]
    assert allocate(one_of_two, gpu_claim("c"), [], NODE, CLASSES, "1.34", PARTITIONABLE)["devices"]["results"]


def test_a_pool_with_a_newer_generation_elsewhere_is_ignored():
    slices = split_slices(generation=1)
    for slice_ in slices:
        slice_["spec"]["pool"]["resourceSliceCount"] = 3  # a third slice of generation 1 is not here...
    newer = a_slice("other", 1, node="node-b", generation=2, devices=[])
    newer["spec"]["pool"]["name"] = NODE  # ...but the pool's generation 2 is being published
    with pytest.raises(Unschedulable) as refused:
        allocate(slices + [newer], gpu_claim("c"), [], NODE, CLASSES)
    assert refused.value.reason == CANNOT_ALLOCATE


def test_an_invalid_pool_is_reported_when_nothing_else_fits():
    slices = split_slices()
    slices[1]["spec"]["devices"].append(dict(slices[1]["spec"]["devices"][0]))
    with pytest.raises(Unschedulable) as refused:
        allocate(slices, gpu_claim("c"), [], NODE, CLASSES)
    assert refused.value.reason == INVALID_POOLS
    with pytest.raises(AllocatorError, match="pool node-a is invalid: duplicate device name gpu-0"):
        allocate([dict(s, spec={**s["spec"], "devices": s["spec"]["devices"] * 2}) for s in combined_slices()],
                 gpu_claim("c"), [], NODE, CLASSES, "1.34", PARTITIONABLE)


# -- consumable capacity ----------------------------------------------------------------------------

def shared_gpu(policy: dict | None = None, extra: dict | None = None, counters_too: bool = False) -> list[dict]:
    """A whole GPU published for memory-counted sharing (consumable_shares.go, option "memory")."""
    memory = {"value": "81152Mi"}
    if policy is not None:
        memory["requestPolicy"] = policy
    device = {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}, "allowMultipleAllocations": True,
              "capacity": {"memory": memory, **(extra or {})}}
    if counters_too:
        device["consumesCounters"] = h100_devices(0)[0]["consumesCounters"]
        devices = sorted([device] + h100_devices(0)[1:], key=lambda d: d["name"])
        return [split_slices()[0], a_slice(f"{NODE}-{DRIVER}-1", 2, devices=devices)]
    return [a_slice(f"{NODE}-{DRIVER}-0", 1, devices=[device])]


MEMORY_POLICY = {"default": "81152Mi", "validRange": {"min": "1Mi", "max": "81152Mi", "step": "1Mi"}}


def share(name: str, memory: str | None = None, **capacity) -> dict:
    requests = ({"memory": memory} if memory else {}) | capacity
    return gpu_claim(name, **({"capacity": {"requests": requests}} if requests else {}))


def consumed(allocation: dict) -> dict:
    return allocation["devices"]["results"][0]["consumedCapacity"]


def test_consumed_capacity_sums_up_to_the_capacity():
    cluster = Cluster(shared_gpu(MEMORY_POLICY))
    for i in range(7):
        assert consumed(cluster.allocate(share(f"s{i}", "10Gi"))) == {"memory": "10Gi"}
    with pytest.raises(Unschedulable):  # 8 x 10 GiB = 81920 MiB > 81152 MiB
        cluster.allocate(share("s7", "10Gi"))
    assert consumed(cluster.allocate(share("s8", "9472Mi"))) == {"memory": "9472Mi"}  # exactly what is left
    with pytest.raises(Unschedulable):
        cluster.allocate(share("s9", "1Mi"))


def test_a_request_is_rounded_up_to_the_step_and_the_minimum():
    cluster = Cluster(shared_gpu(MEMORY_POLICY))
    assert consumed(cluster.allocate(share("a", "1500Ki"))) == {"memory": "2Mi"}
    assert consumed(cluster.allocate(share("b", "1"))) == {"memory": "1Mi"}  # below min: min
    policy = {"validRange": {"min": "1Gi", "step": "2Gi"}}
    assert consumed(Cluster(shared_gpu(policy)).allocate(share("c", "2Gi"))) == {"memory": "3Gi"}  # 1 + 2k


def test_no_request_consumes_the_default_or_else_everything():
    cluster = Cluster(shared_gpu(MEMORY_POLICY))
    assert consumed(cluster.allocate(share("all"))) == {"memory": "81152Mi"}
    with pytest.raises(Unschedulable):
        cluster.allocate(share("more", "1Mi"))
    unlimited = {"default": "0", "validRange": {"min": "0", "max": "81152Mi", "step": "1Mi"}}
    cluster = Cluster(shared_gpu(unlimited))
    assert [consumed(cluster.allocate(share(f"u{i}"))) for i in range(3)] == [{"memory": "0"}] * 3
    assert consumed(Cluster(shared_gpu()).allocate(share("none"))) == {"memory": "81152Mi"}  # no policy


def test_a_request_above_the_range_or_off_the_values_is_unsuitable():
    with pytest.raises(Unschedulable):
        Cluster(shared_gpu(MEMORY_POLICY)).allocate(share("big", "81153Mi"))
    values = {"validValues": ["10Gi", "20Gi", "40Gi"]}
    cluster = Cluster(shared_gpu(values))
    assert consumed(cluster.allocate(share("a", "15Gi"))) == {"memory": "20Gi"}  # the smallest valid value above
    assert consumed(cluster.allocate(share("b", "10Gi"))) == {"memory": "10Gi"}
    with pytest.raises(Unschedulable):
        cluster.allocate(share("c", "41Gi"))
    with pytest.raises(Unschedulable):  # a capacity the device does not have
        Cluster(shared_gpu(MEMORY_POLICY)).allocate(share("d", "1Gi", cores="1"))


def test_every_capacity_of_the_device_is_consumed_in_its_own_units():
    shares = {"shares": {"value": "4", "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4",
                                                                                        "step": "1"}}}}
    unlimited = {"default": "0", "validRange": {"min": "0", "max": "81152Mi", "step": "1Mi"}}
    cluster = Cluster(shared_gpu(unlimited, shares))
    assert consumed(cluster.allocate(share("a"))) == {"memory": "0", "shares": "1"}
    assert consumed(cluster.allocate(share("b", shares="2"))) == {"memory": "0", "shares": "2"}
    assert consumed(cluster.allocate(share("c"))) == {"memory": "0", "shares": "1"}
    with pytest.raises(Unschedulable):
        cluster.allocate(share("d"))


def test_each_allocation_of_a_shared_device_gets_its_own_share_id():
    cluster = Cluster(shared_gpu(MEMORY_POLICY))
    ids = [cluster.allocate(share(f"s{i}", "1Gi"))["devices"]["results"][0]["shareID"] for i in range(5)]
    assert len(set(ids)) == 5
    assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", i) for i in ids)
    exclusive = allocate(split_slices(), gpu_claim("g"), [], NODE, CLASSES)["devices"]["results"][0]
    assert "shareID" not in exclusive and "consumedCapacity" not in exclusive


def test_a_shared_gpu_holds_its_counters_on_1_36_but_not_on_1_35():
    """v0.35 forgot the counters of a device allocated with a shareID (AllocatedDevices only): the
    scheduler may then hand out a MIG placement on a GPU that is shared; v0.36 counts it (IsDeviceAllocated)."""
    gates = {"DRAPartitionableDevices": True, "DRAConsumableCapacity": True}
    for version, overcommits in (("1.35", True), ("1.36", False)):
        cluster = Cluster(shared_gpu(MEMORY_POLICY, counters_too=True), version, gates)
        assert "shareID" in cluster.allocate(share("s", "1Gi"))["devices"]["results"][0]
        if overcommits:
            assert cluster.devices(mig_claim("m", "1g.10gb")) == ["gpu-0-mig-1g10gb-19-0"]
        else:
            with pytest.raises(Unschedulable):
                cluster.allocate(mig_claim("m", "1g.10gb"))
        # a second share of the GPU skips the counter check: its capacity is already in use
        assert cluster.allocate(share("t", "1Gi"))["devices"]["results"][0]["device"] == "gpu-0"


def test_capacity_requests_need_the_gate():
    with pytest.raises(AllocatorError, match="has capacity requests, but the DRAConsumableCapacity feature is "
                                             "disabled"):
        allocate(shared_gpu(MEMORY_POLICY), share("s", "1Gi"), [], NODE, CLASSES, "1.35")


# -- requests, selectors, results ------------------------------------------------------------------

def test_the_result_carries_config_and_node_selector_as_resource_k8s_io_v1():
    opaque = {"driver": DRIVER, "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig"}}
    classes = {**CLASSES, "mig.nvidia.com": {**CLASSES["mig.nvidia.com"], "spec": {
        **CLASSES["mig.nvidia.com"]["spec"], "config": [{"opaque": opaque}]}}}
    claim = claim_document("ns", "two", [
        {"name": "a", "deviceClassName": "mig.nvidia.com"}, {"name": "b", "deviceClassName": "mig.nvidia.com"}],
        config=[{"requests": ["b"], "opaque": opaque}, {"opaque": opaque}])
    allocation = allocate(split_slices(), claim, [], NODE, classes)
    assert allocation == {
        "devices": {"results": [
            {"request": "a", "driver": DRIVER, "pool": NODE, "device": "gpu-0-mig-1g10gb-19-0"},
            {"request": "b", "driver": DRIVER, "pool": NODE, "device": "gpu-0-mig-1g10gb-19-1"}],
            "config": [{"source": "FromClass", "requests": ["a", "b"], "opaque": opaque},
                       {"source": "FromClaim", "requests": ["b"], "opaque": opaque},
                       {"source": "FromClaim", "opaque": opaque}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}}


def test_a_prioritized_list_takes_the_first_subrequest_that_fits():
    cluster = Cluster(split_slices())
    cluster.allocate(mig_claim("half", "4g.40gb"))
    claim = claim_document("default", "fallback", [{"name": "mig", "firstAvailable": [
        {"name": "big", "deviceClassName": "mig.nvidia.com",
         "selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].profile == '4g.40gb'"}}]},
        {"name": "small", "deviceClassName": "mig.nvidia.com",
         "selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].profile == '3g.40gb'"}}]}]}])
    result = cluster.allocate(claim)["devices"]["results"]
    assert result == [{"request": "mig/small", "driver": DRIVER, "pool": NODE, "device": "gpu-0-mig-3g40gb-9-4"}]


def plain_gpus(count: int = 1) -> list[dict]:
    """Whole GPUs without counters (no dynamic MIG)."""
    return [a_slice(f"{NODE}-{DRIVER}-0", 1, devices=[
        {"name": f"gpu-{m}", "attributes": {"type": {"string": "gpu"}}} for m in range(count)])]


def test_admin_access_ignores_allocations_and_is_not_one():
    cluster = Cluster(plain_gpus())
    cluster.allocate(gpu_claim("owner"))
    watcher = cluster.allocate(gpu_claim("watcher", adminAccess=True))
    assert watcher["devices"]["results"][0] == {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
                                                "adminAccess": True}
    assert allocate(plain_gpus(), gpu_claim("next"), [cluster.allocated[1]], NODE, CLASSES)
    # counters are checked for admin access too (allocateDevice): a GPU whose counters are taken is refused
    cluster = Cluster(split_slices())
    cluster.allocate(gpu_claim("owner"))
    with pytest.raises(Unschedulable):
        cluster.allocate(gpu_claim("watcher", adminAccess=True))


def test_allocation_mode_all_and_counts():
    results = allocate(split_slices(2), gpu_claim("both", allocationMode="All"), [], NODE, CLASSES)
    assert [r["device"] for r in results["devices"]["results"]] == ["gpu-0", "gpu-1"]
    with pytest.raises(Unschedulable):
        allocate(split_slices(2), gpu_claim("three", count=3), [], NODE, CLASSES)
    with pytest.raises(AllocatorError, match="number of requested devices 33 exceeds the claim limit of 32"):
        allocate(split_slices(), mig_claim("many", count=33), [], NODE, CLASSES)


def test_selectors_cel_forms_and_python_predicates():
    big = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('39Gi')) >= 0"
    claim = mig_claim("big", selectors=[{"cel": {"expression": big}}])
    assert allocate(split_slices(), claim, [], NODE, CLASSES)["devices"]["results"][0]["device"] \
        == "gpu-0-mig-3g40gb-9-0"
    by_python = mig_claim("py", selectors=[lambda device: device.attributes[DRIVER]["profile"] == "2g.20gb"])
    assert allocate(split_slices(), by_python, [], NODE, CLASSES)["devices"]["results"][0]["device"] \
        == "gpu-0-mig-2g20gb-14-0"
    quoted = mig_claim("q", selectors=[{"cel": {"expression": 'device.attributes["gpu.nvidia.com"]["profile"] '
                                                              '!= "1g.10gb" && !(device.driver == "x")'}}])
    assert allocate(split_slices(), quoted, [], NODE, CLASSES)["devices"]["results"][0]["device"] \
        == "gpu-0-mig-1g20gb-15-0"


def test_a_missing_attribute_is_a_cel_runtime_error_of_the_allocation():
    claim = mig_claim("x", selectors=[{"cel": {"expression": "device.attributes['gpu.nvidia.com'].model == 'a'"}}])
    with pytest.raises(AllocatorError, match=r"claim default/x: selector #0: CEL runtime error: no such key: model"):
        allocate(split_slices(), claim, [], NODE, CLASSES)
    # another domain is an empty map: the same error, not a silent false
    other = mig_claim("y", selectors=[{"cel": {"expression": "device.attributes['example.com'].type == 'mig'"}}])
    with pytest.raises(AllocatorError, match="no such key: type"):
        allocate(split_slices(), other, [], NODE, CLASSES)


@pytest.mark.parametrize("expression", [
    "has(device.attributes['gpu.nvidia.com'].profile)",
    "device.attributes['gpu.nvidia.com'].profile.startsWith('1g')",
    "'1g' in device.attributes['gpu.nvidia.com']",
    "device.attributes['gpu.nvidia.com'].profile == '1g\\'x'",
    "device.capacity['gpu.nvidia.com'].memory.compareTo(semver('1.0.0')) >= 0",
    "device.attributes['gpu.nvidia.com'].count + 1 == 2",
])
def test_cel_beyond_the_modelled_forms_is_refused(expression):
    with pytest.raises(NotModelled):
        allocate(split_slices(), mig_claim("x", selectors=[{"cel": {"expression": expression}}]), [], NODE, CLASSES)


def test_bad_claims_are_errors_as_the_real_allocator_gives_them():
    with pytest.raises(AllocatorError, match=r"claim default/c, request gpu: could not retrieve device class "
                                             r"nope: deviceclass.resource.k8s.io \"nope\" not found"):
        allocate(split_slices(), claim_document("default", "c", [{"name": "gpu", "deviceClassName": "nope"}]),
                 [], NODE, CLASSES)
    with pytest.raises(AllocatorError, match="missing device class name"):
        allocate(split_slices(), claim_document("default", "c", [{"name": "gpu"}]), [], NODE, CLASSES)
    with pytest.raises(AllocatorError, match="selector #0: CEL expression empty"):
        allocate(split_slices(), mig_claim("c", selectors=[{}]), [], NODE, CLASSES)
    with pytest.raises(NotModelled):
        allocate(split_slices(), {**mig_claim("c"), "spec": {"devices": {**mig_claim("c")["spec"]["devices"],
                 "constraints": [{"matchAttribute": "gpu.nvidia.com/parentUUID"}]}}}, [], NODE, CLASSES)
    with pytest.raises(ValueError):
        allocate(split_slices(), allocated_claim(gpu_claim("c"), {"devices": {"results": []}}), [], NODE, CLASSES)


def test_taints_block_unless_tolerated():
    slices = split_slices()
    device = next(d for d in slices[1]["spec"]["devices"] if d["name"] == "gpu-0")
    device["taints"] = [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]
    with pytest.raises(Unschedulable):
        allocate(slices, gpu_claim("c"), [], NODE, CLASSES)
    tolerated = gpu_claim("t", tolerations=[{"key": "gpu.nvidia.com/xid", "operator": "Exists"}])
    result = allocate(slices, tolerated, [], NODE, CLASSES)["devices"]["results"][0]
    assert result["tolerations"] == [{"key": "gpu.nvidia.com/xid", "operator": "Exists"}]
    device["taints"][0]["effect"] = "None"  # 1.35+: only NoSchedule and NoExecute prevent allocation
    assert allocate(slices, gpu_claim("c"), [], NODE, CLASSES)


def test_a_slice_for_another_node_is_not_used_and_all_nodes_needs_no_selector():
    everywhere = plain_gpus()
    everywhere[0]["spec"].pop("nodeName")
    everywhere[0]["spec"]["allNodes"] = True
    assert "nodeSelector" not in allocate(everywhere, gpu_claim("c"), [], NODE, CLASSES)
    with pytest.raises(Unschedulable):
        allocate(split_slices(node="node-b"), gpu_claim("c"), [], NODE, CLASSES)


def test_a_server_with_the_gate_off_drops_counters_and_partitions_then_overlap():
    """What a 1.35 API server stores when the driver publishes counters with DRAPartitionableDevices off:
    the fields are dropped (kube_api_stand_in drop_disabled_fields), so nothing ties a placement to its
    GPU and the scheduler hands out overlapping ones: gpud must publish no partitions to such a server."""
    slices = [s for s in split_slices() if s["spec"].get("devices")]
    for slice_ in slices:
        drop_disabled_fields(slice_, None, {"DRADeviceTaints": False, "DRAPartitionableDevices": False,
                                            "DRADeviceBindingConditions": False, "DRAConsumableCapacity": False,
                                            "DRAListTypeAttributes": False, "DRANodeAllocatableResources": False})
        slice_["spec"]["pool"]["resourceSliceCount"] = 1
        slice_["spec"]["nodeName"] = NODE
    cluster = Cluster(slices, "1.35")
    assert cluster.devices(gpu_claim("whole")) == ["gpu-0"]
    assert cluster.devices(mig_claim("overlap", "7g.80gb")) == ["gpu-0-mig-7g80gb-0-0"]


@pytest.mark.parametrize(("text", "canonical"), [("1024Mi", "1Gi"), ("1000", "1k"), ("1500", "1500"), ("0.5", "500m"),
                                                  ("1e3", "1e3"), ("1.5Gi", "1536Mi"), ("0", "0"), ("12Ki", "12Ki")])
def test_quantities_are_written_in_canonical_form(text, canonical):
    assert str(Quantity.parse(text)) == canonical


def test_claims_of_one_pod_are_allocated_together():
    claims = [mig_claim("a", "4g.40gb"), mig_claim("b", "3g.40gb")]
    allocations = allocate_claims(split_slices(), claims, [], NODE, CLASSES)
    assert [a["devices"]["results"][0]["device"] for a in allocations] == ["gpu-0-mig-4g40gb-5-0",
                                                                          "gpu-0-mig-3g40gb-9-4"]
    with pytest.raises(Unschedulable):
        allocate_claims(split_slices(), claims + [mig_claim("c", "1g.10gb")], [], NODE, CLASSES)


def test_an_allocation_is_stored_on_the_api_server_stand_in_as_the_scheduler_writes_it():
    api = KubeApiStandIn(server_version="1.36")
    claim = api.create_resource_claim("default", "mig", [{"name": "mig", "deviceClassName": "mig.nvidia.com"}], None)
    allocation = allocate(split_slices(), claim, [], NODE, CLASSES)
    store(api, claim, allocation, NODE)
    assert api.resource_claim("default", "mig")["status"]["allocation"] == allocation
