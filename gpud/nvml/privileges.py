"""What NVIDIA's drivers let only root do, among what gpud does: a real driver refuses it to any other
user with NVML_ERROR_NO_PERMISSION ("Insufficient Permissions"), as the simulated node does."""

from __future__ import annotations

import os

# change -> (what gpud does that needs it, the source that says root alone may)
ROOT_ONLY = {
    "mig": ("MIG changes (gpud mig apply: MIG mode, GPU and compute instances)",
            'nvml.h, nvmlDeviceSetMigMode: "Requires root user"; nvidia-smi(1), -mig: "Requires root"'),
    "reset": ("GPU resets (gpud gpus reset, and an Ampere GPU\'s MIG mode change)",
              'nvidia-smi(1), -r/--gpu-reset: "Requires root"'),
    "mps": ("MPS (gpud sets the compute mode of an MPS GPU to EXCLUSIVE_PROCESS)",
            'nvidia-smi(1), -c/--compute-mode: "Requires root"'),
}


def running_as_root() -> bool:
    return os.geteuid() == 0


def not_root_because(change: str) -> str:
    """Why the change will be refused to this process: its uid and the source."""
    what, source = ROOT_ONLY[change]
    return f"gpud runs as uid {os.geteuid()}, not root, and NVIDIA's driver lets only root make {what} ({source})"
