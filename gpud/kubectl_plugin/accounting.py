"""What each node has and what is allocated of it, from the API server's objects: a pure function of the
Nodes, the pods, and (where the cluster serves resource.k8s.io) the ResourceSlices and ResourceClaims.

Two paths hand out GPUs, and a node may run both during a migration (docs/kubernetes.md, "Moving from the
device plugin"), gpud keeping each GPU on one path at a time:
- the device plugin: the node's capacity of nvidia.com/gpu (and nvidia.com/gpu.shared, the name sharing
  renames replicas to), nvidia.com/mig-<profile> (and .shared), and gpud's GPU memory resource (the one
  whose `<resource>.total-mib` label gpud publishes beside it: docs/kubernetes.md "GPU memory as a
  resource"); allocated: the requests of the pods bound to the node that have not terminated, as the
  scheduler counts them (kubernetes/component-helpers resource/helpers.go PodRequests: the containers'
  sum, or an init container's request if larger, restartable (sidecar) init containers added to both);
- DRA: the devices of gpud's driver in the node's ResourceSlices (`type` gpu or mig; a partitionable MIG
  placement, without `uuid`, exists only while allocated) and the ResourceClaims whose allocation results
  name them.
A node's total is the larger of the two paths' (the same GPUs), its allocated their sum. Memory totals come
from GPU feature discovery's labels gpud publishes (nvidia.com/gpu.count x nvidia.com/gpu.memory, MiB),
else from the slices' `memory` capacities; memory allocated is each device's memory (a replica's share:
memory / replicas), a GPU memory unit's MiB, or a shared DRA device's consumed capacity.
"""

from __future__ import annotations

from collections import namedtuple

from gpud.base.quantity import parse_quantity

GPU_RESOURCE = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
SHARED_SUFFIX = ".shared"  # sharing's renameByDefault (gpud/sharing/config.py SHARED_RENAME_SUFFIX)
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
PRODUCT_LABEL = "nvidia.com/gpu.product"
TOTAL_MIB_SUFFIX = ".total-mib"
TERMINATED = ("Succeeded", "Failed")  # pods in these phases hold nothing (the scheduler's view)
GPU_TYPE, MIG_TYPE = "gpu", "mig"  # the DRA devices' `type` attribute (gpud/dra/devices.py)
MIB = 1 << 20


class Count:
    """Devices allocated of total (plain classes: dataclasses would double the plugin's start-up imports)."""

    def __init__(self) -> None:
        self.allocated = self.total = 0

    def view(self) -> dict:
        return {"allocated": self.allocated, "total": self.total}


class NodeView:
    def __init__(self, name: str, product: str = "") -> None:
        self.name, self.product = name, product
        self.gpus, self.mig_devices = Count(), Count()
        self.memory_allocated_mib = 0.0
        self.memory_total_mib: float | None = None  # None: no label or slice says
        self.memory_unknown: list[str] = []  # resources held whose memory no label gives
        self.pods: list[str] = []  # namespace/name of the pods holding GPU resources
        self.claims: list[str] = []  # namespace/name of the DRA claims on its devices
        self.device_plugin: dict[str, dict] = {}  # resource -> kind, capacity, allocatable, requested
        self.dra: dict[str, int] = {}

    def view(self) -> dict:
        return {"name": self.name, "product": self.product, "gpus": self.gpus.view(),
                "mig_devices": self.mig_devices.view(),
                "gpu_memory_mib": {"allocated": round(self.memory_allocated_mib, 1),
                                   "total": None if self.memory_total_mib is None else round(self.memory_total_mib, 1)},
                "memory_unknown_for": self.memory_unknown, "pods": self.pods, "claims": self.claims,
                "device_plugin": self.device_plugin, "dra": self.dra}


def _dict(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _count(text: object) -> int:
    """A count of an extended resource (a whole quantity); 0 for what is none."""
    try:
        value = parse_quantity(text) if isinstance(text, str) else None
    except ValueError:
        return 0
    return int(value) if value is not None and value >= 0 and value.denominator == 1 else 0


def _mib(text: object) -> float | None:
    try:
        return float(parse_quantity(text)) / MIB if isinstance(text, str) else None
    except ValueError:
        return None


def _label_int(labels: dict, key: str) -> int | None:
    value = labels.get(key)
    return int(value) if isinstance(value, str) and value.isdigit() else None


def gpu_resources(node: dict) -> dict[str, str]:
    """The node's device-plugin resources gpud serves, each as "gpu", "mig" or "memory"."""
    labels = _dict(_dict(node.get("metadata")).get("labels"))
    capacity = _dict(_dict(node.get("status")).get("capacity"))
    single = labels.get(MIG_STRATEGY_LABEL) == "single"  # nvidia.com/gpu are MIG devices
    kinds = {}
    for name in capacity:
        base = name.removesuffix(SHARED_SUFFIX)
        if base == GPU_RESOURCE:
            kinds[name] = MIG_TYPE if single else GPU_TYPE
        elif base.startswith(MIG_PREFIX):
            kinds[name] = MIG_TYPE
        elif name != GPU_RESOURCE and isinstance(labels.get(name + TOTAL_MIB_SUFFIX), str):
            kinds[name] = "memory"
    return kinds


def pod_requests(pod: dict) -> dict[str, int]:
    """The pod's effective request of each extended resource (component-helpers PodRequests)."""
    spec = _dict(pod.get("spec"))

    def requests(container: object) -> dict[str, int]:
        return {k: _count(v) for k, v in _dict(_dict(_dict(container).get("resources")).get("requests")).items()}

    total: dict[str, int] = {}
    for container in _list(spec.get("containers")):
        for name, value in requests(container).items():
            total[name] = total.get(name, 0) + value
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for container in _list(spec.get("initContainers")):
        own = requests(container)
        if _dict(container).get("restartPolicy") == "Always":  # a sidecar runs beside what follows
            for name, value in own.items():
                sidecars[name] = sidecars.get(name, 0) + value
                total[name] = total.get(name, 0) + value
        else:
            for name, value in own.items():
                init_peak[name] = max(init_peak.get(name, 0), value + sidecars.get(name, 0))
    return {name: max(total.get(name, 0), init_peak.get(name, 0)) for name in total.keys() | init_peak.keys()}


def _bound_pods(pods: list[dict]) -> dict[str, list[dict]]:
    by_node: dict[str, list[dict]] = {}
    for pod in pods:
        node = _dict(pod.get("spec")).get("nodeName")
        if isinstance(node, str) and node and _dict(pod.get("status")).get("phase") not in TERMINATED:
            by_node.setdefault(node, []).append(pod)
    return by_node


def _who(obj: dict) -> str:
    meta = _dict(obj.get("metadata"))
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _device_plugin(view: NodeView, node: dict, pods: list[dict]) -> tuple[int, int]:
    """Counts the device-plugin path into view; returns its (GPU, MIG) totals (capacity)."""
    labels = _dict(_dict(node.get("metadata")).get("labels"))
    status = _dict(node.get("status"))
    capacity, allocatable = _dict(status.get("capacity")), _dict(status.get("allocatable"))
    kinds = gpu_resources(node)
    requested = {name: 0 for name in kinds}
    for pod in pods:
        held = {name: value for name, value in pod_requests(pod).items() if name in kinds and value}
        for name, value in held.items():
            requested[name] += value
        if held:
            view.pods.append(_who(pod))
    totals = {GPU_TYPE: 0, MIG_TYPE: 0}
    for name, kind in kinds.items():
        view.device_plugin[name] = {"kind": kind, "capacity": _count(capacity.get(name)),
                                    "allocatable": _count(allocatable.get(name)), "requested": requested[name]}
        if kind == "memory":
            units = _count(capacity.get(name))
            total_mib = _label_int(labels, name + TOTAL_MIB_SUFFIX)
            if units and total_mib is not None:
                view.memory_allocated_mib += requested[name] * total_mib / units
            elif requested[name]:
                view.memory_unknown.append(name)
            continue
        totals[kind] += _count(capacity.get(name))
        (view.gpus if kind == GPU_TYPE else view.mig_devices).allocated += requested[name]
        base = name.removesuffix(SHARED_SUFFIX)
        memory, replicas = _label_int(labels, f"{base}.memory"), _label_int(labels, f"{base}.replicas") or 1
        if memory is not None:
            view.memory_allocated_mib += requested[name] * memory / replicas
        elif requested[name]:
            view.memory_unknown.append(name)
    return totals[GPU_TYPE], totals[MIG_TYPE]


# a device of a node-local slice: its node, type, memory (None: unknown), whether it has a uuid, its parent's UUID
SliceDevice = namedtuple("SliceDevice", "node type memory_mib has_uuid parent")


def slice_devices(slices: list[dict], driver: str) -> dict[tuple[str, str], SliceDevice]:
    """(pool, device name) -> the device, for the node-local slices of `driver`."""
    devices = {}
    for slice_ in slices:
        spec = _dict(slice_.get("spec"))
        node, pool = spec.get("nodeName"), _dict(spec.get("pool")).get("name")
        if spec.get("driver") != driver or not isinstance(node, str) or not isinstance(pool, str):
            continue
        for device in _list(spec.get("devices")):
            device = _dict(device)
            attributes = _dict(device.get("attributes"))
            kind = _dict(attributes.get("type")).get("string")
            if kind not in (GPU_TYPE, MIG_TYPE) or not isinstance(device.get("name"), str):
                continue
            memory = _mib(_dict(_dict(device.get("capacity")).get("memory")).get("value"))
            devices[(pool, device["name"])] = SliceDevice(
                node, kind, memory, "uuid" in attributes, str(_dict(attributes.get("parentUUID")).get("string", "")))
    return devices


def _dra(views: dict[str, NodeView], slices: list[dict], claims: list[dict], driver: str) -> dict[str, tuple]:
    """Counts the DRA path into views; returns node -> (GPU total, MIG total, memory total MiB or None)."""
    devices = slice_devices(slices, driver)
    allocated: dict[str, set] = {}
    for claim in claims:
        results = _list(_dict(_dict(_dict(claim.get("status")).get("allocation")).get("devices")).get("results"))
        for result in results:
            result = _dict(result)
            key = (result.get("pool"), result.get("device"))
            device = devices.get(key) if result.get("driver") == driver else None
            if device is None or device.node not in views:
                continue
            view = views[device.node]
            if _who(claim) not in view.claims:
                view.claims.append(_who(claim))
            consumed = _mib(_dict(result.get("consumedCapacity")).get("memory"))
            if key not in allocated.setdefault(device.node, set()):
                allocated[device.node].add(key)
                (view.gpus if device.type == GPU_TYPE else view.mig_devices).allocated += 1
                if consumed is None and device.memory_mib is not None:
                    view.memory_allocated_mib += device.memory_mib
            if consumed is not None:  # a share of a device several claims hold (consumable capacity)
                view.memory_allocated_mib += consumed
    by_node: dict[str, dict[tuple[str, str], SliceDevice]] = {}
    for key, device in devices.items():  # once: a cluster's devices, not once per node
        by_node.setdefault(device.node, {})[key] = device
    totals: dict[str, tuple] = {}
    for node in views:
        mine = by_node.get(node, {})
        gpus = [d for d in mine.values() if d.type == GPU_TYPE]
        migs = [d for key, d in mine.items() if d.type == MIG_TYPE and (d.has_uuid or key in allocated.get(node, ()))]
        whole = {key[1] for key, d in mine.items() if d.type == GPU_TYPE}
        memory = [d.memory_mib for d in gpus] + [d.memory_mib for d in migs if d.has_uuid and d.parent not in whole]
        known = [m for m in memory if m is not None]
        totals[node] = (len(gpus), len(migs), sum(known) if known else None)
        views[node].dra = {"gpus": len(gpus), "mig_devices": len(migs), "allocated": len(allocated.get(node, ()))}
    return totals


def inspect(nodes: list[dict], pods: list[dict], slices: list[dict], claims: list[dict], driver: str,
            include_all: bool = False) -> list[NodeView]:
    """One view per node that has GPUs (every node given with include_all), in the nodes' order."""
    by_node = _bound_pods(pods)
    views: dict[str, NodeView] = {}
    dp_totals = {}
    for node in nodes:
        meta = _dict(node.get("metadata"))
        name = meta.get("name")
        if not isinstance(name, str):
            continue
        labels = _dict(meta.get("labels"))
        view = views[name] = NodeView(name, str(labels.get(PRODUCT_LABEL, "")))
        dp_totals[name] = _device_plugin(view, node, by_node.get(name, []))
        count, memory = _label_int(labels, f"{GPU_RESOURCE}.count"), _label_int(labels, f"{GPU_RESOURCE}.memory")
        if count is not None and memory is not None:
            view.memory_total_mib = float(count * memory)
    dra_totals = _dra(views, slices, claims, driver)
    for name, view in views.items():
        dra_gpus, dra_migs, dra_memory = dra_totals[name]
        view.gpus.total = max(dp_totals[name][0], dra_gpus)
        view.mig_devices.total = max(dp_totals[name][1], dra_migs)
        if view.memory_total_mib is None:
            view.memory_total_mib = dra_memory
    return [view for view in views.values()
            if include_all or view.gpus.total or view.mig_devices.total or view.device_plugin or view.memory_total_mib]


def cluster_totals(views: list[NodeView]) -> dict:
    known = [v.memory_total_mib for v in views if v.memory_total_mib is not None]
    return {"nodes": len(views),
            "gpus": {"allocated": sum(v.gpus.allocated for v in views), "total": sum(v.gpus.total for v in views)},
            "mig_devices": {"allocated": sum(v.mig_devices.allocated for v in views),
                            "total": sum(v.mig_devices.total for v in views)},
            "gpu_memory_mib": {"allocated": round(sum(v.memory_allocated_mib for v in views), 1),
                               "total": round(sum(known), 1) if known else None},
            "pods": len({p for v in views for p in v.pods}), "claims": len({c for v in views for c in v.claims})}
