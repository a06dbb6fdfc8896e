"""GPU memory as a schedulable resource (gpud.yaml `gpu_memory`), as Alibaba ACK's aliyun.com/gpu-mem
and HAMi's nvidia.com/gpumem offer it: the devices it covers, the units of unit_mib each offers, the
/v1/sharing entry that advertises them (one ID per unit), and the allocations the device plugin reports
from the kubelet. A pod's k units are k * unit_mib of one device's memory, enforced as the MPS client
limit CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: the covered devices run MPS daemons with no default limits.

It keeps the ledger of device memory both Kubernetes paths promise: the units the device plugin's pods
hold and the memory DRA claims hold as shares (gpud/claims.py, dra.shared_gpus). A claim is refused
memory that is promised already; units covering what the claims hold are withdrawn from the device plugin.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Callable, Iterator

from gpud.base.errors import ErrorKind, GpudError
from gpud.base.lifecycle import Component
from gpud.base.samples import Family
from gpud.config import GpuMemoryConfig
from gpud.model.dcgm_labels import gpu_labels, instance_labels
from gpud.model.inventory import Inventory
from gpud.model.mps import daemon_name
from gpud.sharing.resources import Device, device_healthy

STRATEGY = "gpu-memory"
MAX_PROBLEMS_LISTED = 100
MAX_UNKNOWN_LISTED = 100


@dataclass(frozen=True)
class Allocation:
    """The unit IDs the kubelet allocated to one container, as the device plugin reports them."""

    namespace: str
    pod: str
    container: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class CoveredDevice:
    """A device gpu_memory covers, what it offers and the units that make of it."""

    device: Device
    offered_mib: int
    units: int


@dataclass(frozen=True)
class ClaimedMemory:
    """Memory of one device a DRA claim holds as a share (PUT /v1/claims/{uid} with capacity)."""

    uid: str
    namespace: str
    name: str
    mib: int


@dataclass(frozen=True)
class PromisedMemory:
    """One device's ledger: what it offers, and what of it the DRA claims and the device plugin's pods
    were promised (their units, in MiB)."""

    device: str
    offered_mib: int
    claims: tuple[ClaimedMemory, ...]
    pods: tuple[tuple[str, str, int], ...]  # (namespace, pod, MiB) of gpu_memory's units

    @property
    def claims_mib(self) -> int:
        return sum(claim.mib for claim in self.claims)

    @property
    def gpu_memory_mib(self) -> int:
        return sum(mib for _, _, mib in self.pods)

    @property
    def free_mib(self) -> int:
        """Below 0 where the device is overcommitted."""
        return self.offered_mib - self.claims_mib - self.gpu_memory_mib

    def holders(self) -> str:
        """Who holds the promised memory, in words."""
        held = [f"DRA claim {c.namespace}/{c.name} ({c.mib} MiB)" for c in self.claims]
        held += [f"pod {namespace}/{pod} of gpu_memory ({mib} MiB)" for namespace, pod, mib in self.pods]
        return ", ".join(held) or "nobody"


def offered_mib(device: Device) -> int:
    """What a device offers processes: a GPU's memory less what the driver reserves for itself (memory
    info v2 `reserved`; the whole memory where the driver has no v2, as nothing says how much is kept).
    A MIG device's memory is its GPU instance's, which NVML gives net of the driver's own."""
    if device.mig:
        return device.mig.memory_total_mib
    return max(device.gpu.memory_total_mib - (device.gpu.memory_reserved_mib or 0), 0)


def covered_devices(config: GpuMemoryConfig, inventory: Inventory) -> tuple[list[CoveredDevice], list[str]]:
    """The devices `devices` selects (`all`: every GPU not in MIG mode; a GPU in MIG mode by its index or
    UUID: each of its MIG devices; MIG devices by UUID), with their units, and warnings ("key: why") of
    selectors that match nothing and devices smaller than a unit."""
    if not config.enabled:
        return [], []
    candidates = [Device(gpu) for gpu in inventory.gpus if gpu.mig.mode != "enabled"] + [
        Device(gpu, mig) for gpu in inventory.gpus if gpu.mig.mode == "enabled" for mig in gpu.mig.devices]
    selectors = [str(selector) for selector in config.devices]
    warnings = [f"gpu_memory.devices: {selector!r} matches no GPU or MIG device on this node" for selector in selectors
                if selector != "all" and not any(device.matches(selector) for device in candidates)]
    covered = []
    for device in candidates:
        if not (("all" in selectors and device.mig is None) or any(device.matches(s) for s in selectors)):
            continue
        offered = offered_mib(device)
        units = offered // config.unit_mib
        if units == 0:
            warnings.append(f"gpu_memory.unit_mib: {config.unit_mib} MiB is more than device {device.uuid} offers "
                            f"({offered} MiB): it gets no units")
        covered.append(CoveredDevice(device, offered, units))
    return covered, warnings


def unit_ids(covered: CoveredDevice) -> list[str]:
    return [f"{covered.device.uuid}::{n}" for n in range(covered.units)]


class GpuMemory(Component):
    """gpu_memory as gpud serves it: the devices covered (recomputed with the sharing document, on every
    inventory or health change) and the allocations the device plugin last reported. Reports are kept
    in memory only: the kubelet holds the record, and the plugin reports again after a gpud restart."""

    name = "gpu_memory"

    def __init__(self, config: GpuMemoryConfig, notify: Callable[[str, dict], object] = lambda kind, data: None):
        self.config = config
        self.covered: list[CoveredDevice] = []
        self.warnings: list[str] = []
        self._driver_version = ""
        self._devices: dict[str, Device] = {}  # every GPU not in MIG mode and MIG device, by UUID: the metrics'
        self._claimed: Mapping[str, tuple[ClaimedMemory, ...]] = {}  # device UUID -> DRA claims' memory on it
        self._notify = notify  # the watch stream
        self._report: dict | None = None  # the last PUT /v1/allocations, with when it came

    def per_client_devices(self, inventory: Inventory) -> frozenset[str]:
        """Device UUIDs whose MPS daemons gpu_memory needs, with limits set per client."""
        return frozenset(c.device.uuid for c in covered_devices(self.config, inventory)[0])

    def update(self, inventory: Inventory, claimed: Mapping[str, tuple[ClaimedMemory, ...]]) -> None:
        """Takes the node's devices and the memory DRA claims hold on them (device UUID -> the claims')."""
        self.covered, self.warnings = covered_devices(self.config, inventory)
        self._driver_version = inventory.driver_version
        self._devices = {device.uuid: device for device in (
            [Device(gpu) for gpu in inventory.gpus if gpu.mig.mode != "enabled"]
            + [Device(gpu, mig) for gpu in inventory.gpus if gpu.mig.mode == "enabled" for mig in gpu.mig.devices])}
        self._claimed = claimed

    def promised(self, device: Device, claims: Iterable[ClaimedMemory]) -> PromisedMemory:
        """The ledger of `device` were these the DRA claims' memory on it: with the units the device
        plugin's pods hold there, as last reported."""
        return self._promised(device, claims, self._held()[0].get(device.uuid, {}))

    def _promised(self, device: Device, claims: Iterable[ClaimedMemory], owners: dict[tuple, int]) -> PromisedMemory:
        pods: dict[tuple[str, str], int] = {}
        for (namespace, pod, _), units in owners.items():
            pods[namespace, pod] = pods.get((namespace, pod), 0) + units * self.config.unit_mib
        return PromisedMemory(device.uuid, offered_mib(device), tuple(claims),
                              tuple((namespace, pod, mib) for (namespace, pod), mib in sorted(pods.items())))

    def resource(self, unhealthy: frozenset[str]) -> dict | None:
        """The /v1/sharing entry: one device per unit, `<device uuid>::<n>`; None when not enabled. The units
        withdrawn for the DRA claims' memory are Unhealthy: the kubelet allocates only healthy devices to
        new pods and leaves the pods holding one alone (kubernetes pkg/kubelet/cm/devicemanager manager.go,
        devicesToAllocate takes from healthyDevices), and its capacity keeps them, as when a GPU is unhealthy
        in NVIDIA's k8s-device-plugin, rather than IDs that come and go."""
        if not self.config.enabled:
            return None
        held_ids = self._held_ids()
        withdrawn = {id_ for c in self.covered for id_ in self._withdrawn(c, held_ids)}
        devices = [{"id": id_, "parent": c.device.gpu.uuid, "gpu_index": c.device.gpu.index,
                    "healthy": device_healthy(c.device, unhealthy) and id_ not in withdrawn, "device": c.device.uuid,
                    "units": c.units, "mps_daemon": daemon_name(c.device.gpu, c.device.mig)}
                   for c in self.covered for id_ in unit_ids(c)]
        return {"name": self.config.resource, "strategy": STRATEGY, "fail_requests_greater_than_one": False,
                "unit_mib": self.config.unit_mib, "proportional_threads": self.config.proportional_threads,
                "count": len(devices), "devices": devices}

    def labels(self) -> dict[str, str]:
        """NFD's label of the memory the node offers as the resource, in MiB (as GFD's <resource>.memory)."""
        if not self.config.enabled:
            return {}
        return {f"{self.config.resource}.total-mib": str(sum(c.units for c in self.covered) * self.config.unit_mib)}

    # -- allocations ---------------------------------------------------------------------------

    def check_reporter(self, resource: str) -> None:
        """Refuses a report of the allocations of `resource` (PUT /v1/allocations) that this node does not
        take: gpu_memory is not enabled, or advertised under another name. Asked before the report's
        pods are read."""
        if not self.config.enabled:
            raise GpudError(ErrorKind.CONFLICT, "gpu-memory-disabled",
                            "gpu_memory is not enabled on this node (gpud.yaml gpu_memory.enabled)")
        if resource != self.config.resource:
            raise GpudError(ErrorKind.CONFLICT, "wrong-resource", f"this node advertises GPU memory as "
                            f"{self.config.resource!r}, not {resource[:80]!r}")

    def report(self, read_at: float, allocations: list[Allocation]) -> dict:
        """What the device plugin read from the kubelet's PodResources API at read_at (a Unix time), from
        a reporter check_reporter took: the allocations in force from now on; returns their view."""
        report = {"read_at": read_at, "pods": allocations}
        changed = self._report is None or {**self._report, "reported_at": None} != {**report, "reported_at": None}
        self._report = {**report, "reported_at": time.time()}
        document = self.view()
        if changed:
            self._notify("allocations", {"resource": self.config.resource, "pods": document["node"]["pods"],
                                         "allocated_mib": document["node"]["allocated_mib"],
                                         "unknown_ids": len(document["unknown_ids"])})
        return document

    def _held(self) -> tuple[dict[str, dict[tuple, int]], list[str]]:
        """From the last report: device UUID -> (namespace, pod, container) -> units, and the IDs reported
        that are no unit of a covered device."""
        by_id = {id_: c for c in self.covered for id_ in unit_ids(c)}
        held: dict[str, dict[tuple, int]] = {}
        unknown: list[str] = []
        for allocation in (self._report or {}).get("pods", []):
            who = (allocation.namespace, allocation.pod, allocation.container)
            for id_ in allocation.device_ids:
                covered = by_id.get(id_)
                if covered is None:
                    unknown.append(id_)
                    continue
                owners = held.setdefault(covered.device.uuid, {})
                owners[who] = owners.get(who, 0) + 1
        return held, unknown

    def _held_ids(self) -> set[str]:
        return {id_ for allocation in (self._report or {}).get("pods", []) for id_ in allocation.device_ids}

    def _withdrawn(self, covered: CoveredDevice, held_ids: set[str]) -> list[str]:
        """The unit IDs of a device the device plugin must not hand out while DRA claims hold its memory:
        the last ones no pod holds, enough that the units left and the claims' memory fit what it offers."""
        claims_mib = sum(claim.mib for claim in self._claimed.get(covered.device.uuid, ()))
        if not claims_mib:
            return []
        allowed = max(covered.offered_mib - claims_mib, 0) // self.config.unit_mib
        free = [id_ for id_ in unit_ids(covered) if id_ not in held_ids]
        return free[len(free) - min(len(free), covered.units - allowed):] if covered.units > allowed else []

    def view(self) -> dict:
        """GET /v1/allocations: per covered device what is allocatable and who holds what of it."""
        unit = self.config.unit_mib
        held, unknown = self._held()
        pods = {who[:2] for owners in held.values() for who in owners}
        held_ids = self._held_ids()
        devices = [self._device_view(c, held.get(c.device.uuid, {}), held_ids) for c in self.covered]
        problems = list(self.warnings)
        problems += [f"{d['device']}: {d['allocated_units']} units allocated of {d['allocatable_units']}"
                     for d in devices if d["allocated_units"] > d["allocatable_units"]]
        problems += [f"{ledger.device}: overcommitted by {-ledger.free_mib} MiB: it offers {ledger.offered_mib} MiB, "
                     f"promised to {ledger.holders()}"
                     for ledger in self.ledgers() if ledger.free_mib < 0 and ledger.claims]
        if unknown:
            problems.append(f"{len(unknown)} reported device IDs are no unit of {self.config.resource} on this node")
        return {"resource": self.config.resource, "enabled": self.config.enabled, "unit_mib": unit,
                "reported_at": self._report["reported_at"] if self._report else None,
                "read_at": self._report["read_at"] if self._report else None, "devices": devices,
                "node": {"allocatable_mib": sum(d["allocatable_mib"] for d in devices),
                         "allocated_mib": sum(d["allocated_mib"] for d in devices), "pods": len(pods)},
                "unknown_ids": unknown[:MAX_UNKNOWN_LISTED], "unknown_id_count": len(unknown),
                "problems": problems[:MAX_PROBLEMS_LISTED]}

    def _device_view(self, covered: CoveredDevice, owners: dict[tuple, int], held_ids: set[str]) -> dict:
        unit, device = self.config.unit_mib, covered.device
        allocated = sum(owners.values())
        return {"device": device.uuid, "gpu_index": device.gpu.index, "mig": device.mig is not None,
                "total_mib": device.mig.memory_total_mib if device.mig else device.gpu.memory_total_mib,
                "offered_mib": covered.offered_mib, "allocatable_units": covered.units,
                "allocatable_mib": covered.units * unit, "allocated_units": allocated, "allocated_mib": allocated * unit,
                "claims_mib": sum(claim.mib for claim in self._claimed.get(device.uuid, ())),
                "withdrawn_units": len(self._withdrawn(covered, held_ids)),
                "holders": [{"namespace": ns, "pod": pod, "container": container, "units": units, "mib": units * unit}
                            for (ns, pod, container), units in sorted(owners.items())]}

    def ledgers(self) -> list[PromisedMemory]:
        """The ledger of every device that DRA claims or the device plugin's pods hold memory of."""
        held = self._held()[0]
        return [self._promised(device, self._claimed.get(uuid, ()), held.get(uuid, {}))
                for uuid, device in self._devices.items() if uuid in held or self._claimed.get(uuid)]

    # -- metrics -------------------------------------------------------------------------------

    def collect(self) -> Iterator[Family]:
        """Per covered device the memory allocatable as the resource and the memory allocated, in bytes."""
        allocatable = Family("gpud_gpu_memory_allocatable_bytes",
                             "GPU memory the device offers as the gpu_memory resource (whole units).", "gauge")
        allocated = Family("gpud_gpu_memory_allocated_bytes",
                           "GPU memory of the gpu_memory resource the kubelet allocated to containers, "
                           "as the device plugin last reported it.", "gauge")
        view = {d["device"]: d for d in self.view()["devices"]}
        for covered in self.covered:
            device = covered.device
            labels = gpu_labels(device.gpu, self._driver_version)
            if device.mig:
                labels = instance_labels(labels, device.gpu, device.mig)
            allocatable.add(labels, view[device.uuid]["allocatable_mib"] << 20)
            allocated.add(labels, view[device.uuid]["allocated_mib"] << 20)
        yield allocatable
        yield allocated
        yield self._promised_family()

    def _promised_family(self) -> Family:
        promised = Family("gpud_gpu_memory_promised_bytes",
                          "Device memory promised to Kubernetes, by path: held by DRA claims' shares (path=dra) or "
                          "allocated as gpu_memory units (path=device_plugin).", "gauge")
        for ledger in self.ledgers():
            device = self._devices[ledger.device]
            labels = gpu_labels(device.gpu, self._driver_version)
            if device.mig:
                labels = instance_labels(labels, device.gpu, device.mig)
            promised.add({**labels, "path": "dra"}, ledger.claims_mib << 20)
            promised.add({**labels, "path": "device_plugin"}, ledger.gpu_memory_mib << 20)
        return promised
