"""Allocate and GetPreferredAllocation, from the plugin's NodeState (no I/O: the answers come from the
state gpud last reported, so they are quick and hold while gpud restarts)."""

from __future__ import annotations

import enum
import itertools
import math
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpud.device_plugin.state import MpsClient, NodeState, PluginDevice, Resource


class AllocationRefused(Exception):
    """An Allocate the plugin refuses; `invalid` says whether the request itself is wrong (IDs unknown, or
    IDs that cannot go together: INVALID_ARGUMENT), else its devices are unusable now (FAILED_PRECONDITION)."""

    def __init__(self, message: str, invalid: bool = False):
        super().__init__(message)
        self.invalid = invalid


class DeviceListStrategy(str, enum.Enum):
    """How Allocate names the devices to the container runtime: NVIDIA's plugin's --device-list-strategy
    values (k8s-device-plugin api/config/v1/flags.go, internal/plugin/server.go getAllocateResponse)."""

    ENVVAR = "envvar"  # NVIDIA_VISIBLE_DEVICES, read by NVIDIA's container runtime (hook)
    CDI_ANNOTATIONS = "cdi-annotations"  # cdi.k8s.io/ annotations: any kubelet, a CDI-enabled runtime
    CDI_CRI = "cdi-cri"  # the CDIDevices field: kubelet 1.29+ (DevicePluginCDIDevices), a CDI-enabled runtime


# Works with every kubelet: device plugin annotations reach the runtime since Kubernetes 1.10
# (kubernetes/kubernetes#58172), where CDIDevices needs 1.29; containerd 1.7+ and CRI-O read them.
DEFAULT_STRATEGIES = (DeviceListStrategy.CDI_ANNOTATIONS,)
# CDI's annotation key is cdi.k8s.io/<plugin>_<id> (container-device-interface pkg/cdi/annotations.go
# AnnotationKey); a fresh id per response, as NVIDIA's plugin does, so two resources never collide.
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
CDI_ANNOTATION_PLUGIN = "gpud-device-plugin"
# gpud's MPS daemons run in the host's IPC namespace (client-env's host_ipc): their clients share memory
# with them through /dev/shm. Allocate cannot set hostIPC, so it mounts the host's /dev/shm as NVIDIA's
# plugin mounts its MPS daemons' shm directory (k8s-device-plugin internal/plugin/mps.go updateReponse).
HOST_SHM = "/dev/shm"
# gpu-memory: MPS caps each client's device memory with this variable, `<device ordinal>=<limit>`; the
# container sees its one device as ordinal 0 (the same format as gpud/mps/manager.py client_env).
PINNED_MEMORY_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ACTIVE_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


@dataclass
class ContainerAllocation:
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (host path, container path, read only)
    cdi_devices: list[str] = field(default_factory=list)  # fully qualified: <vendor>/<class>=<name>
    annotations: dict[str, str] = field(default_factory=dict)


def allocate(state: NodeState, resource: Resource, ids: list[str],
             strategies: tuple[DeviceListStrategy, ...] = DEFAULT_STRATEGIES) -> ContainerAllocation:
    """What the container gets for `ids`: each named by the GPU or MIG device it stands for (a MIG
    device's own UUID, never its GPU's), two replicas of one device giving that device once, as NVIDIA's
    plugin does (internal/plugin/server.go deviceIDsFromAnnotatedDeviceIDs)."""
    _refuse_claimed(state, resource, ids)
    devices = _known_healthy(resource, ids)
    if resource.strategy == "gpu-memory":
        return _gpu_memory(state, resource, devices, strategies)
    if resource.fail_requests_greater_than_one and len(ids) > 1:
        # the NVIDIA plugin's words for the same refusal (k8s-device-plugin internal/rm/rm.go ValidateRequest)
        raise AllocationRefused(f"{resource.name}: maximum request size for shared resources is 1, got {len(ids)}")
    targets = list(dict.fromkeys(d.device for d in devices))
    allocation = _named(state, resource, devices, targets, strategies)
    if resource.served_by_mps:
        _add_mps_client(allocation, _mps_client(state, resource, targets))
    return allocation


def _gpu_memory(state: NodeState, resource: Resource, devices: list[PluginDevice],
                strategies: tuple[DeviceListStrategy, ...]) -> ContainerAllocation:
    """k units of one GPU or MIG device: that device, as a client of its MPS daemon with k units of its
    memory pinned (and, with proportional_threads, k/units of its SMs). Units of two devices are refused:
    MPS caps a client's memory per device, so such a pod would get neither device's share as asked."""
    targets = list(dict.fromkeys(d.device for d in devices))
    if len(targets) > 1:
        raise AllocationRefused(f"{resource.name}: the units are on {len(targets)} devices ({', '.join(targets)}); "
                                "a container's units must all be on one device", invalid=True)
    (target,) = targets
    allocation = _named(state, resource, devices, targets, strategies)
    _add_mps_client(allocation, _mps_client(state, resource, targets))
    units = len({d.id for d in devices})
    # CUDA_VISIBLE_DEVICES takes UUIDs as `nvidia-smi -L` prints them (CUDA Programming Guide, CUDA
    # environment variables): GPU-<uuid>, and a MIG device's MIG-<uuid> (the form drivers since R470 print
    # and NVML reports). A UUID, unlike an index, stays right however the runtime numbers the container's
    # devices, and MPS's guide recommends UUIDs for its clients for the same reason.
    allocation.envs["CUDA_VISIBLE_DEVICES"] = target
    allocation.envs[PINNED_MEMORY_LIMIT] = f"0={units * resource.unit_mib}M"
    if resource.proportional_threads:
        allocation.envs[ACTIVE_THREAD_PERCENTAGE] = str(max(1, math.ceil(units * 100 / devices[0].units)))
    return allocation


def _named(state: NodeState, resource: Resource, devices: list[PluginDevice], targets: list[str],
           strategies: tuple[DeviceListStrategy, ...]) -> ContainerAllocation:
    """The devices named to the container runtime as the device list strategies say."""
    allocation = ContainerAllocation()
    if DeviceListStrategy.ENVVAR in strategies:
        allocation.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(targets)
    if DeviceListStrategy.CDI_ANNOTATIONS in strategies or DeviceListStrategy.CDI_CRI in strategies:
        names = _cdi_names(state, resource, devices)
        if DeviceListStrategy.CDI_CRI in strategies:
            allocation.cdi_devices = names
        if DeviceListStrategy.CDI_ANNOTATIONS in strategies:
            key = f"{CDI_ANNOTATION_PREFIX}{CDI_ANNOTATION_PLUGIN}_{uuid.uuid4()}"
            allocation.annotations[key] = ",".join(names)
    return allocation


def _add_mps_client(allocation: ContainerAllocation, client: MpsClient) -> None:
    allocation.envs.update(client.env)
    allocation.mounts.extend(client.mounts)
    if client.host_ipc:
        allocation.mounts.append((HOST_SHM, HOST_SHM, False))


def _refuse_claimed(state: NodeState, resource: Resource, ids: list[str]) -> None:
    """One owner for both paths: a device a DRA claim holds (gpud's /v1/claims) is not handed out here too."""
    for device_id in ids:
        device = resource.device(device_id)
        holder = device is not None and state.holder(resource, device)
        if holder:
            raise AllocationRefused(f"{resource.name}: device {device_id} is held by {holder} (Kubernetes DRA)")


def _known_healthy(resource: Resource, ids: list[str]) -> list[PluginDevice]:
    if not ids:
        raise AllocationRefused(f"{resource.name}: no device IDs in the request", invalid=True)
    devices = [resource.device(i) for i in ids]
    unknown = [i for i, d in zip(ids, devices) if d is None]
    if unknown:
        raise AllocationRefused(f"{resource.name} has no devices {unknown} (it has {len(resource.devices)}: "
                                "the node changed since the kubelet chose them?)", invalid=True)
    unhealthy = [d.id for d in devices if not d.healthy]
    if unhealthy:
        raise AllocationRefused(f"{resource.name}: devices {unhealthy} are unhealthy (gpud health <id> says why)")
    return devices


def _cdi_names(state: NodeState, resource: Resource, devices: list[PluginDevice]) -> list[str]:
    """The CDI device of each ID: the replica's own where gpud's spec has it, else its GPU's or MIG
    device's. Refused where the spec lacks one: the container would start without that device."""
    if state.cdi_kind is None:
        raise AllocationRefused(f"{resource.name}: gpud has written no CDI spec (gpud cdi says why), and the "
                                "device list strategy names devices by CDI")
    names = list(dict.fromkeys(d.id if d.id in state.cdi_names else d.device for d in devices))
    missing = [name for name in names if name not in state.cdi_names]
    if missing:
        raise AllocationRefused(f"{resource.name}: gpud's CDI spec has no devices {missing} yet (gpud cdi)")
    return [f"{state.cdi_kind}={name}" for name in names]


def _mps_client(state: NodeState, resource: Resource, targets: list[str]) -> MpsClient:
    clients = {target: state.mps_clients.get(target) for target in targets}
    missing = [target for target, client in clients.items() if client is None]
    if missing:
        raise AllocationRefused(f"{resource.name}: no MPS daemon of gpud serves {missing} (gpud mps status)")
    daemons = {client.daemon for client in clients.values()}
    if len(daemons) > 1:
        raise AllocationRefused(f"{resource.name}: the devices are served by {len(daemons)} MPS daemons "
                                f"({', '.join(sorted(daemons))}); a container can be a client of only one")
    client = next(iter(clients.values()))
    if client.state != "running":
        raise AllocationRefused(f"{resource.name}: MPS daemon {client.daemon} is {client.state}, not running")
    return client


def preferred(resource: Resource, available: list[str], must_include: list[str], size: int,
              nvlink_peers: Mapping[int, frozenset[int]] | None = None) -> list[str]:
    """A preferred allocation of `size` IDs from `available`, with every one of `must_include`.

    Whole GPUs: the set joined by the most NVLink pairs, then on the fewest NUMA nodes (as NVIDIA's
    plugin prefers linked GPUs through go-gpuallocator's best-effort policy; the NUMA node lets the
    kubelet's TopologyManager give the pod CPUs beside its GPUs). Replicas and MIG devices spread across
    GPUs as the NVIDIA plugin's `distributed` policy does (k8s-device-plugin internal/rm/allocate.go)."""
    by_id = {d.id: d for d in resource.devices}
    picked = [i for i in dict.fromkeys(must_include) if i in by_id]
    free = [by_id[i] for i in dict.fromkeys(available) if i in by_id and i not in picked]
    if resource.strategy == "gpu-memory":
        return _one_device(by_id, picked, free, size)
    if size > 1 and all(d.id == d.gpu for d in resource.devices):  # several whole GPUs (not replicas or MIG)
        return _linked(by_id, picked, free, size, nvlink_peers or {})
    return _distributed(resource, by_id, picked, free, size)


def _one_device(by_id: dict[str, PluginDevice], picked: list[str], free: list[PluginDevice], size: int) -> list[str]:
    """gpu-memory: every unit on one GPU or MIG device (Allocate refuses units of two). The device is
    must_include's, else the one with the FEWEST free units that still holds the request (best fit): a
    node's free memory stays in whole devices as large as possible, so a later big request still fits
    somewhere, where spreading (worst fit) would leave every device a little too small for it. Ties
    go to the lowest GPU index. Where no device holds the request, the device with the most free units
    (the kubelet adds the rest from any device, and Allocate then says which two devices it got)."""
    by_device: dict[str, list[PluginDevice]] = {}
    for device in free:
        by_device.setdefault(device.device, []).append(device)
    needed = size - len(picked)
    if picked:
        candidates = [by_device.get(by_id[picked[0]].device, [])]
    else:
        candidates = sorted(by_device.values(), key=lambda units: (units[0].gpu_index, units[0].device))
    fitting = [units for units in candidates if len(units) >= needed]
    chosen = (min(fitting, key=len) if fitting else max(candidates, key=len, default=[]))
    return picked + [d.id for d in sorted(chosen, key=lambda d: _natural(d.id))[:max(0, needed)]]


def _linked(by_id: dict[str, PluginDevice], picked: list[str], free: list[PluginDevice], size: int,
            peers: Mapping[int, frozenset[int]]) -> list[str]:
    """Grows a set from each free GPU in turn (after must_include), each step adding the GPU with the
    most NVLink peers in the set, then one on a NUMA node the set has, then the lowest index; keeps the
    best set: most NVLink pairs, fewest NUMA nodes, lowest indices. Greedy: n^2 steps, for any n."""
    def score(chosen: list[PluginDevice]) -> tuple:
        pairs = sum(b.gpu_index in peers.get(a.gpu_index, ()) for a, b in itertools.combinations(chosen, 2))
        return (-pairs, len({d.numa_node for d in chosen}), sorted(d.gpu_index for d in chosen))

    fixed = [by_id[i] for i in picked]
    best: list[PluginDevice] | None = None
    for seed in free or [None]:
        chosen = fixed + ([seed] if seed is not None else [])
        rest = [d for d in free if d is not seed]
        while len(chosen) < size and rest:
            nodes = {d.numa_node for d in chosen}
            step = min(rest, key=lambda d: (-sum(c.gpu_index in peers.get(d.gpu_index, ()) for c in chosen),
                                            d.numa_node not in nodes, d.gpu_index))
            rest.remove(step)
            chosen.append(step)
        if best is None or score(chosen) < score(best):
            best = chosen
    return picked + [d.id for d in sorted(best[len(fixed):], key=lambda d: d.gpu_index)]


def _distributed(resource: Resource, by_id: dict[str, PluginDevice], picked: list[str], free: list[PluginDevice],
                 size: int) -> list[str]:
    """Each pick goes to the GPU with the fewest of this resource's devices in use (already allocated,
    or picked in this answer), ties to the GPU picked least in this answer, then the lowest GPU index
    and ID."""
    not_in_use = Counter(d.gpu_index for d in free) + Counter(by_id[i].gpu_index for i in picked)
    in_use = Counter({gpu: count - not_in_use[gpu]
                      for gpu, count in Counter(d.gpu_index for d in resource.devices).items()})
    picked_on_gpu = Counter(by_id[i].gpu_index for i in picked)
    while len(picked) < size and free:
        best = min(free, key=lambda d: (in_use[d.gpu_index] + picked_on_gpu[d.gpu_index],
                                        picked_on_gpu[d.gpu_index], d.gpu_index, _natural(d.id)))
        free.remove(best)
        picked.append(best.id)
        picked_on_gpu[best.gpu_index] += 1
    return picked


def _natural(device_id: str) -> tuple[str, int]:
    """Replica IDs in number order (`::10` after `::9`)."""
    base, _, number = device_id.rpartition("::")
    return (base, int(number)) if number.isdigit() and base else (device_id, -1)
