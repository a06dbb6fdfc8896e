"""systemd integration: sd_notify (READY, STATUS, WATCHDOG, RELOADING, STOPPING).

The notify socket and watchdog settings are read once and removed from the environment, so
children (MPS daemons, nvidia-smi, hooks) do not inherit them and talk to systemd as if they
were gpud. Without systemd every call is a no-op.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Callable

from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger

log = get_logger("systemd")
_INHERITED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
SD_LISTEN_FDS_START = 3


def inherited_socket(environ: dict[str, str] | None = None) -> socket.socket | None:
    """The listening socket systemd passed (socket activation, gpud.socket), or None.

    LISTEN_* leave the environment either way, so no child mistakes the socket for its own."""
    env = os.environ if environ is None else environ
    pid, count = env.pop("LISTEN_PID", None), env.pop("LISTEN_FDS", None)
    env.pop("LISTEN_FDNAMES", None)
    if pid != str(os.getpid()) or not count or int(count) < 1:
        return None
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    sock.setblocking(False)
    return sock


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET")
        watchdog_usec = env.get("WATCHDOG_USEC")
        watchdog_pid = env.get("WATCHDOG_PID")
        for key in _INHERITED:
            env.pop(key, None)
        self._address = ("\0" + address[1:]) if address and address.startswith("@") else address
        self._socket: socket.socket | None = None
        if self._address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        ours = watchdog_pid is None or watchdog_pid == str(os.getpid())
        self.watchdog_interval_s = int(watchdog_usec) / 2e6 if watchdog_usec and ours else None
        self._status: str | None = None

    @property
    def active(self) -> bool:
        return self._socket is not None

    def send(self, *lines: str) -> None:
        if self._socket is None:
            return
        try:
            self._socket.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:  # systemd gone (e.g. during shutdown): nothing to tell
            log.debug("sd_notify_failed", error=str(exc))

    def ready(self, status: str) -> None:
        self._status = status
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        if status != self._status:
            self._status = status
            self.send(f"STATUS={status}")

    def reloading(self) -> None:
        # MONOTONIC_USEC in the same datagram: systemd 253+ tracks the reload with it; older ignore it.
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping")

    async def watchdog(self) -> None:
        """Pings at half the watchdog interval, from the event loop: a blocked loop trips it."""
        if self.watchdog_interval_s is None:
            return
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval_s)


class SystemdStatus(Component):
    """READY=1 once the API answers and the first inventory is in (or NVML said why it is not: gpud serves
    503 then, and systemd must not time the start out), STATUS on changes, STOPPING=1 first at a stop."""

    name = "systemd-status"

    def __init__(self, notifier: Notifier, ready: Callable[[], bool], status_line: Callable[[], str]):
        self.notifier, self._ready, self._status_line = notifier, ready, status_line

    async def start(self, tasks: Tasks) -> None:
        tasks.spawn(self._report(), "status")

    async def _report(self) -> None:
        while not self._ready():
            await asyncio.sleep(0.05)
        self.notifier.ready(self._status_line())
        log.info("ready", status=self._status_line())
        while True:
            await asyncio.sleep(1.0)
            self.notifier.status(self._status_line())

    async def stop(self) -> None:
        self.notifier.stopping()
