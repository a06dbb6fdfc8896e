"""The NVIDIA driver branches gpud supports.

R535 is the oldest branch gpud runs on: it is the oldest production branch that has every NVML call
gpud makes (clock-event reasons, memory info v2, the v2 GPU-instance profile info), and the branch
whose MIG quirks (no profile table while MIG is off) gpud works around. Older drivers are refused
with a message that says what to install, not left to fail call by call.
"""

from __future__ import annotations

import re

MINIMUM_BRANCH = 535
_VERSION = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?")


def driver_branch(version: str) -> int | None:
    """535 for "535.183.01"; None when the text is not a driver version."""
    match = _VERSION.match(version)
    return int(match.group(1)) if match else None


def driver_problem(version: str) -> str | None:
    """Why gpud cannot work with this driver, or None when it can."""
    branch = driver_branch(version)
    if branch is None:
        return f"cannot tell the driver branch from the driver version {version!r}"
    if branch < MINIMUM_BRANCH:
        return (f"NVIDIA driver {version} is older than gpud's minimum branch R{MINIMUM_BRANCH}: "
                f"install driver {MINIMUM_BRANCH} or newer")
    return None
