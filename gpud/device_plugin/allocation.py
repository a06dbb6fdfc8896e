"""Allocate and GetPreferredAllocation, from the plugin's NodeState (no I/O: the answers come from the
state gpud last reported, so they are quick and hold while gpud restarts)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from gpud.device_plugin.state import MpsClient, NodeState, PluginDevice, Resource


class AllocationRefused(Exception):
    """An Allocate the plugin refuses; `unknown` says whether the IDs were unknown (else unusable)."""

    def __init__(self, message: str, unknown: bool = False):
        super().__init__(message)
        self.unknown = unknown


@dataclass
class ContainerAllocation:
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (host path, container path, read only)
    cdi_devices: list[str] = field(default_factory=list)  # fully qualified: <vendor>/<class>=<name>


def allocate(state: NodeState, resource: Resource, ids: list[str]) -> ContainerAllocation:
    devices = _known_healthy(resource, ids)
    if resource.fail_requests_greater_than_one and len(ids) > 1:
        # the NVIDIA plugin's words for the same refusal (k8s-device-plugin internal/rm/rm.go ValidateRequest)
        raise AllocationRefused(f"{resource.name}: maximum request size for shared resources is 1, got {len(ids)}")
    parents = list(dict.fromkeys(d.parent for d in devices))  # two replicas of one GPU give the container one GPU
    allocation = ContainerAllocation(cdi_devices=_cdi_names(state, devices))
    # For runtimes without CDI: the NVIDIA container toolkit reads this, as the NVIDIA plugin's envvar
    # strategy sets it (k8s-device-plugin internal/plugin/server.go).
    allocation.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(parents)
    if resource.strategy == "mps":
        client = _mps_client(state, resource, parents)
        allocation.envs.update(client.env)
        allocation.mounts.extend(client.mounts)
    return allocation


def _known_healthy(resource: Resource, ids: list[str]) -> list[PluginDevice]:
    if not ids:
        raise AllocationRefused(f"{resource.name}: no device IDs in the request", unknown=True)
    devices = [resource.device(i) for i in ids]
    unknown = [i for i, d in zip(ids, devices) if d is None]
    if unknown:
        raise AllocationRefused(f"{resource.name} has no devices {unknown} (it has {len(resource.devices)}: "
                                "the node changed since the kubelet chose them?)", unknown=True)
    unhealthy = [d.id for d in devices if not d.healthy]
    if unhealthy:
        raise AllocationRefused(f"{resource.name}: devices {unhealthy} are unhealthy (gpud health <id> says why)")
    return devices


def _cdi_names(state: NodeState, devices: list[PluginDevice]) -> list[str]:
    """The CDI device of each ID: the replica's own when gpud's spec has it, else its GPU's or MIG
    device's; none without a spec (the container then relies on NVIDIA_VISIBLE_DEVICES)."""
    if state.cdi_kind is None:
        return []
    names = [d.id if d.id in state.cdi_names else d.parent for d in devices]
    return [f"{state.cdi_kind}={name}" for name in dict.fromkeys(names) if name in state.cdi_names]


def _mps_client(state: NodeState, resource: Resource, parents: list[str]) -> MpsClient:
    clients = {parent: state.mps_clients.get(parent) for parent in parents}
    missing = [parent for parent, client in clients.items() if client is None]
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


def preferred(resource: Resource, available: list[str], must_include: list[str], size: int) -> list[str]:
    """A preferred allocation of `size` IDs from `available`, with every one of `must_include`.

    Spread across GPUs as the NVIDIA plugin's `distributed` policy does for replicas and MIG devices
    (k8s-device-plugin internal/rm/allocate.go): each pick goes to the GPU with the fewest of this
    resource's devices in use (already allocated, or picked in this answer), ties to the GPU picked
    least in this answer, then the lowest GPU index and ID. Whole GPUs thus come in index order; no
    NVLink topology is weighed (gpud's sharing document does not carry it)."""
    by_id = {d.id: d for d in resource.devices}
    picked = [i for i in dict.fromkeys(must_include) if i in by_id]
    free = [by_id[i] for i in dict.fromkeys(available) if i in by_id and i not in picked]
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
