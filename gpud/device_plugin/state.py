"""What the device plugin knows of the node: gpud's shared resources, CDI names and MPS clients."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class PluginDevice:
    """One device the kubelet schedules: a GPU or MIG UUID, or a replica ID `<uuid>::<n>`."""

    id: str
    gpu: str  # UUID of the GPU it is on (a MIG device's parent GPU)
    gpu_index: int
    healthy: bool
    numa_node: int | None = None  # its GPU's (GET /v1/gpus): the kubelet's TopologyManager aligns CPUs with it
    units: int | None = None  # gpu-memory: how many units its GPU or MIG device has in all

    @property
    def device(self) -> str:
        """The GPU or MIG UUID the ID stands for: a replica's `<uuid>` (k8s-device-plugin
        internal/rm/devices.go AnnotatedID.GetID). A MIG device's is its own UUID, never its GPU's."""
        return self.id.partition("::")[0]


@dataclass(frozen=True)
class Resource:
    name: str
    strategy: str  # none | time-slicing | mps | gpu-memory
    fail_requests_greater_than_one: bool
    devices: tuple[PluginDevice, ...]
    unit_mib: int | None = None  # gpu-memory: the device memory one ID stands for
    proportional_threads: bool = False  # gpu-memory: a client also gets its share of the device's SMs

    @property
    def served_by_mps(self) -> bool:
        """Its containers are clients of the MPS daemon of their device."""
        return self.strategy in ("mps", "gpu-memory")

    def device(self, device_id: str) -> PluginDevice | None:
        return next((d for d in self.devices if d.id == device_id), None)


@dataclass(frozen=True)
class MpsClient:
    """What a container needs to be a client of the MPS daemon that serves a device."""

    daemon: str
    state: str
    env: dict[str, str]
    mounts: tuple[tuple[str, str, bool], ...]  # (host path, container path, read only)
    host_ipc: bool = False  # the daemon shares memory with its clients through the host's /dev/shm


@dataclass(frozen=True)
class NodeState:
    resources: dict[str, Resource] = field(default_factory=dict)
    cdi_kind: str | None = None  # "<vendor>/<class>" of gpud's CDI spec; None: gpud writes none
    cdi_names: frozenset[str] = frozenset()
    mps_clients: dict[str, MpsClient] = field(default_factory=dict)  # by device UUID
    # why gpud computed no resources (e.g. migStrategy single halfway through a MIG change)
    sharing_error: str | None = None
    nvlink_peers: dict[int, frozenset[int]] = field(default_factory=dict)  # GPU index -> its NVLink peers
    # GPU or MIG UUID -> the DRA claim that holds it (GET /v1/claims): never handed out here as well
    claimed: dict[str, str] = field(default_factory=dict)
    # GPUs DRA claims hold only as shares with counted memory: gpud withdraws their gpu-memory units itself
    counted: frozenset[str] = frozenset()
    # gpud keeps a CDI spec but has not written it yet (at start, or a GPU reset it waits out)
    cdi_pending: bool = False

    def holder(self, resource: Resource, device: PluginDevice) -> str | None:
        return claim_holding(self.claimed, self.counted, resource, device)

    def device_count(self) -> int:
        return sum(len(r.devices) for r in self.resources.values())

    def cdi_behind(self) -> bool:
        """gpud's CDI spec is still to come, or does not name every device yet: it is written a moment
        after the change that made the devices (debounced, on a thread), and no event says when."""
        return self.cdi_pending or self.cdi_kind is not None and any(
            d.id not in self.cdi_names and d.device not in self.cdi_names
            for r in self.resources.values() for d in r.devices)

    def all_unhealthy(self) -> NodeState:
        """The same devices, every one Unhealthy (gpud has been unreachable too long to vouch for them)."""
        return replace(self, resources={
            name: replace(r, devices=tuple(replace(d, healthy=False) for d in r.devices))
            for name, r in self.resources.items()})


def resources_from_sharing(document: dict[str, Any], gpus: dict[str, Any]) -> dict[str, Resource]:
    """The resources of a GET /v1/sharing answer, each device with its GPU's NUMA node from a
    GET /v1/gpus answer."""
    numa = {gpu["uuid"]: gpu.get("numa_node") for gpu in gpus["gpus"]}
    return {entry["name"]: Resource(
        name=entry["name"], strategy=entry["strategy"],
        fail_requests_greater_than_one=bool(entry["fail_requests_greater_than_one"]),
        devices=tuple(PluginDevice(d["id"], d["parent"], int(d["gpu_index"]), bool(d["healthy"]), numa.get(d["parent"]),
                                   int(d["units"]) if "units" in d else None)
                      for d in entry["devices"]),
        unit_mib=int(entry["unit_mib"]) if "unit_mib" in entry else None,
        proportional_threads=bool(entry.get("proportional_threads", False)))
        for entry in document["resources"]}


def claimed_devices(claims: dict[str, Any]) -> dict[str, str]:
    """Device UUID -> the DRA claim holding it, in words, from a GET /v1/claims answer."""
    return {device["uuid"]: f"DRA claim {claim['namespace']}/{claim['name']} ({claim['uid']})"
            for claim in claims.get("claims") or [] for device in claim.get("devices") or []}


def counted_shares(claims: dict[str, Any]) -> frozenset[str]:
    """GPUs DRA claims hold only as shares with counted memory (a claim's `capacity`), from a GET /v1/claims
    answer: their gpu-memory units are not the claims' (gpud's ledger serves those the claims' memory
    covers Unhealthy), every other device of theirs is."""
    held = {device["uuid"] for claim in claims.get("claims") or [] for device in claim.get("devices") or []}
    uncounted = {device["uuid"] for claim in claims.get("claims") or [] for device in claim.get("devices") or []
                 if device["uuid"] not in (claim.get("capacity") or {})}
    return frozenset(held - uncounted)


def claim_holding(claimed: dict[str, str], counted: frozenset[str], resource: Resource,
                  device: PluginDevice) -> str | None:
    """The DRA claim holding a device of a resource (or its GPU), in words; None: the device is free here."""
    if resource.strategy == "gpu-memory" and (device.device in counted or device.gpu in counted):
        return None
    return claimed.get(device.device) or claimed.get(device.gpu)


def without_claimed(resources: dict[str, Resource], claimed: dict[str, str],
                    counted: frozenset[str] = frozenset()) -> dict[str, Resource]:
    """The resources with every device a DRA claim holds (or whose GPU one holds) Unhealthy: the kubelet then
    schedules no pod of the device plugin onto it."""
    if not claimed:
        return resources
    return {name: replace(r, devices=tuple(replace(d, healthy=False) if claim_holding(claimed, counted, r, d) else d
                                           for d in r.devices)) for name, r in resources.items()}


def nvlink_peers(gpus: dict[str, Any]) -> dict[int, frozenset[int]]:
    """GPU index -> the GPUs it reaches over NVLink, from a GET /v1/gpus answer."""
    return {int(gpu["index"]): frozenset(int(i) for i in gpu.get("nvlink_peers", ())) for gpu in gpus["gpus"]}


def mps_client(client_env: dict[str, Any]) -> MpsClient:
    """A GET /v1/mps/{name}/client-env answer."""
    return MpsClient(daemon=client_env["daemon"], state=client_env["state"], env=dict(client_env["env"]),
                     mounts=tuple((m["source"], m["target"], bool(m.get("read_only", False)))
                                  for m in client_env["mounts"]),
                     host_ipc=bool(client_env.get("host_ipc", False)))
