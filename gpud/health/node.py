"""Node-level health: what is wrong with the host rather than one GPU.

- Driver mismatch: the kernel module (<procfs>/driver/nvidia/version) of another version than the
  user-space NVML library, the state an unfinished driver upgrade leaves (every NVML client then fails
  with "Driver/library version mismatch", NVML_ERROR_LIB_RM_VERSION_MISMATCH).
- Fabric Manager: on a node with NVSwitches of its own (HGX/DGX A100, H100, B200), the
  nvidia-fabricmanager service must run, or the GPUs' fabric is never trained and CUDA fails.

Each check returns a Problem as gpud.health.checks does: (severity, action, message), or None.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from gpud.base import child
from gpud.base.hostfile import PROC_MAPS_BYTES, read_host_text
from gpud.base.logs import get_logger

log = get_logger("health")
Problem = tuple[str, str, str] | None

# "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)"
# (tests/fixtures/hardware/h200-580.159.04/capture.log); the proprietary module says "NVIDIA UNIX x86_64
# Kernel Module  535.183.01  Sun May 12 ...": the version is the first N.N[.N] after the module's name.
_MODULE_VERSION = re.compile(r"^NVRM version: .*?\s(\d{3,4}\.\d{1,3}(?:\.\d{1,3})?)\s", re.MULTILINE)
# The NVML library as the dynamic linker mapped it: libnvidia-ml.so.580.159.04 (the driver installs the
# versioned file; libnvidia-ml.so.1 links to it).
_LIBRARY_VERSION = re.compile(r"/libnvidia-ml\.so\.(\d{3,4}\.\d{1,3}(?:\.\d{1,3})?)$")
SYSTEMCTL_TIMEOUT_S = 5.0
SYSTEMCTL_OUTPUT_CAP = 65536  # four properties, a line each


def module_version(procfs: Path) -> str | None:
    """The loaded kernel module's version; None when no module is loaded (no file), the file cannot be
    read, or it says no version gpud can recognise."""
    try:
        text = read_host_text(procfs / "driver" / "nvidia" / "version", errors="replace")
    except OSError:
        return None
    match = _MODULE_VERSION.search(text[:4096])
    return match.group(1) if match else None


def library_version(nvml: Any, maps: Path = Path("/proc/self/maps")) -> str | None:
    """The user-space NVML library's version: the simulator's own, or the versioned file name of the
    libnvidia-ml this process mapped (pynvml loads it before nvmlInit, so even a failed init has it).
    Always this process's own maps, never host.procfs: the library is gpud's."""
    if hasattr(nvml, "sim_library_version"):
        return nvml.sim_library_version()
    try:
        lines = read_host_text(maps, PROC_MAPS_BYTES, errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        match = _LIBRARY_VERSION.search(line.strip())
        if match:
            return match.group(1)
    return None


def driver_mismatch(module: str | None, library: str | None) -> Problem:
    if module is None or library is None or module == library:
        return None
    return ("unhealthy", "reboot",
            f"the NVIDIA kernel module is {module} but the user-space driver (NVML library) is {library}: a driver "
            "upgrade is unfinished and every NVML client fails with 'Driver/library version mismatch'. Reboot "
            "to load the new module (or stop every GPU client, rmmod the nvidia modules and load them again)")


def local_nvswitches(procfs: Path) -> int:
    """NVSwitches the nvidia-nvswitch module found on this node (<procfs>/driver/nvidia-nvswitch/devices
    has one entry each); 0 without the module (PCIe nodes, GB200 compute trays: their switches are
    in the NVLink switch trays, whose Fabric Manager is not this node's)."""
    try:
        return sum(1 for _ in (procfs / "driver" / "nvidia-nvswitch" / "devices").iterdir())
    except OSError:
        return 0


def fabric_manager_unit(unit: str) -> dict[str, str] | None:
    """systemd's LoadState, ActiveState, SubState and Result of the unit; None where systemctl is
    missing or does not answer (no systemd: gpud in a container)."""
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return None
    try:
        result = child.run_sync([systemctl, "show", "--property=LoadState,ActiveState,SubState,Result", "--", unit],
                                timeout_s=SYSTEMCTL_TIMEOUT_S, output_cap=SYSTEMCTL_OUTPUT_CAP)
    except OSError as exc:
        log.warning("systemctl_failed", unit=unit, error=str(exc))
        return None
    failure = result.failure(SYSTEMCTL_TIMEOUT_S, SYSTEMCTL_OUTPUT_CAP)
    if failure:
        log.warning("systemctl_failed", unit=unit, error=failure)
        return None
    if result.exit_code != 0:
        return None
    text = result.stdout.decode(errors="replace")
    properties = dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)
    return properties if "ActiveState" in properties else None


def fabric_manager_problem(unit: str, properties: dict[str, str] | None) -> Problem:
    """What the unit's state means on a node whose NVSwitches it must train."""
    if properties is None:
        return None  # nothing to say without systemd; the GPUs' fabric state still says whether it trained
    fix = f"systemctl enable --now {unit}; journalctl -u {unit} says why it stopped"
    if properties.get("LoadState") == "not-found":
        return ("unhealthy", "fix-service",
                f"{unit} is not installed on a node with NVSwitches: install the Fabric Manager package of the "
                "driver's branch and version (nvidia-fabricmanager-<branch>), then systemctl enable --now it")
    active = properties.get("ActiveState")
    if active == "active":
        return None
    state = f"{active}/{properties.get('SubState', '?')}"
    result = properties.get("Result")
    why = f", result {result}" if result and result != "success" else ""
    return ("unhealthy", "fix-service", f"{unit} is {state}{why}: without it the NVSwitch fabric is not trained "
                                        f"and CUDA fails on every GPU; {fix}")
