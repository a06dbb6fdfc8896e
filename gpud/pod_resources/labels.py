"""The Kubernetes labels of each GPU and MIG instance, from the kubelet's List answer, as dcgm-exporter
writes them (NVIDIA/dcgm-exporter d5e5f510a1b6, internal/pkg/transformation/kubernetes.go, const.go,
dra.go):

- Names: `pod`, `namespace`, `container` (const.go podAttribute, namespaceAttribute, containerAttribute);
  for a DRA claim also `dra_claim_name`, `dra_claim_namespace`, `dra_driver_name`, `dra_pool_name`,
  `dra_device_name`, and for a MIG device `dra_mig_profile`, `dra_mig_device_uuid`.
- Which device each container holds: gpud.pod_resources.holdings (the exporter's mapping, cited there).
  A MIG device's labels go on its GPU instance's series, with the parent's `UUID` and the instance's
  `GPU_I_ID` (GetMIGDeviceInfoByID -> GetGPUInstanceIdentifier; collector/types.go GetIDOfType keys MIG
  series by GPU and instance); a GPU's on its whole-GPU series.
- One label set per container holding the device (toDeviceToSharingPods, the exporter's
  --kubernetes-virtual-gpus mode: Process copies the series once per container); gpud writes one per
  container however many replicas or units it holds, with no `vgpu` label (the exporter writes a copy per
  replica ID, with `vgpu` its number).
- A DRA device (toDeviceToPodsDRA): one label set per container and device; a MIG device's labels go on
  its parent GPU's whole-GPU series (DRAResourceSliceManager.GetDeviceInfo keys it by parentUUID) and, as
  gpud has series per instance, on its instance's too.
- A device no container holds gets no label at all (Process leaves its series as they are).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpud.pod_resources.holdings import Holding

# (GPU UUID, GPU_I_ID of a MIG instance's series or None for the whole GPU's) -> label sets, one per series
Key = tuple[str, "str | None"]
LabelSets = dict[Key, tuple[dict[str, str], ...]]


def device_labels(held: Iterable[Holding]) -> LabelSets:
    """The label sets of each series, from what the containers hold (gpud.pod_resources.holdings)."""
    found: dict[Key, dict[tuple, dict[str, str]]] = {}

    def add(key: Key, labels: dict[str, str]) -> None:
        found.setdefault(key, {}).setdefault(tuple(labels.items()), labels)

    for holding in held:
        gpu, mig = holding.gpu, holding.mig
        labels = {"pod": holding.pod.name, "namespace": holding.pod.namespace, "container": holding.container}
        if holding.claim is None:
            add((gpu.uuid, None if mig is None else str(mig.gi_id)), labels)
            continue
        resource = holding.resource
        labels |= {"dra_claim_name": holding.claim.claim_name, "dra_claim_namespace": holding.claim.claim_namespace,
                   "dra_driver_name": resource.driver, "dra_pool_name": resource.pool,
                   "dra_device_name": resource.device}
        if mig is not None:
            labels |= {"dra_mig_profile": mig.profile, "dra_mig_device_uuid": mig.uuid}
            add((gpu.uuid, str(mig.gi_id)), labels)
        add((gpu.uuid, None), labels)
    return {key: tuple(sets.values()) for key, sets in found.items()}
