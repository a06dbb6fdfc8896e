"""The device nodes of a simulated node, under a dev root of its own (<root>/dev/...), made without root.

The NVIDIA driver's nodes: /dev/nvidia<minor> for each GPU (the minor nvmlDeviceGetMinorNumber answers;
the simulator answers the GPU's index) and the control nodes nvidiactl, nvidia-modeset, nvidia-uvm and
nvidia-uvm-tools (the set `nvidia-ctk system create-device-nodes --control-devices` makes, as
nvidia-modprobe does when the modules load); with MIG, /dev/nvidia-caps/nvidia-cap<minor> for
mig/config, mig/monitor and each GPU's GI and CI access capabilities, numbered by the driver's
mig-minors table (mig_minors.py), made here for every entry of the node's GPUs as `nvidia-modprobe -f`
makes one per capability (NVIDIA MIG user guide, "Device Nodes and Capabilities").

Real nodes are character devices of the driver's majors (195, the uvm and caps majors); making one
needs root (mknod). A symbolic link to /dev/null needs none and is a character device once resolved,
harmless to open: gpud resolves the links when it writes the CDI spec (hostPath /dev/null), since the
CDI library refuses a link as a hostPath."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .mig_minors import mig_minors_text
from .presets import parse_preset

STAND_IN = "/dev/null"
CONTROL_NODES = ("nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools")


def device_node_names(gpus: int) -> list[str]:
    """Paths under <root>/dev of the nodes of a node with GPUs of minor numbers 0 .. gpus-1."""
    names = [f"nvidia{minor}" for minor in range(gpus)] + list(CONTROL_NODES)
    for line in mig_minors_text().splitlines():  # "<capability> <minor>", every line
        capability, minor = line.split()
        gpu = capability.partition("/")[0]
        if not gpu.startswith("gpu") or int(gpu[3:]) < gpus:  # config, monitor, and the node's GPUs
            names.append(f"nvidia-caps/nvidia-cap{minor}")
    return names


def write_device_nodes(root: Path, preset: str) -> None:
    """Makes <root>/dev hold exactly the nodes of the preset's GPUs: a tree left by another preset
    is replaced."""
    dev = root / "dev"
    names = device_node_names(len(parse_preset(preset)))
    if dev.exists() and sorted(_links(dev)) != sorted(names):
        shutil.rmtree(dev)
    (dev / "nvidia-caps").mkdir(parents=True, exist_ok=True)
    for name in names:
        if not os.path.lexists(dev / name):
            os.symlink(STAND_IN, dev / name)


def _links(dev: Path) -> list[str]:
    return [str(path.relative_to(dev)) for path in dev.rglob("*") if path.is_symlink()]
