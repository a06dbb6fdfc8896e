"""The gpud the benchmarks measure: `gpud serve` on a simulated node, in a private directory."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def simulated_gpud(preset: str = "dgx-a100", config: Path | None = None) -> Iterator[tuple[subprocess.Popen, Path]]:
    """The gpud process and its socket, once it listens; stopped and cleaned up afterwards."""
    workdir = Path(tempfile.mkdtemp(prefix="gb", dir="/tmp"))  # short: socket paths hold 108 bytes
    sock = workdir / "g.sock"
    config_args = ["--config", str(config)] if config else []
    gpud = subprocess.Popen([sys.executable, "-m", "gpud", "serve", "--simulate", preset, "--sim-state",
                             str(workdir / "sim.json"), "--state-dir", str(workdir / "state"), "--socket", str(sock),
                             "--log-level", "error", *config_args], cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        wait_until_listening(sock, gpud)
        yield gpud, sock
    finally:
        gpud.terminate()
        gpud.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def wait_until_listening(path: Path, server: subprocess.Popen, timeout: float = 30.0) -> None:
    """Until server accepts connections on the Unix socket path. Its file appears at bind(2), before
    listen(2), and a connect in between is refused (linux net/unix/af_unix.c, unix_stream_connect:
    ECONNREFUSED unless the peer is TCP_LISTEN): bench/api.py's first measurement was, once in CI."""

    def listening() -> bool:
        if server.poll() is not None:
            raise SystemExit(f"{server.args[0]} exited ({server.returncode}) before it listened on {path}")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        return True

    wait(listening, timeout, f"{server.args[0]} to listen on {path}")


def wait(predicate, timeout: float, what: str, interval: float = 0.05):
    """predicate()'s first truthy answer, asked every interval; the benchmark gives up after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(interval)
    raise SystemExit(f"gave up waiting for {what}")
