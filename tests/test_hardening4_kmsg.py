"""host.kmsg at something that is not the kernel log, and a repeated record (issue 38, defects 9 and 11):
refused and reported, never a spinning core, never an XID counted twice."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest
from helpers import until
from test_kmsg import FALLEN_OFF_79, NVLINK_149, boot_id, follower_of, kernel_record  # noqa: F401 (fixture)


def _thread_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("device, numbers", [("/dev/null", "1:3"), ("/dev/zero", "1:5")])
def test_a_device_that_is_not_dev_kmsg_is_refused_and_reported_without_a_spinning_core(boot_id, device, numbers):
    follower, got = follower_of(Path(device), boot_id, retry_s=0.05)
    before = _thread_cpu_s()
    follower.start()
    try:
        problem = until(lambda: follower.problem, what=f"the problem of {device}")
        time.sleep(1.0)  # fixed time: long enough for a spinning reader to burn a second of CPU
    finally:
        follower.stop()
    assert f"{device} is character device {numbers}, not the kernel log (/dev/kmsg is 1:11)" in problem
    assert _thread_cpu_s() - before < 0.5
    assert got.xids == [] and follower.lines_read == 0


def test_a_fifo_is_refused_and_reported(tmp_path, boot_id):
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    follower, _ = follower_of(fifo, boot_id, retry_s=0.05)
    follower.start()
    try:
        problem = until(lambda: follower.problem, what="the problem of a FIFO")
    finally:
        follower.stop()
    assert "is a FIFO, neither the kernel log device nor a regular file" in problem


def test_a_repeated_sequence_number_is_counted_once(tmp_path, boot_id):
    log_file = tmp_path / "kmsg"
    log_file.write_bytes(kernel_record(500, FALLEN_OFF_79) + kernel_record(501, NVLINK_149) +
                         kernel_record(500, FALLEN_OFF_79) + kernel_record(501, NVLINK_149) +
                         kernel_record(502, FALLEN_OFF_79))
    follower, got = follower_of(log_file, boot_id)
    follower.start()
    try:
        until(lambda: follower.lines_read == 5, what="the five lines read")
        time.sleep(0.2)  # fixed time: a few polls more, in which nothing else may be delivered
    finally:
        follower.stop()
    assert got.numbers() == [(500, 79), (501, 149), (502, 79)]


def test_a_fifo_swapped_in_after_a_file_is_refused_not_waited_on(tmp_path, boot_id):
    log_file = tmp_path / "kmsg"
    log_file.write_bytes(kernel_record(600, FALLEN_OFF_79))
    follower, got = follower_of(log_file, boot_id, retry_s=0.05)
    follower.start()
    try:
        until(lambda: got.xids, what="the XID in the file")
        log_file.unlink()
        os.mkfifo(log_file)  # the file replaced: the next open must not wait for a writer
        problem = until(lambda: follower.problem, what="the FIFO refused")
    finally:
        follower.stop()
    assert "is a FIFO" in problem and got.numbers() == [(600, 79)]
