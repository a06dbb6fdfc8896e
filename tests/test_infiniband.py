"""InfiniBand and RoCE ports: read from sysfs trees captured on real hosts (tests/fixtures/infiniband/README.md
says where each file comes from), judged across checks, written as node_exporter's metrics, and the
nvidia_peermem check for GPUDirect RDMA."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import IN_CI

from gpud.api.metrics import MetricsRoute
from gpud.health.collectors.infiniband import collect as families
from gpud.health.infiniband import IbHealth, IbPort, peermem_problem, read_ports

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "infiniband"
CLASS = Path("class") / "infiniband"  # under a sysfs root

# node_exporter's infiniband collector: every metric it writes per port, with its type
# (prometheus/node_exporter collector/infiniband_linux.go, commit af65f85cb3c563988e47f7053800826c6d683a89).
NODE_EXPORTER_GAUGES = {"node_infiniband_state_id", "node_infiniband_physical_state_id",
                        "node_infiniband_rate_bytes_per_second"}
NODE_EXPORTER_COUNTERS = {f"node_infiniband_{name}" for name in (
    "legacy_multicast_packets_received_total", "legacy_multicast_packets_transmitted_total",
    "legacy_data_received_bytes_total", "legacy_packets_received_total", "legacy_unicast_packets_received_total",
    "legacy_unicast_packets_transmitted_total", "legacy_data_transmitted_bytes_total",
    "legacy_packets_transmitted_total", "excessive_buffer_overrun_errors_total", "link_downed_total",
    "link_error_recovery_total", "local_link_integrity_errors_total", "multicast_packets_received_total",
    "multicast_packets_transmitted_total", "port_constraint_errors_received_total",
    "port_constraint_errors_transmitted_total", "port_data_received_bytes_total", "port_data_transmitted_bytes_total",
    "port_discards_received_total", "port_discards_transmitted_total", "port_errors_received_total",
    "port_packets_received_total", "port_packets_transmitted_total", "port_transmit_wait_total",
    "unicast_packets_received_total", "unicast_packets_transmitted_total",
    "port_receive_remote_physical_errors_total", "port_receive_switch_relay_errors_total", "symbol_error_total",
    "vl15_dropped_total")}


def tree(name: str, tmp_path: Path) -> Path:
    """A writable copy of a fixture tree: the tests change files as the kernel would."""
    copy = tmp_path / name
    shutil.copytree(FIXTURES / name, copy)
    return copy


def port_dir(sysfs: Path, device: str, port: int = 1) -> Path:
    return sysfs / CLASS / device / "ports" / str(port)


def write(path: Path, text: str) -> None:
    path.write_text(text + "\n")


def by_subject(ports: list[IbPort]) -> dict[str, IbPort]:
    return {port.subject: port for port in ports}


# ------------------------------------------------------------------------------------------- reading

def test_node_exporter_tree_reads_as_node_exporter_does():
    ports = read_ports(FIXTURES / "node_exporter" / "sys")
    assert [(p.device, p.port) for p in ports] == [("i40iw0", 1), ("mlx4_0", 1), ("mlx4_0", 2)]
    iwarp, first, second = ports
    assert (iwarp.state, iwarp.state_id, iwarp.phys_state, iwarp.phys_state_id) == ("ACTIVE", 4, "LinkUp", 5)
    assert iwarp.rate_gbps == 10.0 and iwarp.link_layer == "InfiniBand"
    assert iwarp.counters == {}  # every counter "N/A (no PMA)": left out, not zero
    assert first.rate_gbps == 40.0 and first.subject == "ib:mlx4_0/1"
    assert first.counters["port_rcv_data"] == 4631917 and first.counters["port_xmit_discards"] == 5
    assert first.counters["port_xmit_wait"] == 4294967295
    assert first.counters["port_rcv_data_64"] == 4631917  # counters_ext/ (kernels before 4.5)
    assert "symbol_error" not in first.counters  # this ConnectX-3 capture has no such file
    assert second.counters["port_rcv_data"] == 0 and second.counters["port_unicast_rcv_packets"] == 61148


def test_connectx7_ndr_host():
    ports = read_ports(FIXTURES / "ndr-connectx7" / "sys")
    assert [p.subject for p in ports] == [f"ib:mlx5_{i}/1" for i in range(8)]
    for port in ports:
        assert (port.state, port.state_id, port.phys_state, port.phys_state_id) == ("ACTIVE", 4, "LinkUp", 5)
        assert port.rate_gbps == 400.0 and port.link_layer == "InfiniBand"
        assert port.counters["port_rcv_data"] == 237159415345822 and port.counters["symbol_error"] == 0
    results = IbHealth().check(ports)
    assert set(results) == {p.subject for p in ports}
    assert all(problem is None for checks in results.values() for problem in checks.values())
    assert set(results["ib:mlx5_0/1"]) == {("infiniband", code) for code in (
        "port-down", "link-flapped", "symbol-errors", "receive-errors", "link-error-recovery", "port-unreadable")}


def test_roce_port():
    [port] = read_ports(FIXTURES / "roce" / "sys")
    assert port.subject == "ib:mlx5_bond_0/1"
    assert port.link_layer == "Ethernet" and port.rate_gbps == 100.0 and port.state == "ACTIVE"
    assert port.counters["port_xmit_data"] == 85378896588
    assert all(problem is None for problem in IbHealth().check([port])[port.subject].values())


def test_no_infiniband_class_reads_as_no_ports(tmp_path):
    assert read_ports(tmp_path) == []
    (tmp_path / "class").mkdir()
    (tmp_path / "class" / "infiniband").write_text("not a directory\n")
    assert read_ports(tmp_path) == []


def test_missing_unreadable_and_garbage_files_read_as_none(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    port = port_dir(sysfs, "mlx5_0")
    (port / "state").unlink()
    (port / "state").mkdir()  # not the kernel's port file: unreadable, and said
    (port / "phys_state").write_bytes(b"5: Link\xff\xfeUp\n")  # not ASCII
    write(port / "rate", "Unknown rate")
    (port / "link_layer").unlink()
    write(port / "counters" / "symbol_error", "N/A (no PMA)")
    (port / "counters" / "link_downed").write_bytes(b"\x00\x01")
    write(port / "counters" / "port_rcv_errors", "-3")
    (port / "counters" / "port_xmit_wait").unlink()
    (port / "counters" / "port_xmit_wait").mkdir()
    write(port_dir(sysfs, "mlx5_1") / "state", "ACTIVE")  # no "N:" prefix
    write(port_dir(sysfs, "mlx5_2") / "phys_state", "x: LinkUp")
    (sysfs / CLASS / "mlx5_3" / "ports" / "lost+found").mkdir()  # not a port number: ignored
    shutil.rmtree(sysfs / CLASS / "mlx5_4" / "ports")  # a device without ports: no ports

    ports = by_subject(read_ports(sysfs))
    assert "ib:mlx5_4/1" not in ports and len(ports) == 7
    broken = ports["ib:mlx5_0/1"]
    assert (broken.state, broken.state_id, broken.phys_state, broken.phys_state_id) == (None, None, None, None)
    assert broken.rate_gbps is None and broken.link_layer is None
    assert not {"symbol_error", "link_downed", "port_rcv_errors", "port_xmit_wait"} & set(broken.counters)
    assert broken.counters["port_rcv_data"] == 237159415345822  # the readable ones stay
    assert ports["ib:mlx5_1/1"].state_id is None and ports["ib:mlx5_2/1"].phys_state_id is None

    # Nothing read to judge: no alarm, no crash; only what is not a file at all is named.
    results = IbHealth().check(list(ports.values()))
    severity, _, message = results["ib:mlx5_0/1"].pop(("infiniband", "port-unreadable"))
    assert severity == "degraded" and "state: a directory" in message  # a directory among counters is none
    assert all(problem is None for checks in results.values() for problem in checks.values())
    assert list(families(list(ports.values())))


# -------------------------------------------------------------------------------------------- health

def test_counter_deltas_across_checks(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    counters = port_dir(sysfs, "mlx5_3") / "counters"
    health = IbHealth()
    assert health.check(read_ports(sysfs))["ib:mlx5_3/1"][("infiniband", "symbol-errors")] is None

    write(counters / "symbol_error", "10")  # at the threshold: passes
    write(counters / "link_downed", "2")
    write(counters / "port_rcv_errors", "11")
    write(counters / "link_error_recovery", "25")
    results = health.check(read_ports(sysfs))
    checks = results["ib:mlx5_3/1"]
    assert checks[("infiniband", "symbol-errors")] is None
    assert checks[("infiniband", "link-flapped")] == (
        "degraded", "inspect-hardware", "link went down 2 times since the last check (flapping)")
    assert checks[("infiniband", "receive-errors")][:2] == ("degraded", "inspect-hardware")
    assert "11 packets" in checks[("infiniband", "receive-errors")][2]
    assert "25 times" in checks[("infiniband", "link-error-recovery")][2]
    assert checks[("infiniband", "port-down")] is None
    assert all(p is None for p in results["ib:mlx5_2/1"].values())  # the other HCAs are untouched

    write(counters / "symbol_error", "21")  # 11 more than last time
    checks = health.check(read_ports(sysfs))["ib:mlx5_3/1"]
    assert checks[("infiniband", "symbol-errors")][0] == "degraded"
    assert checks[("infiniband", "link-flapped")] is None  # no growth since: passes again


def test_thresholds_are_settable_and_checked():
    with pytest.raises(ValueError, match="symbol-error"):
        IbHealth(error_deltas={"symbol-error": 1})
    with pytest.raises(ValueError, match="link-flapped"):
        IbHealth(error_deltas={"link-flapped": -1})
    ports = read_ports(FIXTURES / "ndr-connectx7" / "sys")
    strict = IbHealth(error_deltas={"symbol-errors": 0})
    assert strict.error_deltas["symbol-errors"] == 0 and strict.error_deltas["receive-errors"] == 10
    strict.check(ports)


def test_counter_going_backwards_is_a_new_baseline(tmp_path):
    """An HCA reset or a driver reload starts the counters from 0: no delta, no alarm; growth after it
    is judged from the new baseline."""
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    counters = port_dir(sysfs, "mlx5_0") / "counters"
    health = IbHealth()
    write(counters / "port_rcv_errors", "5000")
    write(counters / "link_downed", "7")
    health.check(read_ports(sysfs))
    write(counters / "port_rcv_errors", "0")
    write(counters / "link_downed", "0")
    write(counters / "port_rcv_data", "12")
    checks = health.check(read_ports(sysfs))["ib:mlx5_0/1"]
    assert all(problem is None for problem in checks.values())
    write(counters / "port_rcv_errors", "11")
    write(counters / "link_downed", "1")
    checks = health.check(read_ports(sysfs))["ib:mlx5_0/1"]
    assert "11 packets" in checks[("infiniband", "receive-errors")][2]
    assert "1 times" in checks[("infiniband", "link-flapped")][2]


def test_counter_missing_for_a_check_is_no_delta(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    counter = port_dir(sysfs, "mlx5_0") / "counters" / "symbol_error"
    health = IbHealth()
    health.check(read_ports(sysfs))
    write(counter, "N/A (no PMA)")
    assert health.check(read_ports(sysfs))["ib:mlx5_0/1"][("infiniband", "symbol-errors")] is None
    write(counter, "500")  # unknown since the last reading: a baseline
    assert health.check(read_ports(sysfs))["ib:mlx5_0/1"][("infiniband", "symbol-errors")] is None


def test_port_going_down_and_back(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    port = port_dir(sysfs, "mlx5_5")
    health = IbHealth()
    health.check(read_ports(sysfs))
    # The down/ tree's Polling port: a cable pulled or a switch port gone.
    shutil.copy(FIXTURES / "down" / "sys" / CLASS / "mlx4_0" / "ports" / "1" / "state", port / "state")
    shutil.copy(FIXTURES / "down" / "sys" / CLASS / "mlx4_0" / "ports" / "1" / "phys_state", port / "phys_state")
    write(port / "counters" / "link_downed", "1")
    checks = health.check(read_ports(sysfs))["ib:mlx5_5/1"]
    severity, action, message = checks[("infiniband", "port-down")]
    assert (severity, action) == ("unhealthy", "inspect-hardware")
    assert "DOWN" in message and "Polling" in message and "cable" in message and "ibstat mlx5_5" in message
    assert checks[("infiniband", "link-flapped")][0] == "degraded"

    write(port / "state", "4: ACTIVE")
    write(port / "phys_state", "5: LinkUp")
    checks = health.check(read_ports(sysfs))["ib:mlx5_5/1"]
    assert all(problem is None for problem in checks.values())


def test_link_up_but_not_active_names_the_subnet_manager(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    health = IbHealth()
    health.check(read_ports(sysfs))
    write(port_dir(sysfs, "mlx5_1") / "state", "2: INIT")  # kernel ib_port_state 2: no SM brought it up
    severity, _, message = health.check(read_ports(sysfs))["ib:mlx5_1/1"][("infiniband", "port-down")]
    assert severity == "unhealthy" and "subnet manager" in message


def test_port_never_active_is_degraded_and_disabled_port_passes():
    ports = by_subject(read_ports(FIXTURES / "down" / "sys"))
    results = IbHealth().check(list(ports.values()))
    severity, action, message = results["ib:mlx4_0/1"][("infiniband", "port-down")]
    assert (severity, action) == ("degraded", "inspect-hardware") and "since gpud started" in message
    assert results["ib:mlx5_3/1"][("infiniband", "port-down")] is None  # "3: Disabled": an admin's choice


def test_port_disabled_after_active_is_a_choice(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    health = IbHealth()
    health.check(read_ports(sysfs))
    disabled = port_dir(FIXTURES / "down" / "sys", "mlx5_3")
    for name in ("state", "phys_state"):
        shutil.copy(disabled / name, port_dir(sysfs, "mlx5_7") / name)
    assert health.check(read_ports(sysfs))["ib:mlx5_7/1"][("infiniband", "port-down")] is None


def test_forget_starts_a_port_afresh(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    health = IbHealth()
    health.check(read_ports(sysfs))
    health.forget("ib:mlx5_0/1")
    write(port_dir(sysfs, "mlx5_0") / "state", "1: DOWN")
    write(port_dir(sysfs, "mlx5_0") / "phys_state", "2: Polling")
    write(port_dir(sysfs, "mlx5_0") / "counters" / "symbol_error", "99")
    checks = health.check(read_ports(sysfs))["ib:mlx5_0/1"]
    assert checks[("infiniband", "port-down")][0] == "degraded"  # no longer known to have been ACTIVE
    assert checks[("infiniband", "symbol-errors")] is None


# ------------------------------------------------------------------------------------------- metrics

def rendered(ports: list[IbPort]) -> str:
    class Collector:
        def collect(self):
            return families(ports)
    return MetricsRoute(lambda: {"infiniband": Collector()}).render()


def samples(ports: list[IbPort]) -> dict[tuple[str, str, str], float]:
    return {(family.name, s.labels["device"], s.labels["port"]): s.value
            for family in families(ports) for s in family.samples}


def test_families_are_node_exporters():
    ports = read_ports(FIXTURES / "node_exporter" / "sys") + read_ports(FIXTURES / "ndr-connectx7" / "sys")
    written = list(families(ports))
    kinds = {family.name: family.kind for family in written}
    assert set(kinds) <= NODE_EXPORTER_GAUGES | NODE_EXPORTER_COUNTERS
    assert {name for name, kind in kinds.items() if kind == "gauge"} == NODE_EXPORTER_GAUGES
    assert all(kinds[name] == "counter" for name in set(kinds) & NODE_EXPORTER_COUNTERS)
    assert all(set(s.labels) == {"device", "port"} for family in written for s in family.samples)
    # Between them the two trees hold every counter file node_exporter reads: each has its metric.
    assert set(kinds) == NODE_EXPORTER_GAUGES | NODE_EXPORTER_COUNTERS
    values = samples(ports)
    # Values as node_exporter computes them for its own fixture: rate Gb/s x 125000000, data words x 4.
    assert values[("node_infiniband_rate_bytes_per_second", "mlx4_0", "1")] == 5_000_000_000
    assert values[("node_infiniband_rate_bytes_per_second", "i40iw0", "1")] == 1_250_000_000
    assert values[("node_infiniband_rate_bytes_per_second", "mlx5_0", "1")] == 50_000_000_000
    assert values[("node_infiniband_state_id", "mlx4_0", "2")] == 4
    assert values[("node_infiniband_physical_state_id", "mlx4_0", "2")] == 5
    assert values[("node_infiniband_port_data_received_bytes_total", "mlx4_0", "1")] == 18_527_668
    assert values[("node_infiniband_port_data_transmitted_bytes_total", "mlx4_0", "1")] == 14_933_760
    assert values[("node_infiniband_legacy_data_received_bytes_total", "mlx4_0", "1")] == 18_527_668
    assert values[("node_infiniband_legacy_unicast_packets_received_total", "mlx4_0", "2")] == 61148
    assert values[("node_infiniband_port_transmit_wait_total", "mlx4_0", "1")] == 4294967295
    assert values[("node_infiniband_port_discards_transmitted_total", "mlx4_0", "1")] == 5
    assert values[("node_infiniband_vl15_dropped_total", "mlx5_0", "1")] == 0
    assert values[("node_infiniband_symbol_error_total", "mlx5_7", "1")] == 0
    assert values[("node_infiniband_port_packets_received_total", "mlx5_0", "1")] == 801977655075
    # i40iw0's counters all read "N/A (no PMA)": its port has its gauges and no counter at all.
    assert {name for name, device, _ in values if device == "i40iw0"} == NODE_EXPORTER_GAUGES


def test_families_leave_out_what_was_not_read(tmp_path):
    sysfs = tree("ndr-connectx7", tmp_path) / "sys"
    write(port_dir(sysfs, "mlx5_0") / "rate", "garbage")
    write(port_dir(sysfs, "mlx5_0") / "state", "garbage")
    values = samples(read_ports(sysfs))
    assert ("node_infiniband_rate_bytes_per_second", "mlx5_0", "1") not in values
    assert ("node_infiniband_state_id", "mlx5_0", "1") not in values
    assert values[("node_infiniband_physical_state_id", "mlx5_0", "1")] == 5
    assert values[("node_infiniband_rate_bytes_per_second", "mlx5_1", "1")] == 50_000_000_000
    assert list(families([])) == []


def test_exposition_passes_promtool():
    ports = (read_ports(FIXTURES / "node_exporter" / "sys") + read_ports(FIXTURES / "ndr-connectx7" / "sys")
             + read_ports(FIXTURES / "roce" / "sys") + read_ports(FIXTURES / "down" / "sys"))
    text = rendered(ports)
    assert 'node_infiniband_link_downed_total{device="mlx5_bond_0",port="1"} 0' in text
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not IN_CI, "CI installs Debian's prometheus package (promtool)"
        pytest.skip("promtool is not installed: the exposition was not checked by Prometheus's own parser")
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=60)
    assert "error while linting" not in checked.stderr and "text format parsing error" not in checked.stderr, \
        checked.stderr
    # Names, types and help of node_exporter's collector pass promtool's lint as they pass node_exporter's.
    assert checked.returncode == 0, checked.stdout + checked.stderr


# ------------------------------------------------------------------------------------ GPUDirect RDMA

# /proc/driver/nvidia/version of the open flavor, Ubuntu 24.04 with nvidia-driver-565-open
# (nix-community/nixGL issue 186), and the proprietary flavor's first line as NVIDIA's kernel_open README
# gives it (quoted in NVIDIA/open-gpu-kernel-modules issue 171).
OPEN_VERSION = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  565.57.01  Release Build  "
                "(dvs-builder@U16-A24-9-2)  Thu Oct 10 12:15:00 UTC 2024\n"
                "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n")
PROPRIETARY_VERSION = "NVRM version: NVIDIA UNIX x86_64 Kernel Module\n"
# /proc/modules lines in the kernel's format (name size refcount users state address, proc(5)).
NVIDIA_MODULES = ("nvidia_uvm 4956160 0 - Live 0x0000000000000000 (POE)\n"
                  "nvidia 54358016 1 nvidia_uvm, Live 0x0000000000000000 (POE)\n"
                  "mlx5_ib 495616 0 - Live 0x0000000000000000\n")
PEERMEM = "nvidia_peermem 16384 0 - Live 0x0000000000000000 (POE)\n"


def procfs(tmp_path: Path, modules: str | None, version: str | None = PROPRIETARY_VERSION,
           release: str | None = "5.15.0-91-generic") -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    if modules is not None:
        write(root / "modules", modules.rstrip("\n"))
    if version is not None:
        (root / "driver" / "nvidia").mkdir(parents=True)
        (root / "driver" / "nvidia" / "version").write_text(version)
    if release is not None:
        (root / "sys" / "kernel").mkdir(parents=True)
        write(root / "sys" / "kernel" / "osrelease", release)
    return root


def test_peermem_missing_with_infiniband_says_what_to_do(tmp_path):
    ports = read_ports(FIXTURES / "ndr-connectx7" / "sys")
    message = peermem_problem(procfs(tmp_path, NVIDIA_MODULES), ports)
    assert message is not None
    assert "nvidia_peermem" in message and "modprobe nvidia-peermem" in message and "mlx5_0" in message
    assert "proprietary" in message


def test_peermem_loaded_passes(tmp_path):
    ports = read_ports(FIXTURES / "ndr-connectx7" / "sys")
    assert peermem_problem(procfs(tmp_path, NVIDIA_MODULES + PEERMEM), ports) is None


def test_dmabuf_replaces_peermem_with_open_modules_on_recent_kernels(tmp_path):
    ports = read_ports(FIXTURES / "roce" / "sys")
    (tmp_path / "new").mkdir()
    assert peermem_problem(procfs(tmp_path / "new", NVIDIA_MODULES, OPEN_VERSION, "6.8.0-45-generic"), ports) is None
    (tmp_path / "old").mkdir()
    message = peermem_problem(procfs(tmp_path / "old", NVIDIA_MODULES, OPEN_VERSION, "5.4.0-150-generic"), ports)
    assert message is not None and "Linux 5.4" in message
    (tmp_path / "unknown").mkdir()
    message = peermem_problem(procfs(tmp_path / "unknown", NVIDIA_MODULES, OPEN_VERSION, None), ports)
    assert message is not None and "unknown kernel" in message


def test_peermem_not_judged_without_hca_driver_or_modules(tmp_path):
    ports = read_ports(FIXTURES / "ndr-connectx7" / "sys")
    (tmp_path / "a").mkdir()
    assert peermem_problem(procfs(tmp_path / "a", NVIDIA_MODULES), []) is None  # no RDMA device
    (tmp_path / "b").mkdir()
    assert peermem_problem(procfs(tmp_path / "b", None), ports) is None  # /proc/modules unreadable
    (tmp_path / "c").mkdir()
    assert peermem_problem(procfs(tmp_path / "c", "mlx5_ib 495616 0 - Live 0x0000000000000000\n"), ports) is None
    (tmp_path / "d").mkdir()
    root = procfs(tmp_path / "d", None)
    (root / "modules").write_bytes(b"\xff\xfe garbage")
    assert peermem_problem(root, ports) is None
