"""The kernel log as an XID source (gpud/health/kmsg.py): real captured driver lines and /dev/kmsg
records parsed; a follower of a growing file, with its cursor across restarts, replaced and truncated
files, userspace-written records, garbage, a missing or forbidden log, and the real /dev/kmsg.

Records the follower reads in these tests are built from the captured driver messages of
fixtures/kmsg/nvrm-xid-lines.txt wrapped in the /dev/kmsg header (PRIORITY,SEQ,TIMESTAMP_US,FLAGS;),
the kernel's format, as in fixtures/kmsg/dev-kmsg-records.txt (read from this machine's /dev/kmsg)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import REPO, until

from gpud.health.kmsg import KernelLogFollower
from gpud.health.kmsg_records import KernelXid, parse_record, parse_xid

FIXTURES = Path(__file__).parent / "fixtures" / "kmsg"


def captured_lines() -> list[tuple[str | None, int | None, str]]:
    """(expected bus id, expected XID, message) of each captured line; None, None for no XID."""
    lines = []
    for line in (FIXTURES / "nvrm-xid-lines.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        bus_id, xid, message = line.split("\t")
        lines.append((None, None, message) if bus_id == "-" else (bus_id, int(xid), message))
    return lines


CAPTURED = captured_lines()
XID_MESSAGES = [message for bus_id, _, message in CAPTURED if bus_id is not None]
FALLEN_OFF_79 = next(message for _, xid, message in CAPTURED if xid == 79)
NVLINK_149 = next(message for _, xid, message in CAPTURED if xid == 149)


def records_in(path: Path) -> list[bytes]:
    """The records of a fixture file as one read() of /dev/kmsg returns each: a header line and its
    continuation lines. Comment lines are kept as records of their own (garbage to the parser)."""
    records: list[bytes] = []
    for line in path.read_bytes().splitlines(keepends=True):
        if line.startswith(b" ") and records:
            records[-1] += line
        else:
            records.append(line)
    return records


def kernel_record(seq: int, message: str, *, priority: int = 3, ago_s: float = 0.0) -> bytes:
    """A record as the kernel writes it for the driver (facility 0), timestamped ago_s seconds ago."""
    timestamp_us = int((time.monotonic() - ago_s) * 1e6)
    return f"{priority},{seq},{timestamp_us},-;{message}\n".encode()


class Collected:
    def __init__(self):
        self.xids: list[KernelXid] = []

    def __call__(self, xid: KernelXid) -> None:
        self.xids.append(xid)

    def numbers(self) -> list[tuple[int, int]]:
        return [(xid.seq, xid.xid) for xid in self.xids]


@pytest.fixture
def boot_id(tmp_path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text("35158ee1-96e7-4e47-bc23-caaffd29961f\n")  # this machine's, when the fixture was read
    return path


def follower_of(path: Path, boot_id: Path, cursor: Path | None = None, **options):
    collected = Collected()
    follower = KernelLogFollower(path, collected, cursor_path=cursor, boot_id_path=boot_id,
                                 poll_s=options.pop("poll_s", 0.02), **options)
    return follower, collected


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as file:
        file.write(data)


# -- the driver's lines ------------------------------------------------------------------------------


@pytest.mark.parametrize("bus_id,xid,message", CAPTURED, ids=lambda v: v[:40] if isinstance(v, str) else None)
def test_each_captured_line_is_read_as_captured(bus_id, xid, message):
    parsed = parse_xid(message)
    if bus_id is None:
        assert parsed is None
        return
    assert parsed is not None and parsed[:2] == (bus_id, xid)
    # the detail is everything after "N, ", as the driver wrote it
    assert parsed[2] == message.split(f"): {xid}, ", 1)[1].strip()


def test_every_form_of_the_driver_is_in_the_captures():
    # the forms the parser must take, each seen in a real capture: pid=/name=, pid='<unknown>', no pid,
    # pid without name, the NVLink5 extended form, non-zero PCI domains
    assert any("pid='<unknown>'" in m for m in XID_MESSAGES)
    assert any("pid=" not in m for m in XID_MESSAGES)
    assert any("pid=" in m and "name=" not in m for m in XID_MESSAGES)
    assert {parse_xid(m)[1] for m in XID_MESSAGES} >= {13, 31, 45, 79, 145, 149, 154}
    assert {parse_xid(m)[0][:8] for m in XID_MESSAGES} >= {"00000000", "00000008", "00000019"}


def test_a_long_detail_is_cut_at_512_characters():
    parsed = parse_xid(NVLINK_149 + " 0x00000000" * 100)
    assert parsed is not None and len(parsed[2]) == 512 and parsed[2].startswith("NETIR_LINK_EVT")


@pytest.mark.parametrize("message", [
    FALLEN_OFF_79.replace("NVRM: ", ""),                        # no driver prefix: `echo Xid ... > /dev/kmsg`
    "[ 1843.308145] " + FALLEN_OFF_79,                          # a dmesg line pasted in, timestamp and all
    "kernel: " + FALLEN_OFF_79,                                  # a syslog line
    FALLEN_OFF_79.replace("): 79,", "): 0,"),                   # XID 0: none the driver raises
    FALLEN_OFF_79.replace("): 79,", "): 1001,"),                # beyond any documented XID
    FALLEN_OFF_79.replace("): 79,", "): 99999999999,"),         # digits beyond any int the driver prints
    FALLEN_OFF_79.replace("): 79,", "): 79abc,"),               # a number glued to text
    FALLEN_OFF_79.replace("): 79,", "): -79,"),
    FALLEN_OFF_79.replace("0000:44:00", "0000:zz:00"),          # a bus id that is not hex
    FALLEN_OFF_79.replace("0000:44:00", "0000:44"),             # a bus id cut short
    FALLEN_OFF_79.replace("0000:44:00", "0000:0440:00"),
    FALLEN_OFF_79[:len("NVRM: Xid (PCI:0000:44:")],             # the line cut inside its bus id
    "NVRM: Xid",
    "",
    "\x00\x01\x02",
])
def test_a_line_that_only_mentions_an_xid_is_none(message):
    # each is a captured line (fixtures/kmsg/nvrm-xid-lines.txt) damaged as logs get damaged
    assert parse_xid(message) is None


def test_a_line_cut_after_its_number_is_still_that_xid():
    # a record the kernel cut at its size limit still names its GPU and XID
    assert parse_xid("NVRM: Xid (PCI:0000:44:00): 79") == ("00000000:44:00.0", 79, "")


# -- the record format ------------------------------------------------------------------------------


def test_records_read_from_this_machines_kmsg():
    parsed = [parse_record(record) for record in records_in(FIXTURES / "dev-kmsg-records.txt")]
    kernel = [p for p in parsed if p is not None]
    assert [seq for seq, _, _ in kernel] == [0, 89, 197, 279, 407]
    by_seq = {seq: (timestamp, message) for seq, timestamp, message in kernel}
    assert by_seq[89] == (245045, "rcu: \tRCU restricting CPUs from NR_CPUS=256 to nr_cpu_ids=2.")  # \x09 undone
    # continuation lines are no part of the message
    assert by_seq[197][1] == "pci 0000:00:00.0: [8086:0d57] type 00 class 0x060000 conventional PCI endpoint"
    assert by_seq[407] == (28349401201, "new mount options do not match the existing superblock, will be ignored")


def test_records_written_from_userspace_are_none():
    # the two records written with printf > /dev/kmsg (priorities 12 and 11: facility LOG_USER), one
    # of them in the driver's very form: the kernel never gives userspace facility 0
    records = [r for r in records_in(FIXTURES / "dev-kmsg-records.txt") if r.startswith((b"11,", b"12,"))]
    assert len(records) == 2 and b"NVRM: Xid (PCI:0000:3b:00): 79" in records[1]
    assert [parse_record(r) for r in records] == [None, None]


def test_the_example_of_the_kernel_documentation():
    parsed = [parse_record(r) for r in records_in(FIXTURES / "dev-kmsg-abi-example.txt")]
    assert [p for p in parsed if p is not None] == [
        (160, 424069, "pci_root PNP0A03:00: host bridge window [io  0x0000-0x0cf7] (ignored)"),
        (339, 5140900, "NET: Registered protocol family 10"),
    ]  # udevd's record (priority 30: LOG_DAEMON) is userspace's


@pytest.mark.parametrize("record", [
    b"", b"\n", b"garbage\n", b"# a comment\n", b" SUBSYSTEM=pci\n",
    b"6,89,2450",                               # cut inside its header
    b"6,89,245045,-",                           # cut before its message
    b"6,89;rcu\n", b"a,b,c,-;x\n", b"-6,89,245045,-;x\n", b"6,-89,245045,-;x\n",
    b"9" * 5000 + b",1,1,-;x\n",                # a number longer than any the kernel writes
    b"\xff\xfe\x00\x01;\n",
])
def test_what_is_no_record_is_none(record):
    assert parse_record(record) is None


def test_bytes_that_are_not_utf8_are_replaced_not_fatal():
    record = kernel_record(5, FALLEN_OFF_79).replace(b"GPU has", b"GPU \xff\xfe\\xc3 has")
    seq, _, message = parse_record(record)
    assert seq == 5 and "\ufffd" in message
    assert parse_xid(message)[:2] == ("00000000:44:00.0", 79)


# -- the follower on a file ---------------------------------------------------------------------------


def test_a_growing_file_is_followed_and_only_the_drivers_xids_are_delivered(tmp_path, boot_id):
    log_file = tmp_path / "kmsg"
    shutil.copy(FIXTURES / "dev-kmsg-records.txt", log_file)  # host records, comments, userspace's NVRM line
    follower, got = follower_of(log_file, boot_id)
    follower.start()
    try:
        until(lambda: follower.lines_read == 7, what="the 7 records of the fixture read")
        assert got.xids == [] and follower.problem is None
        append(log_file, kernel_record(410, FALLEN_OFF_79, ago_s=2.0))
        until(lambda: got.xids, what="the XID appended")
        append(log_file, kernel_record(411, NVLINK_149) + kernel_record(412, "NVRM: GPU at PCI:0000:0a:00: x"))
        until(lambda: follower.lines_read == 10, what="the two records appended")
    finally:
        follower.stop()
    assert got.numbers() == [(410, 79), (411, 149)]
    first = got.xids[0]
    assert (first.pci_bus_id, first.detail) == ("00000000:44:00.0", "GPU has fallen off the bus")
    assert abs(first.at - (time.time() - 2.0)) < 1.0  # wall clock of when the kernel wrote it
    assert follower.xids_seen == 2


def test_a_line_in_progress_waits_for_its_newline(tmp_path, boot_id):
    log_file = tmp_path / "kmsg"
    whole = kernel_record(2, XID_MESSAGES[0])
    cut = len(whole) // 2
    # one write: a whole record, then half of the next ("...): 31, pid=133": an XID line already)
    log_file.write_bytes(kernel_record(1, FALLEN_OFF_79) + whole[:cut])
    follower, got = follower_of(log_file, boot_id)
    follower.start()
    try:
        until(lambda: got.xids, what="the whole record")
        append(log_file, whole[cut:])
        until(lambda: len(got.xids) == 2, what="the record completed")
    finally:
        follower.stop()
    assert got.numbers() == [(1, 79), (2, 31)]
    assert got.xids[1].detail == parse_xid(XID_MESSAGES[0])[2]  # whole, not cut


def test_garbage_huge_lines_and_bytes_that_are_not_utf8_deliver_nothing_false(tmp_path, boot_id):
    log_file = tmp_path / "kmsg"
    log_file.write_bytes(
        b"\xff\xfe\x00\x80garbage\n"
        + b"3,1,1,-;" + b"A" * (1 << 20) + FALLEN_OFF_79.encode() + b"\n"  # a 1 MiB line
        + b"3,2,1,-;NVRM: Xid (PCI:0000:44:\n"                               # a record cut short
        + b"\n\n \n"
        + b"3,3,1,-;" + FALLEN_OFF_79.encode().replace(b"fallen", b"\xc3\x28fallen") + b"\n"
        + b"3,4," + b"7" * 100000)                                           # huge and never ended
    follower, got = follower_of(log_file, boot_id)
    follower.start()
    try:
        until(lambda: got.xids, what="the one good XID record")
        append(log_file, b"\n" + kernel_record(5, NVLINK_149))
        until(lambda: len(got.xids) == 2, what="the record after the huge line")
    finally:
        follower.stop()
    assert got.numbers() == [(3, 79), (5, 149)]
    assert "\ufffd" in got.xids[0].detail and follower.problem is None


def test_an_exception_of_deliver_is_logged_and_reading_goes_on(tmp_path, boot_id):
    log_file = tmp_path / "kmsg"
    log_file.write_bytes(kernel_record(1, FALLEN_OFF_79) + kernel_record(2, NVLINK_149))
    delivered = []

    def deliver(xid: KernelXid) -> None:
        delivered.append(xid.seq)
        if xid.seq == 1:
            raise RuntimeError("the caller's fault")

    follower = KernelLogFollower(log_file, deliver, cursor_path=None, boot_id_path=boot_id, poll_s=0.02)
    follower.start()
    try:
        until(lambda: len(delivered) == 2, what="both deliveries")
        assert follower.problem is None
    finally:
        follower.stop()
    assert delivered == [1, 2]


# -- the cursor across restarts ---------------------------------------------------------------------


def run_until_idle(path: Path, boot_id: Path, cursor: Path, records: int) -> list[tuple[int, int]]:
    """A follower's deliveries once it has read `records` records, stopped."""
    follower, got = follower_of(path, boot_id, cursor)
    follower.start()
    try:
        until(lambda: follower.lines_read == records, what=f"{records} records read")
    finally:
        follower.stop()
    return got.numbers()


def test_a_restart_in_the_same_boot_skips_what_was_delivered(tmp_path, boot_id):
    log_file, cursor = tmp_path / "kmsg", tmp_path / "state" / "kmsg-cursor.json"
    log_file.write_bytes(kernel_record(7, FALLEN_OFF_79) + kernel_record(8, NVLINK_149))
    assert run_until_idle(log_file, boot_id, cursor, 2) == [(7, 79), (8, 149)]
    assert json.loads(cursor.read_text()) == {"boot_id": boot_id.read_text().strip(), "seq": 8}

    append(log_file, kernel_record(9, XID_MESSAGES[0]))
    assert run_until_idle(log_file, boot_id, cursor, 3) == [(9, 31)]  # 7 and 8 were counted before
    assert json.loads(cursor.read_text())["seq"] == 9

    boot_id.write_text("0f9c7d6e-0000-4000-8000-000000000001\n")  # the machine rebooted
    assert run_until_idle(log_file, boot_id, cursor, 3) == [(7, 79), (8, 149), (9, 31)]


def test_a_corrupt_cursor_is_set_aside_and_everything_is_new(tmp_path, boot_id):
    log_file, cursor = tmp_path / "kmsg", tmp_path / "kmsg-cursor.json"
    log_file.write_bytes(kernel_record(7, FALLEN_OFF_79))
    for corrupt in ('{"boot_id": "35158ee1', '{"boot_id": 5, "seq": 1}', '{"boot_id": "x", "seq": -1}', "[]"):
        cursor.write_text(corrupt)
        follower, got = follower_of(log_file, boot_id, cursor)
        follower.start()
        try:
            until(lambda: got.xids, what="the XID, the cursor being unusable")
        finally:
            follower.stop()
        assert follower.corrupt_cursor is not None, corrupt
        assert cursor.with_name(cursor.name + ".corrupt").read_text() == corrupt
        assert json.loads(cursor.read_text())["seq"] == 7  # a good one written in its place


def test_no_boot_id_means_every_record_is_new(tmp_path):
    log_file, cursor = tmp_path / "kmsg", tmp_path / "kmsg-cursor.json"
    log_file.write_bytes(kernel_record(7, FALLEN_OFF_79))
    cursor.write_text(json.dumps({"boot_id": None, "seq": 7}))
    assert run_until_idle(log_file, tmp_path / "no-boot-id", cursor, 1) == [(7, 79)]


# -- replaced and truncated files --------------------------------------------------------------------


def test_a_replaced_or_truncated_file_is_read_again_from_its_start(tmp_path, boot_id):
    log_file = tmp_path / "kmsg"
    log_file.write_bytes(kernel_record(1, FALLEN_OFF_79) + kernel_record(2, NVLINK_149))
    follower, got = follower_of(log_file, boot_id)
    follower.start()
    try:
        until(lambda: len(got.xids) == 2, what="the first file's XIDs")
        replacement = tmp_path / "kmsg.new"  # a new log, numbered from 1 again (a simulator restarted)
        replacement.write_bytes(kernel_record(1, XID_MESSAGES[1]))
        os.replace(replacement, log_file)
        until(lambda: len(got.xids) == 3, what="the replacement's XID")
        with log_file.open("r+b") as file:  # truncated in place, then written again
            file.truncate(0)
        append(log_file, kernel_record(1, XID_MESSAGES[2]))
        until(lambda: len(got.xids) == 4, what="the XID written after the truncation")
    finally:
        follower.stop()
    assert got.numbers() == [(1, 79), (2, 149), (1, 62), (1, 45)]


# -- a missing or forbidden kernel log --------------------------------------------------------------


def test_a_missing_log_is_a_problem_until_it_appears(tmp_path, boot_id):
    log_file = tmp_path / "kmsg"
    follower, got = follower_of(log_file, boot_id, retry_s=0.05)
    follower.start()
    try:
        problem = until(lambda: follower.problem, what="the problem of the missing log")
        assert str(log_file) in problem and "does not exist" in problem
        log_file.write_bytes(kernel_record(1, FALLEN_OFF_79))
        until(lambda: got.xids, what="the XID once the log exists")
        assert follower.problem is None
        log_file.unlink()  # gone again (a container's mount removed)
        until(lambda: follower.problem, what="the problem of the log removed")
    finally:
        follower.stop()
    assert got.numbers() == [(1, 79)]


def test_a_directory_is_a_problem_not_a_crash(tmp_path, boot_id):
    follower, got = follower_of(tmp_path, boot_id, retry_s=0.05)
    follower.start()
    try:
        problem = until(lambda: follower.problem, what="the problem of a directory")
    finally:
        follower.stop()
    assert str(tmp_path) in problem and "directory" in problem.lower() and got.xids == []


PERMISSION_CHILD = """
import sys, time
from pathlib import Path
from gpud.health.kmsg import KernelLogFollower
follower = KernelLogFollower(Path(sys.argv[1]), print, cursor_path=None, boot_id_path=Path(sys.argv[2]),
                             poll_s=0.02, retry_s=0.05)
follower.start()
deadline = time.monotonic() + 10
while follower.problem is None and time.monotonic() < deadline:
    time.sleep(0.01)
follower.stop()
print("PROBLEM", follower.problem)
"""


@pytest.mark.parametrize("forbidden", ["the file", "its directory"])
def test_permission_denied_says_what_to_do(tmp_path, boot_id, forbidden):
    # root reads any file: the follower runs as nobody, for whom a 0600 file of root's is EACCES (on
    # open), and so is a file in root's 0700 directory (on stat)
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run the follower as another user")
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:  # /tmp: a path nobody may walk
        place = Path(directory)
        place.chmod(0o700 if forbidden == "its directory" else 0o755)
        log_file = place / "kmsg"
        log_file.write_bytes(kernel_record(1, FALLEN_OFF_79))
        log_file.chmod(0o600 if forbidden == "the file" else 0o644)
        readable_boot_id = Path(shutil.copy(boot_id, place / "boot_id"))
        readable_boot_id.chmod(0o644)
        result = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                 "-c", PERMISSION_CHILD, str(log_file), str(readable_boot_id)],
                                capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    problem = next(line for line in result.stdout.splitlines() if line.startswith("PROBLEM"))
    assert problem == f"PROBLEM {log_file}: permission denied; run gpud as root or give it CAP_SYSLOG"
    assert "KernelXid(" not in result.stdout  # nothing delivered


# -- stop() ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["following", "waiting for the log"])
def test_stop_returns_promptly(tmp_path, boot_id, state):
    log_file = tmp_path / "kmsg"
    if state == "following":
        log_file.write_bytes(kernel_record(1, FALLEN_OFF_79))
    follower, got = follower_of(log_file, boot_id, poll_s=0.2)  # retry_s stays 5 s: stop must not wait it
    follower.start()
    until(lambda: got.xids if state == "following" else follower.problem, what=state)
    started = time.monotonic()
    follower.stop()
    assert time.monotonic() - started < 0.2 + 1.0
    assert not follower._thread.is_alive()


# -- the real /dev/kmsg ------------------------------------------------------------------------------


def test_the_real_dev_kmsg_is_read_without_a_false_xid(tmp_path, boot_id):
    device = Path("/dev/kmsg")
    try:
        os.close(os.open(device, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        pytest.skip(f"/dev/kmsg cannot be opened here: {exc.strerror or exc}")
    follower, got = follower_of(device, Path("/proc/sys/kernel/random/boot_id"), tmp_path / "cursor.json",
                                poll_s=0.1)
    follower.start()
    try:
        until(lambda: follower.lines_read > 0, what="a record of the real kernel log")
    finally:
        started = time.monotonic()
        follower.stop()
        assert time.monotonic() - started < 0.1 + 1.0
    assert follower.problem is None
    if not Path("/proc/driver/nvidia").exists():  # no NVIDIA driver: any XID would be false
        assert got.xids == []
    for xid in got.xids:
        assert parse_xid(f"NVRM: Xid (PCI:{xid.pci_bus_id[4:-2]}): {xid.xid}, {xid.detail}") is not None
    cursor = json.loads((tmp_path / "cursor.json").read_text())
    assert cursor["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert cursor["seq"] >= 0
