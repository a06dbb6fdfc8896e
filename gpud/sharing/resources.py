"""What a device plugin would advertise on this node, from the sharing config and an inventory snapshot.

Base resources follow the MIG strategy as NVIDIA's k8s-device-plugin builds them. The sharing in force
(MPS wins over time-slicing) then turns each device it selects into `replicas` devices with the IDs
`<uuid>::0` ... `<uuid>::<replicas-1>`. Unlike the plugin, gpud honours `devices` and `rename`, so
GPUs can differ in replica count, and it allows MPS inside MIG devices. The labels are those GPU
feature discovery (GFD) writes for the same node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpud.model.inventory import Gpu, Inventory, MigDevice
from gpud.model.mig_profile_names import MigProfileName
from gpud.sharing.config import ReplicatedResources, SharedResource, SharingConfig

GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
# The MPS control daemon allows 48 replicas per device from compute capability 7.5 (checked in
# config.py), 16 below it.
MAX_MPS_REPLICAS_BELOW_7_5 = 16


class SharingError(ValueError):
    """A config this node cannot be shared by, e.g. migStrategy single with differing MIG profiles."""


class _SingleLayoutError(SharingError):
    """A MIG layout migStrategy single cannot expose; GFD labels the node <model>-MIG-INVALID."""


@dataclass(frozen=True)
class Device:
    """A device a plugin advertises whole: a GPU, or a MIG device on one."""

    gpu: Gpu
    mig: MigDevice | None = None

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid

    @property
    def memory_mib(self) -> int:
        return self.mig.memory_total_mib if self.mig else self.gpu.memory_total_mib

    @property
    def product(self) -> str:
        """GFD's product label: the model name sanitised; MIG devices add -MIG-<profile>."""
        model = gfd_sanitised(self.gpu.name)
        return f"{model}-MIG-{_profile_for_names(self.mig.profile)}" if self.mig else model

    def matches(self, selector: str) -> bool:
        """Whether a `devices` selector picks this device. A GPU's index or UUID also picks every MIG
        device on it (gpud's addition), so MIG resources can be shared per GPU."""
        keys = {str(self.gpu.index), self.gpu.uuid}
        if self.mig:
            keys |= {f"{self.gpu.index}:{self.mig.index}", self.mig.uuid,
                     f"MIG-{self.gpu.uuid}/{self.mig.gi_id}/{self.mig.ci_id}"}
        return selector in keys


# Each base resource's devices, each with the sharing entry that replicates it (None: not shared).
_Assignments = dict[str, list[tuple[Device, SharedResource | None]]]


def compute_sharing(config: SharingConfig | None, inventory: Inventory,
                    unhealthy: frozenset[str] = frozenset()) -> dict:
    """The /v1/sharing document: resources with their devices and replica IDs, GFD labels, and the
    error that stops this node from being shared as configured (then no resources are advertised)."""
    config = config or SharingConfig()
    labels = _node_labels(config, inventory.gpus)
    resources: list[dict] = []
    error = None
    try:
        assignments = _assignments(config, inventory.gpus)
    except _SingleLayoutError as exc:
        labels |= _invalid_single_labels(inventory.gpus)
        error = str(exc)
    except SharingError as exc:
        error = str(exc)
    else:
        resources = _resources(assignments, config, unhealthy)
        labels |= _resource_labels(assignments, inventory.gpus, config.strategy)
    return {"mig_strategy": config.mig_strategy, "strategy": config.strategy, "resources": resources,
            "labels": dict(sorted(labels.items())), "error": error}


def mps_replicas(config: SharingConfig | None, inventory: Inventory) -> dict[str, int]:
    """Device UUID -> MPS replicas, for each device the MPS strategy shares."""
    if config is None or config.strategy != "mps":
        return {}
    try:
        assignments = _assignments(config, inventory.gpus)
    except SharingError:
        return {}  # /v1/sharing reports the error; the MPS daemons keep the limits gpud's mps section sets
    return {device.uuid: entry.replicas for pairs in assignments.values() for device, entry in pairs if entry}


def _assignments(config: SharingConfig, gpus: tuple[Gpu, ...]) -> _Assignments:
    base = _base_resources(config.mig_strategy, gpus)
    sharing = _active_sharing(config)
    assignments = _assign(base, sharing.resources if sharing else ())
    if config.strategy == "mps":
        _check_mps_replicas(assignments)
    return assignments


def _active_sharing(config: SharingConfig) -> ReplicatedResources | None:
    return {"mps": config.mps, "time-slicing": config.time_slicing}.get(config.strategy)


# -- base resources, by MIG strategy ---------------------------------------------------------------


def _base_resources(mig_strategy: str, gpus: tuple[Gpu, ...]) -> dict[str, list[Device]]:
    if mig_strategy == "mixed":
        return _mixed_resources(gpus)
    if mig_strategy == "single" and any(_mig_enabled(gpu) for gpu in gpus):
        return {GPU_RESOURCE: _single_devices(gpus)}
    # none, or single without MIG: whole GPUs, MIG mode or not
    return {GPU_RESOURCE: [Device(gpu) for gpu in gpus]}


def _mixed_resources(gpus: tuple[Gpu, ...]) -> dict[str, list[Device]]:
    """Whole GPUs with MIG off, plus one resource per MIG profile whose compute instance fills its GPU instance."""
    resources = {GPU_RESOURCE: [Device(gpu) for gpu in gpus if not _mig_enabled(gpu)]}
    for device in _mig_devices(gpus):
        if _fills_gpu_instance(device.mig.profile):
            resources.setdefault(MIG_RESOURCE_PREFIX + _profile_for_names(device.mig.profile), []).append(device)
    return resources


def _single_devices(gpus: tuple[Gpu, ...]) -> list[Device]:
    """MIG devices as nvidia.com/gpu, refusing the layouts the plugin refuses."""
    disabled = [gpu.index for gpu in gpus if not _mig_enabled(gpu)]
    if disabled:
        raise _SingleLayoutError(f"migStrategy single needs MIG enabled on every GPU, but it is disabled on "
                                 f"GPU {_listed(disabled)}; use migStrategy mixed")
    empty = [gpu.index for gpu in gpus if not gpu.mig.devices]
    if empty:
        raise _SingleLayoutError(f"migStrategy single needs MIG devices on every GPU, but there are none on "
                                 f"GPU {_listed(empty)}")
    devices = _mig_devices(gpus)
    profiles = sorted({device.mig.profile for device in devices})
    if len(profiles) > 1:
        raise _SingleLayoutError(f"migStrategy single needs one MIG profile on the node, found {', '.join(profiles)}; "
                                 "use migStrategy mixed")
    return devices


def _mig_devices(gpus: tuple[Gpu, ...]) -> list[Device]:
    return [Device(gpu, mig) for gpu in gpus if _mig_enabled(gpu) for mig in gpu.mig.devices]


def _mig_enabled(gpu: Gpu) -> bool:
    return gpu.mig.mode == "enabled"


def _fills_gpu_instance(profile: str) -> bool:
    try:
        name = MigProfileName.parse(profile)
    except ValueError:
        return False  # a profile gpud cannot read gets no resource
    return name.ci_slices == name.gi_slices


def _profile_for_names(profile: str) -> str:
    # "+" is not allowed in resource names or label values: "1g.5gb+me" becomes "1g.5gb.me", as in the plugin.
    return profile.replace("+", ".")


def _listed(indices: list[int]) -> str:
    return ", ".join(str(index) for index in indices)


# -- sharing ---------------------------------------------------------------------------------------


def _assign(base: dict[str, list[Device]], entries: tuple[SharedResource, ...]) -> _Assignments:
    chosen: dict[str, SharedResource] = {}  # device UUID -> the entry replicating it
    for entry in entries:
        if not base.get(entry.name):
            continue  # a resource the node lacks (say, before a MIG change makes it): nothing to share yet
        for device in _selected(entry, base[entry.name]):
            if device.uuid in chosen:
                raise SharingError(f"{entry.name}: device {device.uuid} is selected by more than one sharing entry")
            chosen[device.uuid] = entry
    return {name: [(device, chosen.get(device.uuid)) for device in devices] for name, devices in base.items()}


def _selected(entry: SharedResource, devices: list[Device]) -> list[Device]:
    if entry.devices == "all":
        return devices
    if isinstance(entry.devices, int):
        if entry.devices > len(devices):
            raise SharingError(f"{entry.name}: devices asks for the first {entry.devices} devices, "
                               f"but this node has {len(devices)}")
        return devices[:entry.devices]
    selectors = dict.fromkeys(entry.devices)  # once each: a list may repeat one thousands of times (warned)
    for selector in selectors:
        if not any(device.matches(selector) for device in devices):
            raise SharingError(f"{entry.name}: device {selector!r} matches no {entry.name} device on this node")
    return [device for device in devices if any(device.matches(selector) for selector in selectors)]


def _check_mps_replicas(assignments: _Assignments) -> None:
    for pairs in assignments.values():
        for device, entry in pairs:
            if entry and entry.replicas > MAX_MPS_REPLICAS_BELOW_7_5 and _below_7_5(device.gpu):
                raise SharingError(
                    f"{entry.name}: {entry.replicas} MPS replicas on GPU {device.gpu.index} ({device.gpu.name}, "
                    f"compute capability {device.gpu.cuda_compute_capability}); at most "
                    f"{MAX_MPS_REPLICAS_BELOW_7_5} below compute capability 7.5")


def _below_7_5(gpu: Gpu) -> bool:
    try:
        major, minor = (int(part) for part in gpu.cuda_compute_capability.split("."))
    except ValueError:
        return False  # unknown (a GPU gpud never read): nothing to hold it to
    return (major, minor) < (7, 5)


# -- the document ----------------------------------------------------------------------------------


def _resources(assignments: _Assignments, config: SharingConfig, unhealthy: frozenset[str]) -> list[dict]:
    """One entry per advertised name (a renamed entry's replicas move to its new name), sorted by name."""
    members: dict[str, list[tuple[Device, int]]] = {}
    for name, pairs in assignments.items():
        for device, entry in pairs:
            advertised = (entry.rename or name) if entry else name
            members.setdefault(advertised, []).append((device, entry.replicas if entry else 1))
    sharing = _active_sharing(config)
    fail_requests = bool(sharing and sharing.fail_requests_greater_than_one)
    return [_resource(name, devices, config.strategy, fail_requests, unhealthy)
            for name, devices in sorted(members.items())]


def _resource(name: str, members: list[tuple[Device, int]], strategy: str, fail_requests: bool,
              unhealthy: frozenset[str]) -> dict:
    devices = [entry for device, replicas in members for entry in _device_entries(device, replicas, unhealthy)]
    replica_counts = {replicas for _, replicas in members}
    shared = max(replica_counts) > 1
    return {"name": name, "strategy": strategy if shared else "none",
            "replicas": next(iter(replica_counts)) if len(replica_counts) == 1 else None,
            "count": len(devices), "fail_requests_greater_than_one": shared and fail_requests, "devices": devices}


def device_healthy(device: Device, unhealthy: frozenset[str]) -> bool:
    """A device is served unhealthy when it or its GPU is lost or unhealthy."""
    return not device.gpu.lost and not {device.uuid, device.gpu.uuid} & unhealthy


def _device_entries(device: Device, replicas: int, unhealthy: frozenset[str]) -> list[dict]:
    healthy = device_healthy(device, unhealthy)
    ids = [device.uuid] if replicas == 1 else [f"{device.uuid}::{n}" for n in range(replicas)]
    return [{"id": id_, "parent": device.gpu.uuid, "gpu_index": device.gpu.index, "replicas": replicas,
             "healthy": healthy} for id_ in ids]


# -- GFD labels ------------------------------------------------------------------------------------


def _node_labels(config: SharingConfig, gpus: tuple[Gpu, ...]) -> dict[str, str]:
    labels = {"nvidia.com/mig.capable": _flag(any(gpu.mig.capable for gpu in gpus)),
              "nvidia.com/mps.capable": _flag(config.strategy == "mps")}
    if config.mig_strategy != "none":  # GFD labels the strategy only with its MIG labeler (mig-strategy.go)
        labels["nvidia.com/mig.strategy"] = config.mig_strategy
    return labels


def _resource_labels(assignments: _Assignments, gpus: tuple[Gpu, ...], strategy: str) -> dict[str, str]:
    if not gpus:
        return {}
    gpu_pairs = assignments.get(GPU_RESOURCE, [])
    if gpu_pairs and gpu_pairs[0][0].mig:  # migStrategy single: the MIG devices are the GPUs
        labels = _labels_for(GPU_RESOURCE, len(gpu_pairs), gpu_pairs[0][0], gpu_pairs, strategy)
    elif all(_mig_enabled(gpu) for gpu in gpus):
        # GFD labels MIG-enabled GPUs without sharing, replicas 0 (mig-strategy.go newGPULabelers,
        # NewGPUResourceLabelerWithoutSharing; resource.go getReplicas)
        labels = _labels_for(GPU_RESOURCE, len(gpus), Device(gpus[0]), [], strategy) | {
            f"{GPU_RESOURCE}.replicas": "0"}
    else:  # GFD counts every physical GPU, and describes GPU 0
        labels = _labels_for(GPU_RESOURCE, len(gpus), Device(gpus[0]), gpu_pairs, strategy)
    for name, pairs in assignments.items():
        if name.startswith(MIG_RESOURCE_PREFIX):
            labels |= _labels_for(name, len(pairs), pairs[0][0], pairs, strategy)
    return labels


def _labels_for(name: str, count: int, described: Device, pairs: list[tuple[Device, SharedResource | None]],
                strategy: str) -> dict[str, str]:
    """GFD's labels for one resource. Replicas is the largest replica count among its devices; the
    product gets -SHARED when some device is shared under the resource's own name (not renamed)."""
    replicas = max((entry.replicas for _, entry in pairs if entry), default=1)
    shared_unrenamed = any(entry and not entry.rename for _, entry in pairs)
    labels = {f"{name}.count": str(count),
              f"{name}.product": described.product + ("-SHARED" if shared_unrenamed else ""),
              f"{name}.replicas": str(replicas),
              f"{name}.sharing-strategy": strategy if replicas > 1 else "none"}
    if described.memory_mib:  # GFD leaves the label out when the memory is unknown
        labels[f"{name}.memory"] = str(described.memory_mib)
    if described.mig:
        labels |= _mig_attribute_labels(name, described.mig)
    return labels


def _mig_attribute_labels(name: str, mig: MigDevice) -> dict[str, str]:
    """GFD's labels of a MIG device's attributes (k8s-device-plugin internal/resource/nvml-mig-device.go
    GetAttributes, from nvmlDeviceGetAttributes), beside its memory."""
    engines = mig.engines
    return {f"{name}.{suffix}": str(value) for suffix, value in (
        ("multiprocessors", mig.sm_count), ("slices.gi", mig.gi_slices), ("slices.ci", mig.ci_slices),
        ("engines.copy", engines.copy), ("engines.decoder", engines.decoder), ("engines.encoder", engines.encoder),
        ("engines.jpeg", engines.jpeg), ("engines.ofa", engines.ofa))}


def gfd_sanitised(text: str) -> str:
    """GFD's names in label values (k8s-device-plugin internal/lm/resource.go sanitise, used for the
    product and the machine): characters other than letters, digits, '-', '_', '.' and space removed,
    then the words joined by '-'."""
    return "-".join(re.sub(r"[^A-Za-z0-9\-_. ]", "", text).split())


def _invalid_single_labels(gpus: tuple[Gpu, ...]) -> dict[str, str]:
    """mig-strategy.go newInvalidMigStrategyLabeler over GFD's GPU labels, whose sharing strategy is
    none: MIG-enabled GPUs are labelled unshared. (Shared MIG-disabled GPUs beside them, where GFD
    would name the strategy, are not modelled.)"""
    model = Device(next(gpu for gpu in gpus if _mig_enabled(gpu))).product
    return {f"{GPU_RESOURCE}.product": f"{model}-MIG-INVALID", f"{GPU_RESOURCE}.count": "0",
            f"{GPU_RESOURCE}.replicas": "0", f"{GPU_RESOURCE}.memory": "0",
            f"{GPU_RESOURCE}.sharing-strategy": "none"}


def _flag(value: bool) -> str:
    return "true" if value else "false"
