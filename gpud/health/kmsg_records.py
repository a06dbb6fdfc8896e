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

import re
from dataclasses import dataclass

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
