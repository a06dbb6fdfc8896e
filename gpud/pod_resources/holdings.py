"""Which GPU or MIG device each container holds, from the kubelet's List answer, mapped as dcgm-exporter
maps it (NVIDIA/dcgm-exporter d5e5f510a1b6, internal/pkg/transformation/kubernetes.go, dra.go): the one
mapping both the Kubernetes labels of /metrics (gpud.pod_resources.labels) and GET /v1/gpus/{id}/pods use.

- Device plugin resources: `nvidia.com/gpu`, any `nvidia.com/mig-*` (iterateGPUDevices, appconfig
  NvidiaResourceName, NvidiaMigResourcePrefix) and, in the place of the exporter's --nvidia-resource-names,
  the resources gpud's own device plugin serves (renamed, shared and gpu-memory ones). Other resources are
  not GPUs.
- A device ID `<id>::<n>` (a shared replica; gpud's gpu-memory units too) stands for `<id>`
  (toDeviceToSharingPods: the part before "::"; stripVGPUSuffix for MIG IDs); a MIG UUID stands for its
  MIG device on its GPU (GetMIGDeviceInfoByID); any other ID is a GPU UUID.
- A DRA device (toDeviceToPodsDRA): a claim resource of the container's dynamic resources. The exporter
  finds the device's UUID in the driver's ResourceSlices; gpud in its own claims ledger (the claim's
  devices, as gpud's DRA plugin holds them) and the names the plugin publishes them by
  (gpud/dra/devices.py: gpu_device_name, mig_device_name). A claim gpud's ledger does not hold is not
  gpud's DRA plugin's: no GPU of gpud's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gpud.claims import Hold
from gpud.dra.devices import gpu_device_name, mig_device_name
from gpud.model.inventory import Gpu, Inventory, MigDevice
from gpud.pod_resources.messages import ClaimResource, DynamicResource, Pod
from gpud.sharing.resources import GPU_RESOURCE, MIG_RESOURCE_PREFIX

SHARED_ID_SEPARATOR = "::"


@dataclass(frozen=True)
class Holding:
    """One device a container holds, placed on its GPU: a device plugin's ID, or a DRA claim's device."""

    pod: Pod
    container: str
    gpu: Gpu
    mig: MigDevice | None  # the MIG device held, None for the whole GPU
    device_id: str | None = None  # the device plugin's ID as allocated ("<uuid>", "<uuid>::<n>")
    claim: DynamicResource | None = None  # the DRA claim, and its device, when held through one
    resource: ClaimResource | None = None


def holdings(pods: Iterable[Pod], inventory: Inventory, holds: Iterable[Hold],
             own_resources: frozenset[str]) -> Iterator[Holding]:
    """Every device of a GPU of the inventory a container of the answer holds, in the answer's order."""
    devices = _devices(inventory)
    claims = {(hold.namespace, hold.name): hold for hold in holds}
    for pod in pods:
        for container in pod.containers:
            for allocated in container.devices:
                if allocated.resource == GPU_RESOURCE or allocated.resource.startswith(MIG_RESOURCE_PREFIX) \
                        or allocated.resource in own_resources:
                    for device_id in allocated.ids:
                        device = devices.get(device_id.partition(SHARED_ID_SEPARATOR)[0])
                        if device is not None:
                            yield Holding(pod, container.name, *device, device_id=device_id)
            for dynamic in container.dynamic:
                hold = claims.get((dynamic.claim_namespace, dynamic.claim_name))
                if hold is None:  # not a claim of gpud's DRA plugin
                    continue
                names = _published_names(hold, inventory)
                for resource in dynamic.resources:
                    device = names.get(resource.device) if resource.driver == hold.driver else None
                    if device is not None:
                        yield Holding(pod, container.name, *device, claim=dynamic, resource=resource)


def pods_holding(gpu: Gpu, found: Iterable[Holding]) -> list[dict]:
    """The pods holding the GPU or any of its MIG devices, by (namespace, name): their containers, the
    device plugin's IDs and the DRA claims (namespace/name) they hold it by."""
    pods: dict[tuple[str, str], dict[str, set[str]]] = {}
    for holding in found:
        if holding.gpu.uuid != gpu.uuid:
            continue
        pod = pods.setdefault((holding.pod.namespace, holding.pod.name),
                              {"containers": set(), "devices": set(), "claims": set()})
        pod["containers"].add(holding.container)
        if holding.device_id is not None:
            pod["devices"].add(holding.device_id)
        if holding.claim is not None:
            pod["claims"].add(f"{holding.claim.claim_namespace}/{holding.claim.claim_name}")
    return [{"namespace": namespace, "name": name, **{key: sorted(values) for key, values in held.items()}}
            for (namespace, name), held in sorted(pods.items())]


def _devices(inventory: Inventory) -> dict[str, tuple[Gpu, MigDevice | None]]:
    """GPU and MIG device UUID -> the device, on its GPU."""
    devices: dict[str, tuple[Gpu, MigDevice | None]] = {}
    for gpu in inventory.gpus:
        devices[gpu.uuid] = (gpu, None)
        for mig in gpu.mig.devices:
            devices[mig.uuid] = (gpu, mig)
    return devices


def _published_names(hold: Hold, inventory: Inventory) -> dict[str, tuple[Gpu, MigDevice | None]]:
    """The claim's devices by the names gpud's DRA plugin publishes them under."""
    names: dict[str, tuple[Gpu, MigDevice | None]] = {}
    for gpu in inventory.gpus:
        if gpu.minor_number is None:  # the plugin publishes no device of it
            continue
        if gpu.uuid in hold.devices:
            names[gpu_device_name(gpu.minor_number)] = (gpu, None)
        for mig in gpu.mig.devices:
            if mig.uuid in hold.devices:
                name = mig_device_name(gpu.minor_number, mig.profile, mig.gi_profile_id, mig.placement.start)
                names[name] = (gpu, mig)
    return names
