"""The devices the DRA plugin publishes: a pure function of gpud's answers (GET /v1/node, /v1/gpus).

Compatible with NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu @22407113, cmd/gpu-kubelet-plugin),
so DeviceClasses, claims and CEL selectors written for it select gpud's devices unchanged:
- a whole GPU (not in MIG mode) is `gpu-<minor>` (deviceinfo.go GpuInfo.CanonicalName), a MIG device
  `gpu-<parent minor>-mig-<profile without dots, RFC 1123>-<GI profile id>-<placement start>`
  (mig.go MigSpecTuple.ToCanonicalName, toRFC1123Compliant);
- the same attribute names, types and value formats (deviceinfo.go GpuInfo.Attributes, mig.go
  CommonAttributesMig): versions as semver with leading zeros dropped (semver.MustParse(...).String():
  driver 550.163.01 is published as 550.163.1), architecture and brand as go-nvlib's
  GetArchitectureAsString / GetBrandAsString words, the PCI bus id in the 4-digit-domain lower-case form
  (k8s.io/dynamic-resource-allocation deviceattribute/pci_linux.go verifyPCIBDFFormat);
- capacity `memory` in bytes for a GPU; a MIG device's profile capacities and `memorySlice<N>` for each
  memory slice of its placement (mig.go CommonCapacitiesMig, MigDeviceInfo.GetDevice).
Added where NVIDIA's has none (users asked: its issues #744, #1165): `index`, `minor`, `numaNode`,
`resource.kubernetes.io/pcieRoot` (sysfs, as deviceattribute.GetPCIeRootAttributeByPCIBusID resolves it),
and `nvlinkPeers` (the indexes of the GPUs it reaches over NVLink, comma-separated: a list attribute needs
the alpha DRAListTypeAttributes gate).

A GPU gpud lists in GET /v1/mig/dynamic is published as partitionable devices (KEP-4815), as NVIDIA's
driver does under its DynamicMIG gate (partitions.go; nvlib.go inspectMigProfilesAndPlacements): one
counter set `gpu-<minor>-counter-set` whose counters are each capacity's maximum over the GPU's profiles
(nvlib.go setMax into maxCapacities; names camelToDNSName of the capacities': `copy-engines`, ...) and
`memory-slice-<N>` = 1 per memory slice; one device per (profile, placement), named and described as the
static MIG device it becomes (no `uuid`: it has none until Prepare makes it), consuming its profile's
counters and its placement's memory slices; and the whole GPU, with NVIDIA's PartCapacities (the same
maxima), consuming every counter, only where the GPU can be handed out whole: MIG mode off, or a GPU that
leaves MIG mode without a reset (NVIDIA's driver skips it on Ampere with MIG on). The instances gpud made
for claims are not devices of their own: the partition device stands for its instance, and the scheduler
counts its allocation against the counters.

A GPU gpud lists in GET /v1/claims' `shares` is published whole with `allowMultipleAllocations` and
consumable capacities (KEP-5075; NVIDIA's consumable_shares.go applyConsumableShares for the form):
`memory` (bytes: what gpud offers for shares less what its `gpu_memory` resource promised) and `compute`
(the percentage of the GPU's SMs a claim's MPS clients may use, 100 in all), each with a request policy
the API server accepts (pkg/apis/resource/validation validateRequestPolicyRange: min <= default <= max
<= value, min + step <= value, default and max whole steps from min).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpud.base.quantity import whole_quantity

GPU_TYPE, MIG_TYPE = "gpu", "mig"
# what a device is to Prepare: a whole GPU, a MIG device that exists, a MIG placement made on demand
# (partitionable), a GPU shared by claims with counted memory and compute
WHOLE_GPU, STATIC_MIG, PARTITION, SHARE = "whole-gpu", "static-mig", "partition", "share"
# the DRA capacity of a shared GPU that is a percentage of its SMs (MPS's active thread percentage)
COMPUTE_CAPACITY = "compute"
COMPUTE_PERCENT = 100
# a MIG profile's capacities (mig.go CommonCapacitiesMig) by the key of gpud's answers, and the counter
# each becomes (partitions.go capacitiesToCounters: camelToDNSName of the capacity's name)
PROFILE_CAPACITIES = (("multiprocessors", "multiprocessors", "multiprocessors"),
                      ("copyEngines", "copy_engines", "copy-engines"), ("decoders", "decoders", "decoders"),
                      ("encoders", "encoders", "encoders"), ("jpegEngines", "jpeg_engines", "jpeg-engines"),
                      ("ofaEngines", "ofa_engines", "ofa-engines"))
MEMORY = "memory"
PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"
# go-nvlib pkg/nvlib/device/device.go GetArchitectureAsString, by gpud's architecture names
ARCHITECTURES = {"kepler": "Kepler", "maxwell": "Maxwell", "pascal": "Pascal", "volta": "Volta",
                 "turing": "Turing", "ampere": "Ampere", "ada": "Ada Lovelace", "hopper": "Hopper",
                 "blackwell": "Blackwell"}
_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]")
_NOT_RFC1123 = re.compile(r"[^a-z0-9-.]")


@dataclass(frozen=True)
class CounterSet:
    """A dynamic GPU's shared counters (resource.k8s.io/v1 CounterSet): counter name -> Quantity."""

    name: str
    counters: dict[str, str]

    def entry(self) -> dict:
        """The set as a ResourceSlice's spec.sharedCounters[] holds it."""
        return {"name": self.name, "counters": {k: {"value": v} for k, v in self.counters.items()}}


@dataclass(frozen=True)
class Partition:
    """Where Prepare makes a partition device's GPU instance: its profile and placement (in memory slices)."""

    profile: str
    gi_profile_id: int
    start: int
    size: int


@dataclass(frozen=True)
class DraDevice:
    """One device of the pool: what the slice says of it, and what Prepare needs to hand it out."""

    name: str
    type: str  # "gpu" | "mig"
    uuid: str  # the GPU's or the MIG device's own UUID; "" for a partition (none until it is made)
    gpu_uuid: str  # the GPU it is on (a MIG device's parent)
    gpu_index: int
    minor: int
    attributes: dict[str, dict[str, Any]] = field(default_factory=dict)
    capacity: dict[str, dict[str, Any]] = field(default_factory=dict)
    kind: str = WHOLE_GPU
    partition: Partition | None = None
    counter_set: CounterSet | None = None  # the set it consumes from (a dynamic GPU's)
    consumes: dict[str, str] = field(default_factory=dict)  # what it consumes of counter_set
    allow_multiple_allocations: bool = False  # a share: several claims at once, each consuming capacity

    @property
    def health_uuid(self) -> str:
        """The UUID whose health the device has: its own, or its GPU's while it has none."""
        return self.uuid or self.gpu_uuid

    def slice_entry(self, taints: list[dict] | None = None, counters: bool = True) -> dict:
        """The device as a ResourceSlice's spec.devices[] holds it (`counters`: with what it consumes)."""
        entry: dict[str, Any] = {"name": self.name, "attributes": self.attributes, "capacity": self.capacity}
        if self.allow_multiple_allocations:
            entry["allowMultipleAllocations"] = True
        if counters and self.counter_set is not None:
            entry["consumesCounters"] = [{"counterSet": self.counter_set.name,
                                          "counters": {k: {"value": v} for k, v in self.consumes.items()}}]
        if taints:
            entry["taints"] = taints
        return entry


def counter_sets(devices: list[DraDevice]) -> list[CounterSet]:
    """The counter sets the devices consume from, each once, in the devices' order."""
    found: dict[str, CounterSet] = {}
    for device in devices:
        if device.counter_set is not None:
            found.setdefault(device.counter_set.name, device.counter_set)
    return list(found.values())


def semver(version: str) -> str:
    """A dotted version as NVIDIA's driver publishes it: semver.MustParse pads to three parts and drops
    leading zeros ("550.163.01" -> "550.163.1", "12.4" -> "12.4.0", "9.0" -> "9.0.0")."""
    parts = [str(int(p)) for p in version.split(".")[:3]]
    return ".".join(parts + ["0"] * (3 - len(parts)))


def pci_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:CA:00.0" as the standard attribute writes it: "0000:ca:00.0"."""
    domain, _, rest = nvml_bus_id.lower().partition(":")
    return f"{domain[-4:].rjust(4, '0')}:{rest}"


def binary_quantity(value: int) -> str:
    """A byte count as resource.NewQuantity(value, BinarySI).String() writes it: the largest binary suffix
    that divides it ("80Gi", "19968Mi"), else the plain number."""
    for suffix, power in (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if value and value % (1 << power) == 0:
            return f"{value >> power}{suffix}"
    return str(value)


def gpu_device_name(minor: int) -> str:
    """A whole GPU's device name (deviceinfo.go GpuInfo.CanonicalName)."""
    return f"gpu-{minor}"


def mig_device_name(parent_minor: int, profile: str, gi_profile_id: int, placement_start: int) -> str:
    """mig.go ToCanonicalName: dots dropped from the profile, then toRFC1123Compliant (lower case, other
    characters '-', trimmed): "1g.10gb+me" -> "1g10gb-me"."""
    name = _NOT_RFC1123.sub("-", profile.replace(".", "").lower()).strip("-").removesuffix(".")
    return f"{gpu_device_name(parent_minor)}-mig-{name}-{gi_profile_id}-{placement_start}"


def pcie_root(sysfs: Path, bus_id: str) -> str | None:
    """The root complex of a PCI device ("pci0000:00"): the first directory under /sys/devices of the
    device its /sys/bus/pci/devices/<bus id> link leads to; None where that cannot be read."""
    if not _BDF.fullmatch(bus_id):
        return None
    try:
        target = os.readlink(sysfs / "bus" / "pci" / "devices" / bus_id)
    except OSError:
        return None
    resolved = os.path.normpath(os.path.join("bus/pci/devices", target))
    parts = resolved.split(os.sep)
    if len(parts) < 3 or parts[0] != "devices" or not parts[1].startswith("pci") or parts[-1] != bus_id:
        return None
    return parts[1]


def _string(value: str) -> dict:
    return {"string": value}


def _common_attributes(gpu: dict, node: dict, sysfs: Path | None) -> dict[str, dict]:
    """What a GPU and its MIG devices both carry (mig.go CommonAttributesMig takes the parent's)."""
    attributes = {
        "productName": _string(gpu["name"]),
        "architecture": _string(ARCHITECTURES.get(gpu["architecture"], "Unknown")),
        "cudaComputeCapability": {"version": semver(gpu["cuda_compute_capability"])},
        "driverVersion": {"version": semver(node["driver_version"])},
        "cudaDriverVersion": {"version": semver(node["cuda_version"])},
        PCI_BUS_ID_ATTRIBUTE: _string(pci_bus_id(gpu["pci_bus_id"])),
    }
    if gpu.get("brand"):
        attributes["brand"] = _string(gpu["brand"])
    root = pcie_root(sysfs, pci_bus_id(gpu["pci_bus_id"])) if sysfs is not None else None
    if root is not None:
        attributes[PCIE_ROOT_ATTRIBUTE] = _string(root)
    # gpud's own (NVIDIA's driver has none): which GPU it is to nvidia-smi, its /dev/nvidia<minor>, its
    # NUMA node and its NVLink peers
    attributes["index"] = {"int": int(gpu["index"])}
    attributes["minor"] = {"int": int(gpu["minor_number"])}
    if gpu.get("numa_node") is not None:
        attributes["numaNode"] = {"int": int(gpu["numa_node"])}
    if gpu.get("nvlink_peers"):
        attributes["nvlinkPeers"] = _string(",".join(str(p) for p in sorted(gpu["nvlink_peers"])))
    return attributes


def _gpu_attributes(gpu: dict, node: dict, sysfs: Path | None) -> dict[str, dict]:
    return {"type": _string(GPU_TYPE), "uuid": _string(gpu["uuid"]), **_common_attributes(gpu, node, sysfs)}


def _mig_attributes(gpu: dict, profile: str, node: dict, sysfs: Path | None) -> dict[str, dict]:
    return {"type": _string(MIG_TYPE), "parentUUID": _string(gpu["uuid"]), "profile": _string(profile),
            **_common_attributes(gpu, node, sysfs)}


def _quantities(values: dict[str, int]) -> dict[str, dict]:
    """resource.NewQuantity(value, BinarySI) of each (mig.go intcap): "16", "9984Mi"."""
    return {name: {"value": binary_quantity(value)} for name, value in values.items()}


def _memory_slices(start: int, size: int) -> dict[str, int]:
    """A placement's memory slices as a static MIG device's capacities (deviceinfo.go MigDeviceInfo.GetDevice)."""
    return {f"memorySlice{i}": 1 for i in range(start, start + size)}


def _slice_counters(start: int, size: int) -> dict[str, str]:
    """A placement's memory slices as counters (partitions.go addCountersForMemSlices, memsliceCounterName)."""
    return {f"memory-slice-{i}": "1" for i in range(start, start + size)}


def _counters(capacities: dict[str, int]) -> dict[str, str]:
    """A profile's capacities as counters of the same value (partitions.go capacitiesToCounters)."""
    names = {capacity: counter for capacity, _, counter in PROFILE_CAPACITIES} | {MEMORY: MEMORY}
    return {names[name]: binary_quantity(value) for name, value in capacities.items()}


def _whole_gpu(gpu: dict, node: dict, sysfs: Path | None) -> DraDevice:
    return DraDevice(gpu_device_name(gpu["minor_number"]), GPU_TYPE, gpu["uuid"], gpu["uuid"], int(gpu["index"]),
                     int(gpu["minor_number"]), _gpu_attributes(gpu, node, sysfs),
                     _quantities({MEMORY: int(gpu["memory_total_mib"]) << 20}))


def _mig(gpu: dict, mig: dict, node: dict, sysfs: Path | None) -> DraDevice:
    attributes = {**_mig_attributes(gpu, mig["profile"], node, sysfs), "uuid": _string(mig["uuid"])}
    engines = mig.get("engines") or {}
    start, size = int(mig["placement"]["start"]), int(mig["placement"]["size"])
    capacity = {"multiprocessors": int(mig["sm_count"]), "copyEngines": engines.get("copy", 0),
                "decoders": engines.get("decoder", 0), "encoders": engines.get("encoder", 0),
                "jpegEngines": engines.get("jpeg", 0), "ofaEngines": engines.get("ofa", 0),
                MEMORY: int(mig["memory_total_mib"]) << 20, **_memory_slices(start, size)}
    name = mig_device_name(int(gpu["minor_number"]), mig["profile"], int(mig["gi_profile_id"]), start)
    return DraDevice(name, MIG_TYPE, mig["uuid"], gpu["uuid"], int(gpu["index"]), int(gpu["minor_number"]),
                     attributes, _quantities({k: int(v) for k, v in capacity.items()}), kind=STATIC_MIG)


def _profile_capacities(profile: dict) -> dict[str, int]:
    """A MIG profile of GET /v1/mig/dynamic as mig.go CommonCapacitiesMig counts it (memory in bytes)."""
    capacities = {capacity: int(profile[key]) for capacity, key, _ in PROFILE_CAPACITIES}
    capacities[MEMORY] = int(profile["memory_mib"]) << 20
    if any(v < 0 for v in capacities.values()):
        raise ValueError(f"profile {profile.get('name')!r} has a negative count")
    return capacities


def _dynamic_gpu(gpu: dict, dynamic: dict, node: dict, sysfs: Path | None) -> list[DraDevice]:
    """A dynamic MIG GPU's partitionable devices (partitions.go PartGetDevice, PartSharedCounterSets); a
    ValueError, KeyError or TypeError where gpud's answer does not describe a GPU that can be published."""
    minor, index, uuid = int(gpu["minor_number"]), int(gpu["index"]), gpu["uuid"]
    memory_slices = int(dynamic["memory_slices"])
    profiles = [(p, _profile_capacities(p)) for p in dynamic["profiles"]]
    maxima = {name: max(c[name] for _, c in profiles) for name in profiles[0][1]}
    counter_set = CounterSet(f"{gpu_device_name(minor)}-counter-set",
                             {**_counters(maxima), **_slice_counters(0, memory_slices)})
    devices = []
    if dynamic["mig_mode"] == "disabled" or dynamic.get("mode_toggle_without_reset") is True:
        devices.append(DraDevice(gpu_device_name(minor), GPU_TYPE, uuid, uuid, index, minor, _gpu_attributes(gpu, node, sysfs),
                                 _quantities(maxima), counter_set=counter_set, consumes=counter_set.counters))
    for profile, capacities in profiles:
        gi_profile_id = int(profile["gi_profile_id"])
        for placement in profile["placements"]:
            start, size = int(placement["start"]), int(placement["size"])
            if start < 0 or size < 1 or start + size > memory_slices:
                raise ValueError(f"placement {start}+{size} of {profile['name']} is outside its "
                                 f"{memory_slices} memory slices")
            devices.append(DraDevice(
                mig_device_name(minor, profile["name"], gi_profile_id, start), MIG_TYPE, "", uuid, index, minor,
                _mig_attributes(gpu, profile["name"], node, sysfs),
                _quantities({**capacities, **_memory_slices(start, size)}), kind=PARTITION,
                partition=Partition(profile["name"], gi_profile_id, start, size), counter_set=counter_set,
                consumes={**_counters(capacities), **_slice_counters(start, size)}))
    return devices


def request_policy(capacity: int, minimum: int, step: int, default: int | None,
                   quantity=str) -> tuple[int, dict]:
    """The largest value of a consumable capacity and its request policy, as the API server accepts them
    (validation.go validateRequestPolicyRange): max the last whole step from min within the capacity,
    the default (max when none) moved onto the steps and into [min, max]. ValueError where not even one
    step above min fits (the server refuses min + step over the value)."""
    if minimum < 0 or step < 1:
        raise ValueError(f"min {minimum} and step {step}: min must not be negative, step must be positive")
    if minimum + step > capacity:
        raise ValueError(f"min {quantity(minimum)} plus one step {quantity(step)} is more than the "
                         f"{quantity(capacity)} there is")
    maximum = minimum + (capacity - minimum) // step * step
    default = maximum if default is None else min(max(default, minimum), maximum)
    default = minimum + (default - minimum) // step * step
    return maximum, {"default": quantity(default), "validRange": {
        "min": quantity(minimum), "max": quantity(maximum), "step": quantity(step)}}


def _shared_gpu(gpu: dict, share: dict, policy: dict, node: dict, sysfs: Path | None) -> DraDevice:
    """A GPU several claims share, each with its memory and compute counted (consumable_shares.go
    applyConsumableShares; compute in percent where NVIDIA's has `shares`)."""
    memory, compute = policy.get("memory") or {}, policy.get("compute") or {}
    offered = (int(share["offered_mib"]) - int(share.get("gpu_memory_mib") or 0)) << 20
    def given(policy: dict, key: str, otherwise: Any) -> Any:
        return otherwise if policy.get(key) is None else whole_quantity(policy[key])

    memory_max, memory_policy = request_policy(offered, given(memory, "min", 1 << 20), given(memory, "step", 1 << 20),
                                               given(memory, "default", None), binary_quantity)
    compute_max, compute_policy = request_policy(COMPUTE_PERCENT, given(compute, "min", 1), given(compute, "step", 1),
                                                 given(compute, "default", None))
    capacity = {MEMORY: {"value": binary_quantity(memory_max), "requestPolicy": memory_policy},
                COMPUTE_CAPACITY: {"value": str(compute_max), "requestPolicy": compute_policy}}
    return DraDevice(gpu_device_name(gpu["minor_number"]), GPU_TYPE, gpu["uuid"], gpu["uuid"], int(gpu["index"]),
                     int(gpu["minor_number"]), _gpu_attributes(gpu, node, sysfs), capacity, kind=SHARE,
                     allow_multiple_allocations=True)


def node_devices(gpus: dict, node: dict, sysfs: Path | None = None, dynamic: dict | None = None,
                 shares: dict | None = None) -> tuple[list[DraDevice], list[dict]]:
    """The pool's devices from gpud's answers, and those left out with why: a lost GPU (nothing to hand
    out; its slot stays unpublished until it comes back), a GPU without a minor number (no device node to
    name), a GPU in MIG mode without MIG devices, a dynamic GPU gpud reports a problem with or no
    profiles for, a share that cannot be offered. `gpus`, `node`: GET /v1/gpus, /v1/node; `dynamic`: GET
    /v1/mig/dynamic (None: a gpud without it); `shares`: GET /v1/claims' `shares` (None: none). A GPU
    both dynamic and shared is published as dynamic. `sysfs`: where to resolve PCIe roots (None: not at
    all, as on a simulated node, whose bus ids are no devices of this host)."""
    dynamic_by_uuid = {g.get("uuid"): g for g in (dynamic or {}).get("gpus") or [] if isinstance(g, dict)}
    shares_by_uuid = {g.get("uuid"): g for g in (shares or {}).get("gpus") or [] if isinstance(g, dict)}
    policy = (shares or {}).get("policy") or {}
    devices, left_out = [], []
    for gpu in sorted(gpus["gpus"], key=lambda g: g["index"]):
        where = f"GPU {gpu['index']} ({gpu['uuid']})"
        if gpu.get("lost"):
            left_out.append({"device": where, "reason": "the GPU is lost"})
            continue
        if gpu.get("minor_number") is None:
            left_out.append({"device": where, "reason": "NVML gives no minor number (no /dev/nvidia<minor>)"})
            continue
        share, mig = shares_by_uuid.get(gpu["uuid"]), gpu.get("mig") or {}
        if gpu["uuid"] in dynamic_by_uuid:
            if share is not None:
                left_out.append({"device": f"{where} as a share", "reason": "the GPU is also for dynamic MIG, "
                                 "which wins: it is published as partitionable devices"})
            devices += _dynamic_or_left_out(gpu, dynamic_by_uuid[gpu["uuid"]], node, sysfs, where, left_out)
        elif mig.get("mode") == "enabled":
            if share is not None:
                left_out.append({"device": f"{where} as a share",
                                 "reason": "MIG mode is on: a share is of a whole GPU"})
            if not mig.get("devices"):
                left_out.append({"device": where, "reason": "MIG mode is on and the GPU has no MIG devices"})
            devices += [_mig(gpu, m, node, sysfs) for m in mig.get("devices") or []]
        elif share is not None:
            try:
                devices.append(_shared_gpu(gpu, share, policy, node, sysfs))
            except (KeyError, TypeError, ValueError) as exc:
                left_out.append({"device": f"{where} as a share", "reason": f"cannot be offered for shares: {exc}"})
        else:
            devices.append(_whole_gpu(gpu, node, sysfs))
    return devices, left_out


def _dynamic_or_left_out(gpu: dict, dynamic: dict, node: dict, sysfs: Path | None, where: str,
                         left_out: list[dict]) -> list[DraDevice]:
    if dynamic.get("problem"):
        left_out.append({"device": where, "reason": f"dynamic MIG: {dynamic['problem']}"})
        return []
    if not dynamic.get("profiles"):
        left_out.append({"device": where, "reason": "dynamic MIG: gpud knows no MIG profiles of the GPU"})
        return []
    try:
        return _dynamic_gpu(gpu, dynamic, node, sysfs)
    except (KeyError, TypeError, ValueError) as exc:
        left_out.append({"device": where, "reason": f"dynamic MIG: gpud's description is unusable: {exc!r}"})
        return []
