"""The kernel log as a second source of XIDs, beside NVML's events: the NVIDIA kernel module writes every
XID it raises to the kernel log (`NVRM: Xid (PCI:0000:3b:00): 79, pid=0, name=, GPU has fallen off the
bus.`), including those NVML never reported to gpud (NVML was down, gpud was not running yet).

The reader follows /dev/kmsg, one record per read(), or a regular file of such records, one per line,
the same way (the simulator's kernel log, tests), like `tail -f`. Only the kernel's own records count
(gpud.health.kmsg_records reads a record and the driver's XID line in it, and says why).
"""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path
from typing import Callable

from gpud.base.hostfile import read_host_text
from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile, read_json, write_json_atomic
from gpud.health.kmsg_records import KERNEL_FACILITY, KernelXid, parse_cursor, parse_xid, read_record, source_kind

log = get_logger("kmsg")

# The kernel caps a record's text near 1 KiB (PRINTKRB_RECORD_MAX); a longer "line" in a file is not a
# record, and the reader does not hold unbounded garbage waiting for its newline.
MAX_RECORD_BYTES = 16 * 1024
RETRY_OPEN_S = 5.0  # a missing or forbidden kernel log is tried again this often
# /dev/kmsg gives a record per read, numbered upwards (Documentation/ABI/testing/dev-kmsg): reads in a row
MAX_NON_RECORDS = 64  # that are not records tell another source; a number seen again is a repeated line
SEEN_SEQS = 4096
CURSOR_EVERY_S = 1.0  # the cursor is written at most this often while records arrive


def _read_boot_id(path: Path) -> str | None:
    try:
        text = read_host_text(path, encoding="ascii", errors="replace").strip()
    except OSError as exc:
        log.warning("boot_id_unreadable", path=str(path), error=exc.strerror or str(exc),
                    consequence="every record in the kernel log is taken as new")
        return None
    return text or None


class _Reopen(Exception):
    """The file followed was truncated or replaced: read it again from its start."""


class _Gone(Exception):
    """The kernel log cannot be read now: the problem says why."""


class KernelLogFollower:
    """Follows the kernel log at path (the /dev/kmsg character device, or a regular file of records) on
    a thread of its own, calling deliver(KernelXid) for each XID the driver wrote there.

    The cursor (cursor_path) holds the last record handled in this boot: after a restart of gpud, the
    records up to it are skipped. A file replaced while gpud was stopped, in the same boot, with records
    numbered no higher than the cursor, is therefore skipped too; replaced while gpud runs, it is seen
    (a sequence number going back) and read in full."""

    def __init__(self, path: Path, deliver: Callable[[KernelXid], None], *, cursor_path: Path | None,
                 boot_id_path: Path, poll_s: float = 0.05, retry_s: float = RETRY_OPEN_S):
        self.path = Path(path)
        self.deliver = deliver
        self.cursor_path = cursor_path
        self.boot_id_path = boot_id_path
        self.poll_s = poll_s
        self.retry_s = retry_s  # how often a missing or forbidden kernel log is tried again
        self.problem: str | None = None  # why the kernel log is not being read now
        self.xids_seen = 0  # XID records delivered
        self.lines_read = 0  # records read (a record's continuation lines are part of it)
        self.corrupt_cursor: CorruptFile | None = None  # a cursor file that could not be read back
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._boot_id: str | None = None
        self._skip_through: int | None = None  # records up to this seq were handled before a restart
        self._last_seq: int | None = None  # the last record handled, this run
        self._seen_seqs: dict[int, None] = {}  # the last SEEN_SEQS numbers in this source, oldest first
        self._non_records = 0  # reads in a row that yielded no record
        self._device = False  # following /dev/kmsg, whose numbers only grow within a boot
        self._cursor_dirty = False
        self._cursor_written_at = 0.0
        self._cursor_lock = threading.Lock()  # the thread's own saves and save_cursor's from the event loop

    # -- life ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="kmsg", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(self.poll_s + 1.0)
            if self._thread.is_alive():
                log.warning("kmsg_reader_still_running", why="deliver() has not returned",
                            consequence="the cursor is written when it does")

    # -- the cursor --------------------------------------------------------------------------------

    def _load_cursor(self) -> None:
        if self.cursor_path is None:
            return
        cursor, self.corrupt_cursor = read_json(self.cursor_path, parse_cursor)
        if cursor is None:
            return
        boot_id, seq = cursor
        if boot_id is not None and boot_id == self._boot_id:
            self._skip_through = seq
            self._last_seq = seq
        else:
            log.info("kmsg_cursor_from_another_boot", cursor_boot_id=boot_id, boot_id=self._boot_id,
                     consequence="every record in the kernel log is new")

    def save_cursor(self) -> None:
        """Saves the cursor now, whatever its rate: the health state is about to be saved, and the XIDs
        it counts must not be read again after a crash (a blocking write: call it off the event loop)."""
        self._save_cursor(now=True)

    def _save_cursor(self, *, now: bool) -> None:
        with self._cursor_lock:
            if self.cursor_path is None or not self._cursor_dirty or self._last_seq is None:
                return
            if not now and time.monotonic() - self._cursor_written_at < CURSOR_EVERY_S:
                return
            try:
                write_json_atomic(self.cursor_path, {"boot_id": self._boot_id, "seq": self._last_seq})
            except OSError as exc:
                log.error("kmsg_cursor_not_saved", path=str(self.cursor_path), error=exc.strerror or str(exc),
                          consequence="after a restart, records already counted may be delivered again")
            self._cursor_dirty = False
            self._cursor_written_at = time.monotonic()

    # -- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        # on the thread, as all its file work: start() never blocks its caller's event loop
        self._boot_id = _read_boot_id(self.boot_id_path)
        self._load_cursor()
        try:
            while not self._stopping.is_set():
                try:
                    self._follow()
                except _Gone:
                    self._stopping.wait(self.retry_s)
                except _Reopen:
                    continue
                except Exception as exc:  # a fault of the reader: said, and tried again, never a dead thread
                    log.exception("kmsg_reader_failed", retry_in_s=self.retry_s)
                    self.problem = f"the kernel log reader failed ({type(exc).__name__}: {exc}); see gpud's log"
                    self._stopping.wait(self.retry_s)
        finally:
            self._save_cursor(now=True)

    def _fail(self, problem: str, **fields) -> None:
        if problem != self.problem:
            log.warning("kmsg_unreadable", path=str(self.path), problem=problem,
                        retry_in_s=self.retry_s, **fields)
        self.problem = problem
        raise _Gone()

    def _unreadable(self, exc: OSError, doing: str = "") -> None:
        if isinstance(exc, FileNotFoundError):
            self._fail(f"{self.path} does not exist (no kernel log to read XIDs from; in a container, "
                       f"mount the host's /dev/kmsg)")
        if isinstance(exc, PermissionError):  # EACCES, or EPERM of /dev/kmsg under dmesg_restrict
            self._fail(f"{self.path}: permission denied; run gpud as root or give it CAP_SYSLOG")
        self._fail(f"{self.path}: {doing}{exc.strerror or exc}")

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags | os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._unreadable(exc)
        raise AssertionError("unreachable")  # _unreadable raises

    def _follow(self) -> None:
        # opened first, without blocking, then judged: what is judged is what is read (no FIFO swapped in)
        fd = self._open(os.O_NONBLOCK)
        try:
            opened = os.fstat(fd)
            kind, problem = source_kind(self.path, opened)
            if problem:
                self._fail(problem)
            self._seen_seqs.clear()
            self._non_records, self._device = 0, kind == "device"
            self._follow_device(fd) if self._device else self._follow_file(fd, opened)
        finally:
            os.close(fd)

    def _follow_device(self, fd: int) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        self.problem = None
        said_readable = False
        while not self._stopping.is_set():
            records = 0
            while not self._stopping.is_set():
                try:
                    record = os.read(fd, MAX_RECORD_BYTES)
                except BlockingIOError:  # EAGAIN: nothing new
                    break
                except BrokenPipeError:  # EPIPE: the ring buffer overwrote records before we read them
                    log.warning("kmsg_records_lost", why="the kernel's ring buffer overwrote them first",
                                consequence="XIDs among them are not seen here")
                    continue
                except OSError as exc:
                    self._unreadable(exc, "read failed: ")
                if not record:
                    break
                records += 1
                self._handle(record)
                if self._non_records >= MAX_NON_RECORDS:
                    self._fail(f"{self.path} gave {self._non_records} reads in a row that are not kernel "
                               "log records: set host.kmsg to /dev/kmsg")
            self._save_cursor(now=False)
            if said_readable and not records:  # /dev/kmsg polls readable with a record only
                self._stopping.wait(self.poll_s)
            said_readable = bool(poller.poll(self.poll_s * 1000))  # a timeout: stop() is prompt

    def _follow_file(self, fd: int, opened: os.stat_result) -> None:
        self.problem = None
        offset, pending, oversized = 0, b"", False
        while not self._stopping.is_set():
            try:
                chunk = os.read(fd, 65536)
            except OSError as exc:
                self._unreadable(exc, "read failed: ")
            if chunk:
                offset += len(chunk)
                pending, oversized = self._lines(pending + chunk, oversized)
                self._save_cursor(now=False)
                continue
            self._save_cursor(now=False)
            self._check_replaced(opened, offset)
            self._stopping.wait(self.poll_s)

    def _check_replaced(self, opened: os.stat_result, offset: int) -> None:
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            raise _Reopen() from None  # removed: the next open says so, and waits for it
        except OSError:
            return
        if (now.st_ino, now.st_dev) != (opened.st_ino, opened.st_dev) or now.st_size < offset:
            log.info("kmsg_file_replaced", path=str(self.path), consequence="read again from its start")
            raise _Reopen()

    def _lines(self, data: bytes, oversized: bool) -> tuple[bytes, bool]:
        """Handles each whole line of data; returns what is left (a line without its newline yet) and
        whether the line in progress is already known too long."""
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            if not oversized:
                self._handle_line(data[start:end])
            oversized = False
            start = end + 1
        rest = data[start:]
        if len(rest) > MAX_RECORD_BYTES:
            if not oversized:
                log.warning("kmsg_line_too_long", path=str(self.path), limit_bytes=MAX_RECORD_BYTES,
                            consequence="skipped up to its end")
            return b"", True
        return rest, oversized

    def _handle_line(self, line: bytes) -> None:
        if line.startswith(b" ") or not line.strip():  # a continuation line, or an empty one
            return
        if len(line) > MAX_RECORD_BYTES:
            log.warning("kmsg_line_too_long", path=str(self.path), limit_bytes=MAX_RECORD_BYTES,
                        consequence="skipped")
            return
        self._handle(line)

    def _handle(self, raw: bytes) -> None:
        record = read_record(raw)
        if record is None:
            self._non_records += 1
            log.debug("kmsg_not_a_record", start=raw[:80].decode("ascii", "backslashreplace"))
            return
        self._non_records = 0
        self.lines_read += 1
        if record.seq in self._seen_seqs or (self._device and record.seq <= (self._last_seq or -1)):
            return  # a repeated line of a file, or the ring buffer replayed by a reopen: handled once
        self._seen_seqs[record.seq] = None  # a dict: looked up in constant time, once per record
        if len(self._seen_seqs) > SEEN_SEQS:
            del self._seen_seqs[next(iter(self._seen_seqs))]
        if self._last_seq is not None and record.seq <= self._last_seq and self._skip_through is None:
            # within one source the kernel's numbers only grow: the log was replaced
            log.info("kmsg_sequence_went_back", seq=record.seq, after=self._last_seq,
                     consequence="every record from here on is new")
        if self._skip_through is not None:
            if record.seq <= self._skip_through:
                return  # counted before gpud restarted
            self._skip_through = None
        self._last_seq = record.seq
        self._cursor_dirty = True
        if record.facility != KERNEL_FACILITY:
            return
        parsed = parse_xid(record.message)
        if parsed is None:
            return
        bus_id, xid, detail = parsed
        at = time.time() - (time.monotonic() - record.timestamp_us / 1e6)
        try:
            self.deliver(KernelXid(bus_id, xid, detail, record.seq, at))
        except Exception:
            log.exception("kmsg_deliver_failed", xid=xid, pci_bus_id=bus_id, seq=record.seq)
        self.xids_seen += 1
