"""The labels gpud gives Node Feature Discovery, and the feature file that carries them.

The file format is NFD's local source (kubernetes-sigs/node-feature-discovery source/local/local.go,
docs/usage/customization-guide.md "Local feature source"): one `name[=value]` per line, lines starting
with `#` are comments, a file larger than 65536 bytes is ignored whole. Names carry their namespace
(`nvidia.com/...`): NFD prefixes bare names with `feature.node.kubernetes.io/`, which gpud never wants.
A `# +expiry-time=<RFC 3339>` directive makes NFD drop the lines after it once that time has passed
(local.go parseDirectives, parseFeatureFile): gpud puts one before every label, so a gpud that stops
keeping the file current stops labelling the node.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from gpud.base.hostfile import read_host_file, read_host_text
from gpud.model.inventory import Gpu, Inventory, sysfs_pci_device
from gpud.nvml.vgpu import VgpuReading
from gpud.sharing.resources import gfd_sanitised

# source/local/local.go MaxFeatureFileSize: nfd-worker skips (and logs) a larger file entirely.
NFD_MAX_FILE_BYTES = 65536
HEADER = ("# Node Feature Discovery labels written by gpud: rewritten on every change, do not edit.\n"
          "# What gpud wrote and what it left out: gpud nfd, GET /v1/nfd.\n")
MIG_CONFIG = "nvidia.com/mig.config"
MIG_CONFIG_STATE = "nvidia.com/mig.config.state"
GPU_HEALTH = "nvidia.com/gpu.health"
GPU_HEALTHY = "nvidia.com/gpu.healthy"
# Kept first when the file would exceed NFD's limit: what only gpud knows of the node.
OWN_LABELS = (MIG_CONFIG, MIG_CONFIG_STATE, GPU_HEALTH, GPU_HEALTHY)
# The MIG reconciler's end states -> the values NVIDIA's mig-manager gives nvidia.com/mig.config.state
# (NVIDIA/mig-parted pkg/mig/reconfigure/reconfigure.go: pending, success, failed; `rebooting` has no gpud
# equivalent); any other state (pending, applying) is `pending`. reset-required is a mode change that
# did not take effect without a reset, which mig-manager reports as failed when it may not reboot.
MIG_END_STATE_LABEL = {"success": "success", "failed": "failed", "reset-required": "failed"}

# Kubernetes label syntax (kubernetes.io/docs/concepts/overview/working-with-objects/labels/
# "Syntax and character set"): an optional DNS-subdomain prefix of at most 253 characters, a name of
# at most 63, a value of at most 63 (may be empty). nfd-master refuses labels that break it.
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


# What GPU feature discovery labels from the driver and the host (NVIDIA/k8s-device-plugin internal/lm:
# nvml.go newVersionLabeler, machine-type.go, resource.go newArchitectureLabels); the per-resource
# labels (count, product, memory, MIG attributes) come with the sharing document.
GPU_MACHINE = "nvidia.com/gpu.machine"
MACHINE_UNKNOWN = "unknown"  # machine-type.go: what GFD labels when the DMI product name is unreadable
GPU_MODE = "nvidia.com/gpu.mode"
GPU_MODE_UNKNOWN = "unknown"
# go-nvlib pkg/nvpci: PCIVgaControllerClass, PCI3dControllerClass
_MODE_OF_PCI_CLASS = {0x030000: "graphics", 0x030200: "compute"}
# GFD's vGPU labels (internal/lm/vgpu.go), from the GPUs' PCI config space (gpud/nvml/vgpu.py)
VGPU_PRESENT = "nvidia.com/vgpu.present"
VGPU_HOST_DRIVER_VERSION = "nvidia.com/vgpu.host-driver-version"
VGPU_HOST_DRIVER_BRANCH = "nvidia.com/vgpu.host-driver-branch"


class Dropped(NamedTuple):
    """A label gpud computed but left out of the file, and why."""

    label: str
    value: str
    reason: str


def node_labels(inventory: Inventory, sysfs: Path, machine: str, sharing: dict | None, mig: dict,
                health: dict, vgpu: VgpuReading | None = None) -> dict[str, str]:
    """The node's labels: GPU feature discovery's (those of the driver, the machine and the GPUs'
    architecture, the sharing document's per resource, and the vGPU reading's), the MIG layout and its
    state (as mig-manager labels them), the node's health and its count of healthy GPUs."""
    mode = gpu_mode(sysfs, tuple(gpu.pci_bus_id for gpu in inventory.gpus if not gpu.lost))
    labels = gfd_node_labels(inventory, machine, mode) | (dict(sharing["labels"]) if sharing else {})
    labels |= vgpu_labels(vgpu) if vgpu else {}
    if mig["layout"]:  # no layout chosen: no MIG config to report
        labels[MIG_CONFIG] = mig["layout"]
        labels[MIG_CONFIG_STATE] = MIG_END_STATE_LABEL.get(mig["state"], "pending")
    labels[GPU_HEALTH] = _gpu_health(health)
    labels[GPU_HEALTHY] = str(sum(_gpu_healthy(gpu) for gpu in health["gpus"]))
    return labels


def machine_type(sysfs: Path) -> str:
    """The value GFD gives nvidia.com/gpu.machine: the DMI product name (machine-type.go reads
    /sys/class/dmi/id/product_name), trimmed and sanitised as GFD sanitises names, or "unknown"."""
    try:
        name = read_host_file(sysfs / "class" / "dmi" / "id" / "product_name").decode("utf-8", "replace")
    except OSError:  # no DMI (some VMs, ARM boards): GFD labels it unknown too
        return MACHINE_UNKNOWN
    return gfd_sanitised(name)


def gpu_mode(sysfs: Path, pci_bus_ids: tuple[str, ...]) -> str:
    """GFD's nvidia.com/gpu.mode (nvml.go newGPUModeLabeler): the GPUs' PCI class, read from
    <sysfs>/bus/pci/devices/<address>/class as go-nvlib's nvpci reads it: `graphics` for a VGA
    controller, `compute` for a 3D controller; `unknown` for another class, GPUs of different
    classes, or one that cannot be read."""
    classes = set()
    for bus_id in pci_bus_ids:
        device = sysfs_pci_device(sysfs, bus_id)
        if device is None:
            return GPU_MODE_UNKNOWN
        try:
            classes.add(int(read_host_text(device / "class").strip(), 0))
        except (OSError, ValueError):
            return GPU_MODE_UNKNOWN
    if len(classes) != 1:
        return GPU_MODE_UNKNOWN
    return _MODE_OF_PCI_CLASS.get(classes.pop(), GPU_MODE_UNKNOWN)


def vgpu_labels(reading: VgpuReading) -> dict[str, str]:
    """GFD's vgpu labeler (internal/lm/vgpu.go): none when the PCI devices could not be read,
    `vgpu.present` true or false otherwise, and a vGPU's host driver version and branch when there is one;
    whatever GPUs NVML lists (the labeler reads PCI devices only)."""
    if reading.present is None:
        return {}
    labels = {VGPU_PRESENT: "true" if reading.present else "false"}
    if reading.host_driver is not None:
        labels |= {VGPU_HOST_DRIVER_VERSION: reading.host_driver.version,
                   VGPU_HOST_DRIVER_BRANCH: reading.host_driver.branch}
    return labels


def gfd_node_labels(inventory: Inventory, machine: str, mode: str) -> dict[str, str]:
    """GFD's labels of the driver, the CUDA version, the machine, the GPUs' mode and their architecture.
    GFD writes none on a node without GPUs (nvml.go NewNVMLLabeler), and describes one GPU's
    architecture: gpud describes the first it can read. machine, mode: machine_type's and gpu_mode's
    answers."""
    described = next((gpu for gpu in inventory.gpus if not gpu.lost and not gpu.error), None)
    if described is None:
        return {}
    return {GPU_MACHINE: machine, GPU_MODE: mode, **_driver_labels(inventory.driver_version),
            **_cuda_labels(inventory.cuda_version), **_architecture_labels(described)}


def _driver_labels(version: str) -> dict[str, str]:
    """nvml.go newVersionLabeler: the driver version is X.Y[.Z]; the revision is empty without Z."""
    parts = version.split(".")
    if not 2 <= len(parts) <= 3:
        return {}  # GFD fails to start on such a driver version: nothing to match
    major, minor, revision = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
    return {"nvidia.com/cuda.driver.major": major, "nvidia.com/cuda.driver.minor": minor,
            "nvidia.com/cuda.driver.rev": revision,
            "nvidia.com/cuda.driver-version.major": major, "nvidia.com/cuda.driver-version.minor": minor,
            "nvidia.com/cuda.driver-version.revision": revision, "nvidia.com/cuda.driver-version.full": version}


def _cuda_labels(version: str) -> dict[str, str]:
    """The CUDA version the driver supports (nvmlSystemGetCudaDriverVersion, "major.minor" in the inventory)."""
    major, dot, minor = version.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        return {}
    return {"nvidia.com/cuda.runtime.major": major, "nvidia.com/cuda.runtime.minor": minor,
            "nvidia.com/cuda.runtime-version.major": major, "nvidia.com/cuda.runtime-version.minor": minor,
            "nvidia.com/cuda.runtime-version.full": version}


def _architecture_labels(gpu: Gpu) -> dict[str, str]:
    """resource.go newArchitectureLabels: the family from the compute capability, none when it is 0."""
    major, dot, minor = gpu.cuda_compute_capability.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()) or int(major) == 0:
        return {}
    return {"nvidia.com/gpu.family": _architecture_family(int(major), int(minor)),
            "nvidia.com/gpu.compute.major": str(int(major)), "nvidia.com/gpu.compute.minor": str(int(minor))}


def _architecture_family(major: int, minor: int) -> str:
    """resource.go getArchFamily, as GFD names them."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper",
            10: "blackwell", 12: "blackwell"}.get(major, "undefined")


def _gpu_health(health: dict) -> str:
    """The GPUs' health with the node's own reasons (a driver mismatch, Fabric Manager down: they break
    every GPU), not the InfiniBand ports': a port down is the network's, and GPU jobs that need no RDMA
    still run."""
    states = [entry["state"] for gpu in health["gpus"] for entry in (gpu, *gpu["mig_devices"])]
    states.append((health.get("node") or {}).get("state", "healthy"))
    worst = max(states, key=("healthy", "degraded", "unhealthy").index)
    return "unknown" if worst == "healthy" and health["status"] == "unknown" else worst


def _gpu_healthy(gpu: dict) -> bool:
    """A GPU counts as healthy when it and every one of its MIG devices is."""
    return all(entry["state"] == "healthy" for entry in (gpu, *gpu["mig_devices"]))


def label_problem(name: str, value: str) -> str | None:
    """Why Kubernetes (so nfd-master) would refuse the label, or None."""
    prefix, slash, short = name.rpartition("/")
    if not slash:
        return "no namespace: NFD would put it under feature.node.kubernetes.io/"
    if len(prefix) > 253 or not all(_DNS_LABEL.fullmatch(part) for part in prefix.split(".")):
        return f"the prefix {prefix!r} is not a DNS subdomain"
    if not _NAME.fullmatch(short):
        return f"the name {short!r} is not 1-63 letters, digits, '-', '_' or '.' between letters or digits"
    if not _VALUE.fullmatch(value):
        return f"the value {value!r} is not up to 63 letters, digits, '-', '_' or '.' between letters or digits"
    return None


def expiry_directive(expires_at: float) -> str:
    """NFD's expiry line for a Unix time: RFC 3339 in UTC, whole seconds (local.go parses time.RFC3339)."""
    moment = datetime.fromtimestamp(int(expires_at), timezone.utc)
    return f"# +expiry-time={moment.strftime('%Y-%m-%dT%H:%M:%SZ')}\n"


def feature_file(labels: dict[str, str], expires_at: float) -> tuple[str, list[Dropped]]:
    """The file's text, every label in it expiring at expires_at (Unix time), and the labels left out of
    it: those Kubernetes would refuse, and, when the file would exceed NFD's limit, every label after
    the last that fits (gpud's own labels come first)."""
    dropped = [Dropped(name, value, problem) for name, value in labels.items()
               if (problem := label_problem(name, value))]
    refused = {entry.label for entry in dropped}
    ordered = [name for name in OWN_LABELS if name in labels] + sorted(set(labels) - set(OWN_LABELS))
    text = HEADER + expiry_directive(expires_at)
    size, full = len(text.encode()), False
    for name in (name for name in ordered if name not in refused):
        line = f"{name}={labels[name]}\n"
        full = full or size + len(line.encode()) > NFD_MAX_FILE_BYTES  # a cut, not a gap: later labels go too
        if full:
            dropped.append(Dropped(name, labels[name], f"over NFD's feature file limit of {NFD_MAX_FILE_BYTES} bytes"))
        else:
            text += line
            size += len(line.encode())
    return text, dropped
