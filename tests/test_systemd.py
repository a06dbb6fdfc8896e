"""sd_notify as systemd sees it: a real datagram socket stands where systemd's would."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import IN_CI, REPO, real_nvml_library_present

from gpud.client import Client, DaemonUnreachable


@pytest.fixture
def notify_socket(short_tmp):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = short_tmp / "notify"
    sock.bind(str(path))
    sock.settimeout(10)
    yield sock, path
    sock.close()


def receive_until(sock, wanted: str, timeout: float = 10.0) -> list[str]:
    """Messages (each a list of KEY=VALUE lines) until one holds `wanted`."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = sock.recv(4096).decode().split("\n")
        seen.append(lines)
        if any(line.startswith(wanted) for line in lines):
            return lines
    raise AssertionError(f"no {wanted} in {seen}")


def test_ready_status_watchdog_reload_and_stopping(run_gpud, short_tmp, notify_socket):
    sock, path = notify_socket
    env_dump = short_tmp / "hook-env"
    config = short_tmp / "gpud.yaml"
    config.write_text(f"mig:\n  layouts_file: {short_tmp / 'none.yaml'}\n  hooks:\n    pre_apply: ['env > {env_dump}']\n")
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:2", "--sim-state", str(short_tmp / "sim.json"),
                    "--config", str(config), env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"})
    ready = receive_until(sock, "READY=1")
    status = next(line for line in ready if line.startswith("STATUS="))
    assert status == "STATUS=2 GPUs · healthy"
    receive_until(sock, "WATCHDOG=1")
    started = time.monotonic()
    receive_until(sock, "WATCHDOG=1")
    assert time.monotonic() - started < 0.4  # every half of WATCHDOG_USEC

    gpud.client.request("PUT", "/v1/mig?wait=true", {"layout": "all-balanced"})
    changed = receive_until(sock, "STATUS=2 GPUs · MIG")
    assert "STATUS=2 GPUs · MIG all-balanced in sync · healthy" in changed
    assert "NOTIFY_SOCKET" not in env_dump.read_text() and "WATCHDOG_USEC" not in env_dump.read_text()

    gpud.proc.send_signal(signal.SIGHUP)
    reloading = receive_until(sock, "RELOADING=1")
    assert any(line.startswith("MONOTONIC_USEC=") for line in reloading)  # in the same datagram
    receive_until(sock, "READY=1")
    gpud.proc.send_signal(signal.SIGTERM)
    receive_until(sock, "STOPPING=1")
    assert gpud.proc.wait(10) == 0


def test_ready_comes_even_without_a_driver(run_gpud, short_tmp, notify_socket):
    """With no NVML, gpud still starts (and says why in STATUS): systemd must not time it out."""
    if not real_nvml_library_present():
        pytest.skip("libnvidia-ml.so.1 is not installed")
    sock, path = notify_socket
    run_gpud(env={"NOTIFY_SOCKET": str(path)})
    ready = receive_until(sock, "READY=1")
    assert any(line.startswith("STATUS=") and "Driver Not Loaded" in line for line in ready)


@pytest.mark.parametrize("unit", ["gpud.service", "gpud-device-plugin.service"])
def test_the_units_pass_systemd_analyze_verify(tmp_path, unit):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if IN_CI:
            pytest.fail("CI must have systemd-analyze (package systemd)")
        pytest.skip("systemd-analyze is not installed")
    # A root holding the OS's units, the packaged units, the binaries they name and the directory the
    # device plugin's condition wants, as a package installs them on a Kubernetes node.
    shutil.copytree("/usr/lib/systemd/system", tmp_path / "usr/lib/systemd/system", symlinks=True)
    for binary in ("usr/bin/gpud", "bin/kill"):
        (tmp_path / binary).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / binary).write_text("#!/bin/sh\n")
        (tmp_path / binary).chmod(0o755)
    (tmp_path / "var/lib/kubelet/device-plugins").mkdir(parents=True)
    unit_dir = tmp_path / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    for packaged in ("gpud.service", "gpud-device-plugin.service"):
        shutil.copy(REPO / "systemd" / packaged, unit_dir)
    result = subprocess.run([analyze, "verify", "--man=no", f"--root={tmp_path}", f"/etc/systemd/system/{unit}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_socket_activation_serves_on_the_inherited_socket(short_tmp):
    """As systemd starts gpud from gpud.socket: a listening socket at fd 3, LISTEN_PID and LISTEN_FDS."""
    path = short_tmp / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    fd = listener.fileno()
    command = (f'exec 3<&{fd}; LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" -m gpud serve --simulate t4 '
               f'--sim-state {short_tmp}/sim.json --state-dir {short_tmp}/state --socket {short_tmp}/unused.sock '
               f'--log-format json')
    log = (short_tmp / "activated.log").open("w")
    proc = subprocess.Popen(["bash", "-c", command, sys.executable], pass_fds=[fd], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)
    listener.close()  # gpud holds it now
    try:
        client = Client(path, timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if client.request("GET", "/healthz", ok_statuses=(503,))[0] == 200:
                    break
            except DaemonUnreachable:
                pass
            time.sleep(0.05)
        assert client.get("/v1/gpus")["gpus"][0]["name"] == "Tesla T4"
        assert not (short_tmp / "unused.sock").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert path.exists()  # the socket is systemd's: gpud leaves it in place
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_the_socket_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit_dir = tmp_path / "etc/systemd/system"
    shutil.copytree("/usr/lib/systemd/system", tmp_path / "usr/lib/systemd/system", symlinks=True)
    unit_dir.mkdir(parents=True)
    for binary in ("usr/bin/gpud", "bin/kill"):
        (tmp_path / binary).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / binary).write_text("#!/bin/sh\n")
        (tmp_path / binary).chmod(0o755)
    for unit in ("gpud.service", "gpud.socket"):
        shutil.copy(REPO / "systemd" / unit, unit_dir)
    result = subprocess.run([analyze, "verify", "--man=no", f"--root={tmp_path}", "/etc/systemd/system/gpud.socket"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
