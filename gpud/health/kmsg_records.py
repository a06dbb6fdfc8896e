"""One /dev/kmsg record and the NVIDIA driver's XID line in it.

/dev/kmsg (kernel Documentation/ABI/testing/dev-kmsg) returns one record per read(),
`PRIORITY,SEQNUM,TIMESTAMP_US,FLAGS[,...];MESSAGE\\n`, then optional continuation lines starting with a
space (` SUBSYSTEM=pci`), which carry nothing gpud needs.

Never a false XID: a process that may write /dev/kmsg can write any text there, "NVRM: Xid ..." included.
The kernel stores every record written from userspace with a non-zero facility (LOG_USER unless the
writer names another, and it can never name facility 0: kernel/printk/printk.c, devkmsg_write), so the
facility (PRIORITY >> 3) tells the driver's records (0) from injected ones; only the former count.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from gpud.base.hostfile import kind_of
from gpud.model.inventory import normal_bus_id

KERNEL_FACILITY = 0  # LOG_KERN: what the kernel and its modules write; userspace never gets it
MAX_XID = 1000  # a number above this is no XID the driver documents: a parse gone wrong
MAX_DETAIL_CHARS = 512

# PRIORITY,SEQNUM,TIMESTAMP_US,FLAGS then optional further comma fields (caller=T1 on some kernels).
_HEADER = re.compile(rb"(\d{1,10}),(\d{1,20}),(\d{1,20}),([^,;]*)(?:,[^;]*)?;")
_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")
# The driver's form; the domain is 4 hex digits on every capture, 8 tolerated; older drivers wrote no
# "PCI:" prefix. The function is never written (a GPU is function 0).
_NVRM_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.([0-7]))?\): "
    r"(\d{1,10})(?:,(.*)|\s*)", re.DOTALL)


@dataclass(frozen=True)
class KernelXid:
    pci_bus_id: str  # normalised: "00000000:3b:00.0"
    xid: int
    detail: str  # the rest of the line after "N, " (trimmed, at most MAX_DETAIL_CHARS)
    seq: int  # the kmsg sequence number
    at: float  # wall-clock (time.time() scale) of the record


@dataclass(frozen=True)
class Record:
    facility: int
    seq: int
    timestamp_us: int
    message: str


def read_record(record: bytes) -> Record | None:
    first_line = record.split(b"\n", 1)[0]  # continuation lines (" SUBSYSTEM=...") are skipped
    header = _HEADER.match(first_line)
    if header is None:
        return None
    raw = first_line[header.end():]
    # The kernel writes non-printable bytes (and the backslash itself) as \xNN: undone, then read as
    # UTF-8, with U+FFFD for what is not.
    text = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), raw).decode("utf-8", "replace")
    return Record(int(header.group(1)) >> 3, int(header.group(2)), int(header.group(3)), text)


def parse_record(record: bytes) -> tuple[int, int, str] | None:
    """(seq, timestamp_us, message) of one /dev/kmsg record, None if it is not one, or if userspace wrote
    it (facility other than the kernel's: see the module's docstring)."""
    parsed = read_record(record)
    if parsed is None or parsed.facility != KERNEL_FACILITY:
        return None
    return parsed.seq, parsed.timestamp_us, parsed.message


def parse_xid(message: str) -> tuple[str, int, str] | None:
    """(normalised PCI bus id, XID, detail) of an NVRM Xid message, None otherwise. The message must
    start with the driver's "NVRM: " prefix: a line that only mentions an Xid is none."""
    match = _NVRM_XID.fullmatch(message)
    if match is None:
        return None
    domain, bus, device, function, number, rest = match.groups()
    xid = int(number)
    if not 1 <= xid <= MAX_XID:
        return None
    bus_id = normal_bus_id(f"{domain}:{bus}:{device}.{function or '0'}")
    if bus_id is None:
        return None
    detail = (rest or "").strip()[:MAX_DETAIL_CHARS]
    return bus_id, xid, detail


# /dev/kmsg is character device 1:11 (Linux Documentation/admin-guide/devices.txt, "1 char Memory
# devices ... 11 = /dev/kmsg"). Another device at host.kmsg is not the kernel log: /dev/null is always
# readable with nothing in it and /dev/zero never ends; followed, either spun a core for ever while
# health said the kernel log was read.
KMSG_DEVICE = (1, 11)


def source_kind(path: Path, info: os.stat_result) -> tuple[str | None, str | None]:
    """("device", None) for the kernel log device, ("file", None) for a regular file of its records
    (the simulator's, tests), else (None, why it is neither)."""
    if stat.S_ISCHR(info.st_mode):
        numbers = (os.major(info.st_rdev), os.minor(info.st_rdev))
        if numbers == KMSG_DEVICE:
            return "device", None
        return None, (f"{path} is character device {numbers[0]}:{numbers[1]}, not the kernel log (/dev/kmsg is "
                      f"{KMSG_DEVICE[0]}:{KMSG_DEVICE[1]}): set host.kmsg to /dev/kmsg")
    if stat.S_ISREG(info.st_mode):
        return "file", None
    return None, (f"{path} is {kind_of(info.st_mode)}, neither the kernel log device nor a regular file of "
                  "its records: set host.kmsg to /dev/kmsg")


def parse_cursor(document) -> tuple[str | None, int]:
    """The kernel log reader's cursor file: the boot it is of, and the last record handled in it."""
    boot_id, seq = document["boot_id"], document["seq"]
    if boot_id is not None and not isinstance(boot_id, str):
        raise TypeError("boot_id is not a string")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise ValueError("seq is not a non-negative integer")
    return boot_id, seq
