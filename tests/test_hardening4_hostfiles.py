"""Host files that are not what the kernel writes (issue 38, defects 6 and 7): a counter longer than
64 bits, a FIFO or a device at a port's file name, a reading that does not finish. None of them may
break a scrape or block a health thread, and each is reported."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from test_infiniband import port_dir, rendered, tree, write

from gpud.api.metrics import MetricsRoute
from gpud.base.hostfile import NotARegularFile, read_host_file
from gpud.health.infiniband import IbHealth, read_ports
from gpud.base.samples import Family


def test_a_counter_of_4090_digits_is_refused_reported_and_the_scrape_still_answers(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    write(port_dir(sysfs, "mlx5_0") / "counters" / "port_rcv_data", "9" * 4090)
    write(port_dir(sysfs, "mlx5_0") / "counters" / "symbol_error", str(2**64))  # one past what the kernel prints
    ports = {port.subject: port for port in read_ports(sysfs)}
    bad = ports["ib:mlx5_0/1"]
    assert "port_rcv_data" not in bad.counters and "symbol_error" not in bad.counters
    assert any("port_rcv_data: a number of 4090 digits, over 64 bits" in why for why in bad.unreadable)
    assert ports["ib:mlx5_1/1"].counters["port_rcv_data"] == 237159415345822  # the other ports as they are
    severity, action, message = IbHealth().check(list(ports.values()))["ib:mlx5_0/1"][("infiniband", "port-unreadable")]
    assert (severity, action) == ("degraded", "inspect-hardware") and "port_rcv_data" in message
    text = rendered(list(ports.values()))
    assert 'node_infiniband_port_data_received_bytes_total{device="mlx5_1",port="1"}' in text


def test_the_largest_counter_the_kernel_prints_is_read(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    write(port_dir(sysfs, "mlx5_0") / "counters" / "port_xmit_data", str(2**64 - 1))
    port = {p.subject: p for p in read_ports(sysfs)}["ib:mlx5_0/1"]
    assert port.counters["port_xmit_data"] == 2**64 - 1 and port.unreadable == ()


def test_one_unrenderable_sample_is_left_out_and_counted_not_a_500():
    class Huge:
        def collect(self):
            family = Family("gpud_test_value", "a test family", "gauge")
            family.add({"which": "huge"}, 10 ** 4090)
            family.add({"which": "text"}, "12")
            family.add({"which": "fine"}, 7)
            return [family]

    route = MetricsRoute(lambda: {"huge": Huge()})
    text = route.render()
    assert 'gpud_test_value{which="fine"} 7' in text
    assert 'which="huge"' not in text and 'which="text"' not in text
    assert 'gpud_collector_errors_total{collector="huge"} 1' in text


def test_a_fifo_at_a_ports_state_is_refused_without_blocking_and_reported(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    state = port_dir(sysfs, "mlx5_2") / "state"
    state.unlink()
    os.mkfifo(state)
    finished = []
    reader = threading.Thread(target=lambda: finished.append(read_ports(sysfs)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert finished, "reading the ports blocked on a FIFO"
    port = {p.subject: p for p in finished[0]}["ib:mlx5_2/1"]
    assert port.state is None and port.unreadable == ("state: a FIFO, not a regular file",)
    severity, _, message = IbHealth().check(finished[0])["ib:mlx5_2/1"][("infiniband", "port-unreadable")]
    assert severity == "degraded" and "state: a FIFO, not a regular file" in message


def test_host_files_refuse_devices_and_fifos_and_are_bounded(tmp_path):
    with pytest.raises(NotARegularFile, match="a character device, not a regular file"):
        read_host_file("/dev/zero")  # would feed a plain read() without end
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotARegularFile, match="a FIFO"):
        read_host_file(fifo)
    big = tmp_path / "big"
    big.write_bytes(b"1" * 100_000)
    assert len(read_host_file(big)) == 4096 and len(read_host_file(big, 10)) == 10


async def test_a_port_reading_that_does_not_finish_is_reported_not_hidden(tmp_path, monkeypatch):
    from gpud.config import HealthConfig
    from gpud.health import infiniband
    from gpud.health.sources import node_checks
    from gpud.health.tracker import HealthTracker

    release = threading.Event()
    monkeypatch.setattr(infiniband, "read_ports", lambda sysfs: release.wait(30) and [])  # a hung filesystem
    monkeypatch.setattr(node_checks, "IB_READ_DEADLINE_S", 0.3)
    tracker = HealthTracker(clear_after_passes=1)
    checks = node_checks.NodeChecks(session=None, tracker=tracker, settings=HealthConfig(), procfs=tmp_path,
                                    sysfs=tmp_path)
    try:
        started = time.monotonic()
        await checks._check_infiniband()
        assert time.monotonic() - started < 5
        snapshot = str(tracker.subjects_view())
        assert "read-stuck" in snapshot and "has not finished" in snapshot
        assert "has not finished" in checks.stuck  # HealthService.problems(): /healthz says so
    finally:
        release.set()
    await asyncio.sleep(0.1)  # fixed time: the released reading thread returns
    await checks._check_infiniband()
    snapshot = str(tracker.subjects_view())
    assert "read-stuck" not in snapshot and checks.stuck is None
