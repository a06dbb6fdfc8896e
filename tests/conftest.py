"""Shared test helpers: short socket directories, and gpud run as a real process."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpud.client import Client, DaemonUnreachable

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI") == "true"


def real_nvml_library_present() -> bool:
    """NVIDIA's real libnvidia-ml loads here (Debian's libnvidia-ml1: NVML without a driver)."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.fixture
def short_tmp():
    """A directory with a short path: Unix socket paths are limited to 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gpt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class GpudProcess:
    """`gpud serve` as a child process, with its JSON log lines collected in a file."""

    def __init__(self, workdir: Path, *args: str, env: dict | None = None):
        self.workdir = workdir
        self.socket = workdir / "gpud.sock"
        self.log_path = workdir / f"gpud-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "gpud", "serve", "--socket", str(self.socket), "--log-format", "json",
               "--state-dir", str(workdir / "state"), *args]
        self._log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=REPO)
        self.client = Client(self.socket, timeout=10)

    def wait_for(self, predicate, timeout: float = 20.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gpud exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                last = predicate()
                if last:
                    return last
            except DaemonUnreachable as exc:
                last = exc
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what} (last: {last!r}):\n{self.log_text()}")

    def wait_healthy(self, timeout: float = 20.0):
        return self.wait_for(lambda: self.client.request("GET", "/healthz", ok_statuses=(503,))[0] == 200,
                             timeout, "healthz 200")

    def log_text(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log_path.read_text()

    def log_events(self) -> list[dict]:
        events = []
        for line in self.log_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
        return events

    def stop(self, sig=signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log_file.close()


@pytest.fixture
def run_gpud(short_tmp):
    started: list[GpudProcess] = []

    def start(*args: str, env: dict | None = None) -> GpudProcess:
        process = GpudProcess(short_tmp, *args, env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.proc.poll() is None:
            process.proc.kill()
            process.proc.wait()
