"""The node's own health checks on host files: the driver's versions (kernel module against the NVML
library), the NVSwitches the nvidia-nvswitch driver lists, and what Fabric Manager's unit state means.
The version files are real captures; bad input gives nothing, never a false alarm."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpud.health.node import (driver_mismatch, fabric_manager_problem, library_version, local_nvswitches,
                              module_version)

HARDWARE = Path(__file__).resolve().parent / "fixtures" / "hardware"
# tests/fixtures/hardware/h200-580.159.04/capture.log, lines 8-9: `cat /proc/driver/nvidia/version` on the
# H200 (open kernel module).
OPEN_MODULE = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  \n"
               "GCC version:  gcc version 15.3.0 (GCC) \n")
# The proprietary module's first line, as NVIDIA's driver README shows /proc/driver/nvidia/version.
PROPRIETARY_MODULE = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n"
                      "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14) \n")


def procfs_with(tmp_path: Path, version_text: bytes | str | None) -> Path:
    procfs = tmp_path / "proc"
    (procfs / "driver" / "nvidia").mkdir(parents=True)
    if version_text is not None:
        path = procfs / "driver" / "nvidia" / "version"
        path.write_bytes(version_text if isinstance(version_text, bytes) else version_text.encode())
    return procfs


def test_the_real_capture_gives_the_modules_version(tmp_path):
    assert "NVRM version" in (HARDWARE / "h200-580.159.04" / "capture.log").read_text()  # the source is there
    assert module_version(procfs_with(tmp_path, OPEN_MODULE)) == "580.159.04"


def test_the_proprietary_modules_line_gives_its_version(tmp_path):
    assert module_version(procfs_with(tmp_path, PROPRIETARY_MODULE)) == "535.183.01"


@pytest.mark.parametrize("text", [None, "", "garbage\n", b"\xff\xfe\x00NVRM version: \x00\n",
                                  "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  not-a-version  Release\n",
                                  "NVRM version: " + "9" * 100_000 + "\n"])
def test_no_file_or_garbage_gives_no_version(tmp_path, text):
    assert module_version(procfs_with(tmp_path, text)) is None


def test_a_directory_where_the_file_should_be_gives_no_version(tmp_path):
    procfs = procfs_with(tmp_path, None)
    (procfs / "driver" / "nvidia" / "version").mkdir()
    assert module_version(procfs) is None


def test_the_library_version_is_the_mapped_files(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f2c1c000000-7f2c1c200000 r-xp 00000000 08:01 1234  /usr/lib/x86_64-linux-gnu/libc.so.6\n"
                    "7f2c1d000000-7f2c1d400000 r-xp 00000000 08:01 5678  "
                    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.159.04\n")
    assert library_version(object(), maps) == "580.159.04"
    maps.write_text("7f2c1c000000-7f2c1c200000 r-xp 00000000 08:01 1234  /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert library_version(object(), maps) is None  # NVML not loaded (no driver)
    assert library_version(object(), tmp_path / "absent") is None


def test_a_mismatch_names_both_versions_and_what_to_do():
    severity, action, message = driver_mismatch("570.86.15", "580.65.06")
    assert (severity, action) == ("unhealthy", "reboot")
    assert "570.86.15" in message and "580.65.06" in message and "Reboot" in message
    assert driver_mismatch("580.65.06", "580.65.06") is None
    assert driver_mismatch(None, "580.65.06") is None and driver_mismatch("580.65.06", None) is None


def test_nvswitches_are_counted_from_the_drivers_listing(tmp_path):
    procfs = tmp_path / "proc"
    assert local_nvswitches(procfs) == 0  # no nvidia-nvswitch module: a PCIe node, a GB200 compute tray
    devices = procfs / "driver" / "nvidia-nvswitch" / "devices"
    for bus in ("0000:05:00.0", "0000:06:00.0"):
        (devices / bus).mkdir(parents=True)
        (devices / bus / "information").write_text("")
    assert local_nvswitches(procfs) == 2


@pytest.mark.parametrize("properties, wanted", [
    (None, None),  # no systemd: the GPUs' fabric state tells
    ({"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "Result": "success"}, None),
    ({"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead", "Result": "success"}, "not installed"),
    ({"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code"},
     "is failed/failed, result exit-code"),
    ({"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success"}, "is inactive/dead:"),
])
def test_what_fabric_managers_unit_state_means(properties, wanted):
    problem = fabric_manager_problem("nvidia-fabricmanager.service", properties)
    if wanted is None:
        assert problem is None
    else:
        assert problem[:2] == ("unhealthy", "fix-service") and wanted in problem[2]
