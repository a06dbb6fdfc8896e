"""What the simulated node's kernel shows beside NVML: its log (/dev/kmsg records), and the procfs files
of the NVIDIA kernel modules and of the boot.

Each lives under a root of the simulator's own (the state file's name plus a suffix), so gpud reads them
through its configurable host paths as it reads /dev/kmsg and /proc on a real node.

* The kernel log: /dev/kmsg yields one record per read, "PRIORITY,SEQ,TIMESTAMP_US,FLAGS;MESSAGE"
  (linux Documentation/ABI/testing/dev-kmsg: the first field is syslog facility << 3 | level, so 3 is
  KERN_ERR of the kernel facility; SEQ a 64-bit sequence number; TIMESTAMP_US the monotonic clock in
  microseconds; flags "-" for a record that is not a continuation). The simulator keeps them in a
  regular file, one record a line. The ring buffer is bounded, so the file is too: past KMSG_MAX_BYTES
  only the last KMSG_KEEP_RECORDS stay (the oldest records are overwritten, as in the kernel).
* /proc/driver/nvidia/version: "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  <version>
  Release Build  (<builder>)  <date>" then "GCC version:  <gcc>" (the H200 capture,
  tests/fixtures/hardware/h200-580.159.04/capture.log: its Nix build prints no date).
* /proc/driver/nvidia-nvswitch: the NVSwitch driver's directory, with "permissions" and one directory
  per NVSwitch PCI device, devices/<dddd:bb:ss.f>/information holding "BIOS Version: ..."
  (open-gpu-kernel-modules kernel-open/nvidia/procfs_nvswitch.c, nvswitch_procfs_device_add).
* /proc/sys/kernel/random/boot_id: a random UUID made at each boot (random(4)).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from gpud.base.persist import write_text_atomic

KERN_ERR = 3  # facility kernel (0) << 3 | LOG_ERR (3)
KMSG_MAX_BYTES = 1 << 20
KMSG_KEEP_RECORDS = 4096
_SEQ = re.compile(rb"^\d+,(\d+),")

# /proc/driver/nvidia/version as the H200 capture shows it (580.159.04, open kernel module built by Nix).
VERSION_FILE = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  (nixbld@)  \n"
    "GCC version:  gcc version 15.3.0 (GCC) \n"
)
# procfs_nvswitch.c, nv_procfs_read_permissions: the device node mode nvidia-modprobe uses (0666).
NVSWITCH_PERMISSIONS = "DeviceFileMode: 438\n"
# procfs_nvswitch.c prints "N/A" when it has no BIOS version: no public capture shows a switch's.
NVSWITCH_INFORMATION = "BIOS Version: N/A\n"


def monotonic_us() -> int:
    return int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1_000_000)


def append_kmsg(path: Path, messages: list[str], priority: int = KERN_ERR) -> None:
    """Appends one record per message, numbered on from the file's last record (a restarted simulator
    goes on counting, as the kernel does until it reboots)."""
    if not messages:
        return
    seq = _last_seq(path) + 1
    now = monotonic_us()
    lines = "".join(f"{priority},{seq + offset},{now},-;{message}\n" for offset, message in enumerate(messages))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as log:
        log.write(lines)
    if path.stat().st_size > KMSG_MAX_BYTES:
        kept = path.read_bytes().splitlines(keepends=True)[-KMSG_KEEP_RECORDS:]
        write_text_atomic(path, b"".join(kept).decode("utf-8"), durable=False)


def _last_seq(path: Path) -> int:
    """The sequence number of the file's last record; -1 when it has none."""
    try:
        with open(path, "rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - 4096))
            tail = log.read().splitlines()
    except FileNotFoundError:
        return -1
    for line in reversed(tail):
        match = _SEQ.match(line)
        if match:
            return int(match.group(1))
    return -1


def xid_record(bus_id: str, xid: int, pid: int | None, name: str | None, text: str) -> str:
    """The line the driver logs for an Xid: "NVRM: Xid (PCI:0000:02:00): 79, pid=9962, name=python, GPU
    has fallen off the bus." (public kernel logs, e.g. Modal's GPU health guide
    https://modal.com/docs/guide/gpu-health: "NVRM: Xid (PCI:0000:c6:00): 79, pid=1101234,
    name=nvc:[driver], GPU has fallen off the bus."); without a process, pid='<unknown>',
    name=<unknown>. bus_id: "dddd:bb:dd" (domain 4 hex digits, bus, device; no function)."""
    who = f"pid={pid}, name={name or '<unknown>'}" if pid else "pid='<unknown>', name=<unknown>"
    return f"NVRM: Xid (PCI:{bus_id}): {xid}, {who}, {text}"


def write_if_changed(path: Path, text: str) -> None:
    """Writes only what differs. A user who may not write where root staged the node (gpud doctor as
    nobody on root's simulated node) leaves root's files as they are: a kernel's procfs is not theirs."""
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text, durable=False)
    except PermissionError:
        return


def write_procfs(root: Path, module_version: str, boot_id: str, nvswitch_bus_ids: list[str]) -> None:
    write_if_changed(root / "driver" / "nvidia" / "version", VERSION_FILE.format(version=module_version))
    write_if_changed(root / "sys" / "kernel" / "random" / "boot_id", boot_id + "\n")
    if nvswitch_bus_ids:
        nvswitch = root / "driver" / "nvidia-nvswitch"
        write_if_changed(nvswitch / "permissions", NVSWITCH_PERMISSIONS)
        for bus_id in nvswitch_bus_ids:
            write_if_changed(nvswitch / "devices" / bus_id / "information", NVSWITCH_INFORMATION)
