"""The Kubernetes labels of each GPU and MIG instance, from the kubelet's List answer, as dcgm-exporter
writes them (NVIDIA/dcgm-exporter d5e5f510a1b6, internal/pkg/transformation/kubernetes.go, const.go,
dra.go):

- Names: `pod`, `namespace`, `container` (const.go podAttribute, namespaceAttribute, containerAttribute);
  for a DRA claim also `dra_claim_name`, `dra_claim_namespace`, `dra_driver_name`, `dra_pool_name`,
  `dra_device_name`, and for a MIG device `dra_mig_profile`, `dra_mig_device_uuid`.
- Device plugin resources: `nvidia.com/gpu`, any `nvidia.com/mig-*` (iterateGPUDevices, appconfig
  NvidiaResourceName, NvidiaMigResourcePrefix) and, in the place of the exporter's --nvidia-resource-names,
  the resources gpud's own device plugin serves (renamed, shared and gpu-memory ones). Other resources are
  not GPUs.
- A device ID `<id>::<n>` (a shared replica; gpud's gpu-memory units too) stands for `<id>`
  (toDeviceToSharingPods: the part before "::"; stripVGPUSuffix for MIG IDs); a MIG UUID stands for its
  GPU instance, the series with the parent's `UUID` and the instance's `GPU_I_ID` (GetMIGDeviceInfoByID ->
  GetGPUInstanceIdentifier; collector/types.go GetIDOfType keys MIG series by GPU and instance); any
  other ID is a GPU UUID, its whole-GPU series.
- One label set per container holding the device (toDeviceToSharingPods, the exporter's
  --kubernetes-virtual-gpus mode: Process copies the series once per container); gpud writes one per
  container however many replicas or units it holds, with no `vgpu` label (the exporter writes a copy per
  replica ID, with `vgpu` its number).
- A DRA device (toDeviceToPodsDRA): a claim resource of the container's dynamic resources, one label set
  per container and device; a MIG device's labels go on its parent GPU's whole-GPU series
  (DRAResourceSliceManager.GetDeviceInfo keys it by parentUUID) and, as gpud has series per instance, on
  its instance's too. The exporter finds the device's UUID in the driver's ResourceSlices; gpud in its
  own claims ledger (the claim's devices, as gpud's DRA plugin holds them) and the names the plugin
  publishes them by (gpud/dra/devices.py: gpu_device_name, mig_device_name).
- A device no container holds gets no label at all (Process leaves its series as they are).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpud.claims import Hold
from gpud.dra.devices import gpu_device_name, mig_device_name
from gpud.model.inventory import Gpu, Inventory, MigDevice
from gpud.pod_resources.messages import Pod
from gpud.sharing.resources import GPU_RESOURCE, MIG_RESOURCE_PREFIX

# (GPU UUID, GPU_I_ID of a MIG instance's series or None for the whole GPU's) -> label sets, one per series
Key = tuple[str, "str | None"]
LabelSets = dict[Key, tuple[dict[str, str], ...]]
SHARED_ID_SEPARATOR = "::"


def device_labels(pods: Iterable[Pod], inventory: Inventory, holds: Iterable[Hold],
                  own_resources: frozenset[str]) -> LabelSets:
    keys = _device_keys(inventory)
    claims = {(hold.namespace, hold.name): hold for hold in holds}
    found: dict[Key, dict[tuple, dict[str, str]]] = {}

    def add(key: Key | None, labels: dict[str, str]) -> None:
        if key is not None:
            found.setdefault(key, {}).setdefault(tuple(labels.items()), labels)

    for pod in pods:
        for container in pod.containers:
            who = {"pod": pod.name, "namespace": pod.namespace, "container": container.name}
            for devices in container.devices:
                if devices.resource == GPU_RESOURCE or devices.resource.startswith(MIG_RESOURCE_PREFIX) \
                        or devices.resource in own_resources:
                    for device_id in devices.ids:
                        add(keys.get(device_id.partition(SHARED_ID_SEPARATOR)[0]), who)
            for dynamic in container.dynamic:
                hold = claims.get((dynamic.claim_namespace, dynamic.claim_name))
                if hold is None:  # not a claim of gpud's DRA plugin
                    continue
                names = _published_names(hold, inventory)
                for resource in dynamic.resources:
                    device = names.get(resource.device) if resource.driver == hold.driver else None
                    if device is None:
                        continue
                    gpu, mig = device
                    labels = {**who, "dra_claim_name": dynamic.claim_name,
                              "dra_claim_namespace": dynamic.claim_namespace, "dra_driver_name": resource.driver,
                              "dra_pool_name": resource.pool, "dra_device_name": resource.device}
                    if mig is not None:
                        labels |= {"dra_mig_profile": mig.profile, "dra_mig_device_uuid": mig.uuid}
                        add((gpu.uuid, str(mig.gi_id)), labels)
                    add((gpu.uuid, None), labels)
    return {key: tuple(sets.values()) for key, sets in found.items()}


def _device_keys(inventory: Inventory) -> dict[str, Key]:
    """GPU and MIG device UUID -> the key of its series."""
    keys: dict[str, Key] = {}
    for gpu in inventory.gpus:
        keys[gpu.uuid] = (gpu.uuid, None)
        for mig in gpu.mig.devices:
            keys[mig.uuid] = (gpu.uuid, str(mig.gi_id))
    return keys


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
                names[mig_device_name(gpu.minor_number, mig.profile, mig.gi_profile_id, mig.placement.start)] = (gpu, mig)
    return names
