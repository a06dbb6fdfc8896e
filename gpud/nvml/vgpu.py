"""Whether the node's NVIDIA GPUs are vGPUs (a VM's virtual GPUs), and which vGPU manager the hypervisor
runs, read from PCI config space as GPU feature discovery (GFD) reads it.

GFD's reading, NVIDIA/k8s-device-plugin at 1b826acc6af3079d8923bac395c3124b8861a9a6:
- internal/vgpu/pciutil.go Devices: every entry of /sys/bus/pci/devices, in name order; those whose
  `vendor` is 0x10de (every NVIDIA function: GPUs, their audio functions, NVSwitches) have `class` and
  `config` read too. Any of these reads failing fails the whole reading.
- GetVendorSpecificCapability: config space shorter than 256 bytes is an error (the kernel gives other
  users than root only the first 64, drivers/pci/pci-sysfs.c pci_read_config); without the status
  register's capability-list bit (0x06, 0x10) there is none; else the list from the pointer at 0x34 is
  walked (id, next, length), stopping at a position seen before or id 0xff, to the first vendor-specific
  capability (id 0x09): only that one is looked at.
- internal/vgpu/vgpu.go IsVGPUDevice: a vGPU's has the signature "VF" at bytes 3 and 4; GetInfo: records
  (id, length, data) from byte 5 on, to record 0, which holds 10 bytes of the host driver's version and
  10 of its branch, NUL-padded.
- internal/lm/vgpu.go Labels: a failed reading gives no vgpu label at all (an error logged);
  otherwise `nvidia.com/vgpu.present` is whether any device is a vGPU, and every vGPU's host driver is
  written in turn to `nvidia.com/vgpu.host-driver-version` and `-branch` (the last one stays).

Where GFD's code would panic, never return or fail as a whole, gpud answers what it can and reports the
problem: a capability running past byte 255 (GFD panics) gives no reading; a `class` shorter than 4 bytes
(GFD panics) is read on; a vGPU whose host driver record cannot be reached (GFD loops for ever on a record
of length 0, and fails, labelling nothing, where the record is missing) is present without a host driver.
Reads are bounded (PCIe's 4096 bytes of config space) and never block (a FIFO planted in a fake tree).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from gpud.base.hostfile import read_host_file
from gpud.base.logs import get_logger

log = get_logger("nvml")

NVIDIA_VENDOR = "0x10de"
CONFIG_SPACE_BYTES = 4096  # PCIe's extended config space (PCI_CFG_SPACE_EXP_SIZE): the most sysfs gives
FULL_HEADER_BYTES = 256  # what GFD needs read (pciutil.go: "entire PCI configuration is not read")
STATUS = 0x06
STATUS_CAPABILITY_LIST = 0x10
CAPABILITY_POINTER = 0x34
CAPABILITY_BROKEN = 0xFF  # an id read where no capability is (a device off the bus reads all ones)
VENDOR_SPECIFIC = 0x09
VGPU_SIGNATURE = b"VF"
RECORDS_START = 5
HOST_DRIVER_RECORD = 0
HOST_DRIVER_VERSION_BYTES = 10
HOST_DRIVER_BRANCH_BYTES = 10
_SMALL_FILE_BYTES = 64  # `vendor`, `class`: "0x10de\n", "0x030200\n"


class HostDriver(NamedTuple):
    """The NVIDIA vGPU manager on the hypervisor, as the vGPU's config space tells it: "550.54.16", "r550_40"."""

    version: str
    branch: str


@dataclass(frozen=True)
class VgpuReading:
    """What the node's PCI devices say. present None: they could not be read (GFD labels nothing then);
    host_driver None: no vGPU, or the last one's host driver record is unreadable; problem: why not all
    was read."""

    present: bool | None
    host_driver: HostDriver | None = None
    problem: str | None = None


class _Unreadable(Exception):
    """The PCI devices cannot be read as GFD reads them: it labels nothing."""


def vendor_capability(config: bytes) -> bytes | None:
    """The first vendor-specific capability of a config space, whole (its length byte says how long), or
    None. Raises _Unreadable for a config space GFD refuses (under 256 bytes) or a capability that runs
    past the first 256 bytes (GFD's slice would panic)."""
    if len(config) < FULL_HEADER_BYTES:
        raise _Unreadable(f"only {len(config)} bytes of config space could be read, GFD needs {FULL_HEADER_BYTES}: "
                          "the kernel gives all of it only to a process with CAP_SYS_ADMIN (root)")
    if not config[STATUS] & STATUS_CAPABILITY_LIST:
        return None
    seen: set[int] = set()
    position = config[CAPABILITY_POINTER]
    while position and position not in seen:  # a position seen again: the list loops
        # GFD's positions are bytes: an offset past 255 wraps (pciutil.go GetByte(d.Config, pos+1))
        identifier, following, length = (config[(position + offset) & 0xFF] for offset in range(3))
        if identifier == CAPABILITY_BROKEN:
            return None
        if identifier == VENDOR_SPECIFIC:
            if position + length > FULL_HEADER_BYTES:
                raise _Unreadable(f"the vendor-specific capability at 0x{position:02x} claims {length} bytes, "
                                  "past the end of the capability list's 256 bytes")
            return config[position:position + length]
        seen.add(position)
        position = following
    return None


def is_vgpu(capability: bytes) -> bool:
    """vgpu.go IsVGPUDevice: the vendor capability of an NVIDIA vGPU bears "VF" at bytes 3 and 4."""
    return capability[3:5] == VGPU_SIGNATURE


def host_driver(capability: bytes) -> HostDriver | None:
    """vgpu.go GetInfo: the host driver record (id 0) among the records from byte 5 on, each (id, length,
    data); None where there is none, or too little of it. Every step moves forward or stops: a record of
    length 0 or a chain that wraps ends the walk (GFD would loop for ever on the first)."""
    position, seen = RECORDS_START, set()
    while position < len(capability) and capability[position] != HOST_DRIVER_RECORD:
        if position in seen or position + 1 >= len(capability):
            return None
        seen.add(position)
        position = (position + capability[position + 1]) & 0xFF  # GFD's position is a byte, as above
    data = position + 2
    end = data + HOST_DRIVER_VERSION_BYTES + HOST_DRIVER_BRANCH_BYTES
    if position >= len(capability) or end > len(capability):
        return None
    # GFD appends string(byte) per byte: each byte is the code point of the same value (Latin-1), and
    # strings.Trim(s, "\x00") trims NULs at both ends.
    text = capability[data:end].decode("latin-1")
    return HostDriver(text[:HOST_DRIVER_VERSION_BYTES].strip("\x00"), text[HOST_DRIVER_VERSION_BYTES:].strip("\x00"))


def read_vgpus(sysfs: Path) -> VgpuReading:
    """The vGPU reading of the node whose sysfs is at `sysfs` (/sys; a simulated node's own)."""
    root = sysfs / "bus" / "pci" / "devices"
    try:
        names = sorted(os.listdir(root))  # Go's os.ReadDir: sorted by name
        present, driver, problems = False, None, []
        for name in names:
            capability = _vendor_capability_of(root / name)
            if capability is None or not is_vgpu(capability):
                continue
            present, driver = True, host_driver(capability)
            if driver is None:
                problems.append(f"{name} is a vGPU without a readable host driver record in its vendor capability")
    except OSError as exc:
        return VgpuReading(None, problem=f"{root} cannot be read: {exc.strerror or exc}")
    except _Unreadable as exc:
        return VgpuReading(None, problem=str(exc))
    return VgpuReading(present, driver, "; ".join(problems) or None)


def _vendor_capability_of(device: Path) -> bytes | None:
    """An NVIDIA device's vendor-specific capability; None for another vendor's device or none found."""
    try:
        if read_host_file(device / "vendor", _SMALL_FILE_BYTES).decode("latin-1").strip() != NVIDIA_VENDOR:
            return None
        read_host_file(device / "class", _SMALL_FILE_BYTES)  # GFD reads it, and fails where it cannot
        config = read_host_file(device / "config", CONFIG_SPACE_BYTES)
    except OSError as exc:
        raise _Unreadable(f"{device.name}: {exc.filename or device} cannot be read: {exc.strerror or exc}") from None
    try:
        return vendor_capability(config)
    except _Unreadable as exc:
        raise _Unreadable(f"{device.name}: {exc}") from None


class VgpuReader:
    """read_vgpus again for each inventory snapshot (every inventory.refresh_interval_s, 30 s by default,
    and after every change gpud makes), as GFD reads again every sleep interval (60 s by default): a
    vGPU's host driver can change under a running VM (a migration). Each new problem is logged once."""

    def __init__(self, sysfs: Path):
        self._sysfs = sysfs
        self._read_for: object | None = None
        self._reading: VgpuReading | None = None

    def reading(self, snapshot: object) -> VgpuReading:
        """The reading for this inventory snapshot: read on the first call with it."""
        if snapshot is self._read_for and self._reading is not None:
            return self._reading
        reading, before = read_vgpus(self._sysfs), self._reading
        self._read_for, self._reading = snapshot, reading
        if reading.problem and (before is None or before.problem != reading.problem):
            log.warning("vgpu_unreadable", sysfs=str(self._sysfs), problem=reading.problem,
                        consequence="no nvidia.com/vgpu.* labels" if reading.present is None
                        else "no nvidia.com/vgpu.host-driver-* labels")
        if before is None or (before.present, before.host_driver) != (reading.present, reading.host_driver):
            log.info("vgpu_read", present=reading.present,
                     host_driver_version=reading.host_driver.version if reading.host_driver else None,
                     host_driver_branch=reading.host_driver.branch if reading.host_driver else None)
        return reading
