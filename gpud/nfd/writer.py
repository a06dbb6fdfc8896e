"""Keeps NFD's feature file current: rewritten (whole, by rename) within a second of every change of
the labels, and every half expiry period besides.

Changes arrive on the event bus (MIG, health, sharing, inventory) and are written after a short quiet
time, so one MIG apply that moves many devices is one write. Every label expires (the file's
`# +expiry-time`) one period after the write: the refresh at half the period keeps them, and a gpud
that stopped or hangs leaves labels NFD drops once they expire, not a `gpu.health=healthy` forever.

The file is kept only in a directory no other user controls (safefs.KeptFile): one refused is
reported and tried again every RETRY_INTERVAL_S. Every RECHECK_S the file is compared with what
gpud wrote: one changed behind gpud's back (edited, swapped, linked, chmodded) is reported, counted
and rewritten.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Awaitable, Callable, Iterator

from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.base.loops import within
from gpud.base.safefs import KeptFile, UnsafePath
from gpud.base.samples import Family
from gpud.config import NfdConfig
from gpud.events import CLOSED, OVERFLOW, EventBus
from gpud.kept_writer import file_write_failing
from gpud.nfd.labels import HEADER, feature_file

log = get_logger("nfd")

QUIET_S = 0.15  # changes of one burst (a MIG apply, an XID on every MIG device) make one write
# How often a file not written yet (NFD's directory missing, a failed write) is tried again. Changes
# themselves arrive as events: every part whose state is labelled publishes on the bus.
RETRY_INTERVAL_S = 1.0
# How often the file is compared with what gpud wrote: one walk from / to the directory, a stat and a
# read of the file (at most NFD's 64 KiB) each time. The wall clock can jump (NTP, a suspended VM):
# the refresh is due by it, so it is re-read this often too instead of trusting one long sleep.
RECHECK_S = 2.0


class NfdWriter(Component):
    """Turned off (nfd.enabled false), it writes nothing and removes gpud's own old file at path, so
    NFD stops publishing labels nothing keeps current."""

    name = "nfd"

    def __init__(self, path: Path, labels: Callable[[], Awaitable[dict[str, str] | None]], bus: EventBus, *,
                 enabled: bool = True, create_directory: bool = True, expiry_s: float = NfdConfig.expiry_s):
        self.path = path
        self.enabled = enabled
        self.expiry_s = expiry_s
        # False for NFD's own features.d: where it is missing, NFD is not installed, and gpud waits
        # for it (checked every RETRY_INTERVAL_S) instead of making it or calling that a fault.
        self._create_directory = create_directory
        # nfd-worker skips names starting with "." (source/local/local.go getFeaturesFromFiles), and
        # NFD's guide asks for a temporary file renamed over the old one (customization-guide.md "Local
        # feature source" note): KeptFile's hidden temporary file is exactly that. Mode 0644: labels are
        # no secret, and nfd-worker may not run as root.
        self._file = KeptFile(path, 0o644, create_directory=create_directory)
        self._labels = labels  # None while there is no inventory: nothing is written then
        self._bus = bus
        self._written: dict[str, str] | None = None  # the labels the file holds, as gpud last wrote it
        self._refresh_at = 0.0  # Unix time: the file is rewritten from then on, labels changed or not
        self._document = {"enabled": enabled, "path": str(path), "labels": {}, "dropped": [], "bytes": 0,
                          "written_at": None, "expires_at": None, "error": None, "waiting": None,
                          "changed_behind_gpud": {"count": 0, "last": None, "at": None}}

    @property
    def problem(self) -> str | None:
        """Why the file is not current (for /healthz), None when it is."""
        error = self._document["error"]
        return f"the NFD feature file {self.path} is not current: {error}" if error else None

    def problems(self) -> list[str]:
        return [self.problem] if self.problem else []

    def collect(self) -> Iterator[Family]:
        """Turned off, gpud keeps no file: no series."""
        return file_write_failing(self.name, self.path if self.enabled else None, self._document["error"])

    async def start(self, tasks: Tasks) -> None:
        tasks.spawn(self.run(), "nfd")

    def view(self) -> dict:
        """GET /v1/nfd: what the file holds, what was left out of it and why, the last write error."""
        return self._document

    async def run(self) -> None:
        if not self.enabled:
            self._remove_own_file()
            return
        subscription = self._bus.subscribe()
        try:
            while True:
                await self.write_if_changed()
                try:
                    first = await within(subscription.queue.get(), self._next_wake())
                except asyncio.TimeoutError:
                    continue
                await asyncio.sleep(QUIET_S)
                burst = [first, *_drain(subscription.queue)]
                if CLOSED in burst:  # gpud is stopping
                    return
                if OVERFLOW in burst:  # the bus cut this queue off: a new one
                    subscription = self._bus.subscribe()
        finally:
            self._bus.unsubscribe(subscription)

    def _next_wake(self) -> float | None:
        """Seconds until the writer looks again without an event: soon while the file is not written,
        at the refresh or the next comparison otherwise; None before there is anything to write."""
        if self._document["waiting"] or self._document["error"]:
            return RETRY_INTERVAL_S
        if self._written is None:
            return None
        return min(max(self._refresh_at - time.time(), 0.0), RECHECK_S)

    async def write_if_changed(self) -> None:
        """Writes the file when the labels changed or the refresh is due."""
        labels = await self._labels()
        if labels is None:
            return
        now = time.time()
        refresh = labels == self._written
        if refresh and now < self._refresh_at and not self._document["error"] and not await self._changed():
            return
        expires_at = now + self.expiry_s
        text, dropped = feature_file(labels, expires_at)
        try:
            await asyncio.to_thread(self._file.write, text.encode())
        except FileNotFoundError as exc:
            if self._create_directory:
                self._failed(exc)
                return
            waiting = f"{self.path.parent} does not exist: NFD is not installed here; the file is written once it is"
            if self._document["waiting"] != waiting:
                log.info("nfd_file_waiting", path=str(self.path), why=waiting)
                self._document = {**self._document, "waiting": waiting}
            return
        except OSError as exc:
            self._failed(exc)
            return
        self._written, self._refresh_at = labels, now + self.expiry_s / 2
        self._document = {**self._document, "bytes": len(text.encode()), "written_at": now,
                          "expires_at": int(expires_at), "error": None, "waiting": None}
        if refresh:  # the same labels, a later expiry: routine, every half period
            log.debug("nfd_file_refreshed", path=str(self.path), expires_at=int(expires_at))
            return
        for entry in dropped:
            log.error("nfd_label_dropped", label=entry.label, value=entry.value, reason=entry.reason,
                      path=str(self.path))
        written = {name: value for name, value in labels.items() if name not in {d.label for d in dropped}}
        log.info("nfd_file_written", path=str(self.path), labels=len(written), dropped=len(dropped),
                 expires_at=int(expires_at), mig_config=written.get("nvidia.com/mig.config"),
                 health=written.get("nvidia.com/gpu.health"))
        self._document = {**self._document, "labels": dict(sorted(written.items())),
                          "dropped": [entry._asdict() for entry in dropped]}

    async def _changed(self) -> bool:
        """Whether the file differs from what gpud wrote (reported and counted when it does), or its
        directory is no longer safe (reported as a failed write)."""
        try:
            change = await asyncio.to_thread(self._file.changed)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and not self._create_directory:
                return True  # NFD's directory went away: the write says so ("waiting")
            self._failed(exc)
            return False
        if change is None:
            return False
        seen = self._document["changed_behind_gpud"]
        self._document = {**self._document, "changed_behind_gpud": {"count": seen["count"] + 1, "last": change,
                                                                    "at": time.time()}}
        log.warning("nfd_file_changed_behind_gpud", path=str(self.path), change=change, count=seen["count"] + 1,
                    action="gpud rewrites it", why="NFD would publish labels gpud did not compute")
        return True

    def _failed(self, exc: OSError) -> None:
        error = (f"{exc if isinstance(exc, UnsafePath) else exc.strerror or exc}; gpud tries again every "
                 f"{RETRY_INTERVAL_S:g} s (nfd.features_file)")
        if self._document["error"] != error:  # once per cause, not once a second
            log.error("nfd_file_not_written", path=str(self.path), error=str(exc),
                      consequence="NFD keeps publishing the labels of the last file written")
        self._document = {**self._document, "error": error}

    def _remove_own_file(self) -> None:
        """Removes the file at path when gpud wrote it (its header says so), never another's."""
        try:
            if (self._file.read_head(len(HEADER.encode())) or b"").decode(errors="replace") == HEADER:
                self._file.remove()
                log.info("nfd_file_removed", path=str(self.path), why="nfd.enabled is false")
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("nfd_file_not_removed", path=str(self.path), error=str(exc),
                      consequence="NFD keeps publishing the labels of gpud's last file")


def _drain(queue: asyncio.Queue) -> list:
    return [queue.get_nowait() for _ in range(queue.qsize())]
