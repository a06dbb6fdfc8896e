"""mig-parted's own verdict on a layouts file, through NVIDIA's nvidia-mig-parted
(../shared/nvidia-mig-parted, built unchanged from NVIDIA/mig-parted; its README names the command):
`nvidia-mig-parted assert --valid-config -f FILE -c LAYOUT` exits 0 when the file parses and has
LAYOUT, as mig-manager would load it, and needs no GPU."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from tests.helpers import SHARED, need

NVIDIA_MIG_PARTED = SHARED / "nvidia-mig-parted" / "bin" / "nvidia-mig-parted"


def mig_parted_verdict(text: str, layout: str) -> tuple[bool, str]:
    """(whether mig-parted loads the file and finds `layout` in it, what it printed)."""
    need(NVIDIA_MIG_PARTED.exists(), f"{NVIDIA_MIG_PARTED} is absent: no mig-parted to judge the file")
    with tempfile.TemporaryDirectory(prefix="gpud-mig-parted-verdict-") as directory:
        path = Path(directory) / "config.yaml"
        path.write_text(text)
        result = subprocess.run([NVIDIA_MIG_PARTED, "assert", "--valid-config", "-f", str(path), "-c", layout],
                                capture_output=True, text=True, timeout=60)
    return result.returncode == 0, result.stdout + result.stderr
