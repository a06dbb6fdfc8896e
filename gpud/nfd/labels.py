"""The labels gpud gives Node Feature Discovery, and the feature file that carries them.

The file format is NFD's local source (kubernetes-sigs/node-feature-discovery source/local/local.go,
docs/usage/customization-guide.md "Local feature source"): one `name[=value]` per line, lines starting
with `#` are comments, a file larger than 65536 bytes is ignored whole. Names carry their namespace
(`nvidia.com/...`): NFD prefixes bare names with `feature.node.kubernetes.io/`, which gpud never wants.
"""

from __future__ import annotations

import re
from typing import NamedTuple

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
# (/work/shared/reference/migparted.md §4.3: pending, success, failed; `rebooting` has no gpud
# equivalent); any other state (pending, applying) is `pending`. reset-required is a mode change that
# did not take effect without a reset, which mig-manager reports as failed when it may not reboot.
MIG_END_STATE_LABEL = {"success": "success", "failed": "failed", "reset-required": "failed"}

# Kubernetes label syntax (kubernetes.io/docs/concepts/overview/working-with-objects/labels/
# "Syntax and character set"): an optional DNS-subdomain prefix of at most 253 characters, a name of
# at most 63, a value of at most 63 (may be empty). nfd-master refuses labels that break it.
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


class Dropped(NamedTuple):
    """A label gpud computed but left out of the file, and why."""

    label: str
    value: str
    reason: str


def node_labels(sharing: dict | None, mig: dict, health: dict) -> dict[str, str]:
    """The node's labels: the sharing document's GPU feature discovery labels, the MIG layout and its
    state (as mig-manager labels them), the node's health and its count of healthy GPUs."""
    labels = dict(sharing["labels"]) if sharing else {}
    if mig["layout"]:  # no layout chosen: no MIG config to report
        labels[MIG_CONFIG] = mig["layout"]
        labels[MIG_CONFIG_STATE] = MIG_END_STATE_LABEL.get(mig["state"], "pending")
    labels[GPU_HEALTH] = health["status"]
    labels[GPU_HEALTHY] = str(sum(_gpu_healthy(gpu) for gpu in health["gpus"]))
    return labels


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


def feature_file(labels: dict[str, str]) -> tuple[str, list[Dropped]]:
    """The file's text and the labels left out of it: those Kubernetes would refuse, and, when the file
    would exceed NFD's limit, every label after the last that fits (gpud's own labels come first)."""
    dropped = [Dropped(name, value, problem) for name, value in labels.items()
               if (problem := label_problem(name, value))]
    refused = {entry.label for entry in dropped}
    ordered = [name for name in OWN_LABELS if name in labels] + sorted(set(labels) - set(OWN_LABELS))
    text, size, full = HEADER, len(HEADER.encode()), False
    for name in (name for name in ordered if name not in refused):
        line = f"{name}={labels[name]}\n"
        full = full or size + len(line.encode()) > NFD_MAX_FILE_BYTES  # a cut, not a gap: later labels go too
        if full:
            dropped.append(Dropped(name, labels[name], f"over NFD's feature file limit of {NFD_MAX_FILE_BYTES} bytes"))
        else:
            text += line
            size += len(line.encode())
    return text, dropped
