"""What NVIDIA's drivers let only root do, among what gpud does: a real driver refuses it to any other
user with NVML_ERROR_NO_PERMISSION ("Insufficient Permissions"), as the simulated node does."""

from __future__ import annotations

import os

from gpud.base.errors import ErrorKind, GpudError

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


def refuse_unless_root(change: str, consequence: str) -> None:
    """Refuses, before it is tried, a change the driver would refuse this process with Insufficient
    Permissions: 501 needs-root (this gpud was not set up to make it), the sentence ending in what to do."""
    if not running_as_root():
        raise GpudError(ErrorKind.UNSUPPORTED, "needs-root",
                        f"{not_root_because(change)}: {consequence}; run gpud as root", uid=os.geteuid())
