"""/proc/driver/nvidia-caps/mig-minors as the NVIDIA kernel driver writes it, for a simulated node.

The table is fixed when the driver loads, whatever the MIG layout: NVIDIA/open-gpu-kernel-modules
kernel-open/nvidia/nv-caps.c numbers its capability tables in order, fabric-mgmt (0) first, then
mig/config (1) and mig/monitor (2), then for gpu0..gpu31 (the GPU's minor number, as
nvidia-container-toolkit internal/nvcaps reads it) gi0..gi14, each GI's access entry followed by
ci0..ci7. Our H100 capture (tests/fixtures/hardware/h100-sxm5-580.159.04/capture.log) shows the
same first lines: "config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4", ...
"gpu0/gi1/access 12".
"""

from __future__ import annotations

import os
from pathlib import Path

GPUS = 32  # NV_CAP_MIG_GI_ENTRIES rows in g_nv_cap_mig_gpu_table
GPU_INSTANCES = 15  # gi0..gi14 per GPU
COMPUTE_INSTANCES = 8  # ci0..ci7 per GI
FIRST_GPU_MINOR = 3  # after fabric-mgmt 0, config 1, monitor 2


def mig_minors_text() -> str:
    lines = ["config 1", "monitor 2"]
    minor = FIRST_GPU_MINOR
    for gpu in range(GPUS):
        for gi in range(GPU_INSTANCES):
            lines.append(f"gpu{gpu}/gi{gi}/access {minor}")
            minor += 1
            for ci in range(COMPUTE_INSTANCES):
                lines.append(f"gpu{gpu}/gi{gi}/ci{ci}/access {minor}")
                minor += 1
    return "\n".join(lines) + "\n"


def write_mig_minors(path: Path) -> None:
    """Writes the driver's table where a simulated node's readers look for it (whole: by a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(mig_minors_text())
    os.replace(temporary, path)
