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
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GPU_TYPE, MIG_TYPE = "gpu", "mig"
PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"
# go-nvlib pkg/nvlib/device/device.go GetArchitectureAsString, by gpud's architecture names
ARCHITECTURES = {"kepler": "Kepler", "maxwell": "Maxwell", "pascal": "Pascal", "volta": "Volta",
                 "turing": "Turing", "ampere": "Ampere", "ada": "Ada Lovelace", "hopper": "Hopper",
                 "blackwell": "Blackwell"}
_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]")
_NOT_RFC1123 = re.compile(r"[^a-z0-9-.]")


@dataclass(frozen=True)
class DraDevice:
    """One device of the pool: what the slice says of it, and what Prepare needs to hand it out."""

    name: str
    type: str  # "gpu" | "mig"
    uuid: str  # the GPU's or the MIG device's own UUID
    gpu_uuid: str  # the GPU it is on (a MIG device's parent)
    gpu_index: int
    minor: int
    attributes: dict[str, dict[str, Any]] = field(default_factory=dict)
    capacity: dict[str, dict[str, str]] = field(default_factory=dict)

    def slice_entry(self, taints: list[dict] | None = None) -> dict:
        """The device as a ResourceSlice's spec.devices[] holds it."""
        entry: dict[str, Any] = {"name": self.name, "attributes": self.attributes, "capacity": self.capacity}
        if taints:
            entry["taints"] = taints
        return entry


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


def mig_device_name(parent_minor: int, profile: str, gi_profile_id: int, placement_start: int) -> str:
    """mig.go ToCanonicalName: dots dropped from the profile, then toRFC1123Compliant (lower case, other
    characters '-', trimmed): "1g.10gb+me" -> "1g10gb-me"."""
    name = _NOT_RFC1123.sub("-", profile.replace(".", "").lower()).strip("-").removesuffix(".")
    return f"gpu-{parent_minor}-mig-{name}-{gi_profile_id}-{placement_start}"


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


def _whole_gpu(gpu: dict, node: dict, sysfs: Path | None) -> DraDevice:
    attributes = {"type": _string(GPU_TYPE), "uuid": _string(gpu["uuid"]), **_common_attributes(gpu, node, sysfs)}
    return DraDevice(f"gpu-{gpu['minor_number']}", GPU_TYPE, gpu["uuid"], gpu["uuid"], int(gpu["index"]),
                     int(gpu["minor_number"]), attributes,
                     {"memory": {"value": binary_quantity(int(gpu["memory_total_mib"]) << 20)}})


def _mig(gpu: dict, mig: dict, node: dict, sysfs: Path | None) -> DraDevice:
    attributes = {"type": _string(MIG_TYPE), "parentUUID": _string(gpu["uuid"]), "profile": _string(mig["profile"]),
                  "uuid": _string(mig["uuid"]), **_common_attributes(gpu, node, sysfs)}
    engines = mig.get("engines") or {}
    capacity = {"multiprocessors": int(mig["sm_count"]), "copyEngines": engines.get("copy", 0),
                "decoders": engines.get("decoder", 0), "encoders": engines.get("encoder", 0),
                "jpegEngines": engines.get("jpeg", 0), "ofaEngines": engines.get("ofa", 0)}
    quantities = {name: {"value": str(int(value))} for name, value in capacity.items()}
    quantities["memory"] = {"value": binary_quantity(int(mig["memory_total_mib"]) << 20)}
    start, size = int(mig["placement"]["start"]), int(mig["placement"]["size"])
    for memory_slice in range(start, start + size):
        quantities[f"memorySlice{memory_slice}"] = {"value": "1"}
    name = mig_device_name(int(gpu["minor_number"]), mig["profile"], int(mig["gi_profile_id"]), start)
    return DraDevice(name, MIG_TYPE, mig["uuid"], gpu["uuid"], int(gpu["index"]), int(gpu["minor_number"]),
                     attributes, quantities)


def node_devices(gpus: dict, node: dict, sysfs: Path | None = None) -> tuple[list[DraDevice], list[dict]]:
    """The pool's devices from GET /v1/gpus and GET /v1/node answers, and those left out with why: a lost
    GPU (nothing to hand out; its slot stays unpublished until it comes back), a GPU without a minor
    number (no device node to name), a GPU in MIG mode without MIG devices. `sysfs`: where to resolve
    PCIe roots (None: not at all, as on a simulated node, whose bus ids are no devices of this host)."""
    devices, left_out = [], []
    for gpu in sorted(gpus["gpus"], key=lambda g: g["index"]):
        where = f"GPU {gpu['index']} ({gpu['uuid']})"
        if gpu.get("lost"):
            left_out.append({"device": where, "reason": "the GPU is lost"})
            continue
        if gpu.get("minor_number") is None:
            left_out.append({"device": where, "reason": "NVML gives no minor number (no /dev/nvidia<minor>)"})
            continue
        mig = gpu.get("mig") or {}
        if mig.get("mode") == "enabled":
            if not mig.get("devices"):
                left_out.append({"device": where, "reason": "MIG mode is on and the GPU has no MIG devices"})
            devices += [_mig(gpu, m, node, sysfs) for m in mig.get("devices") or []]
        else:
            devices.append(_whole_gpu(gpu, node, sysfs))
    return devices, left_out
