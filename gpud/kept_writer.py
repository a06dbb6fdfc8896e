"""A file gpud keeps current from what it knows (the CDI spec, Slurm's gres.conf): rebuilt shortly after
every inventory, MIG, MPS or sharing change (and every inventory refresh), written only when its content
changes, by a rename (safefs.KeptFile), so a reader never sees half a file. While a GPU reset is under
way (InventoryService.transition: the MIG instances it destroys are not made again yet) it waits, and writes
from the snapshot after it: a reset alone never takes devices out of the file.

A directory refused or unwritable is reported (log once per cause, the view's `error`, /healthz) and
tried again every RECHECK_S, and said in /metrics (gpud_file_write_failing). Every RECHECK_S the file is also compared with what gpud wrote: one
swapped, edited, linked or chmodded behind gpud's back is reported, counted and rewritten."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from gpud.base.lifecycle import Component, Tasks
from gpud.base.loops import within
from gpud.base.samples import Family
from gpud.base.safefs import KeptFile, UnsafePath
from gpud.events import CLOSED, EventBus
from gpud.inventory import InventoryService
from gpud.model.dcgm_labels import HOSTNAME

WATCHED_EVENTS = frozenset({"inventory", "mig", "mps", "sharing"})
DEBOUNCE_S = 0.15  # changes arrive in bursts (a MIG apply: mig, inventory, sharing, mps): one write
# How often a directory refused or unwritable is tried again, and the file compared with what gpud
# wrote: one walk from / to the directory, a stat and a read of the file each time.
RECHECK_S = 2.0


def file_write_failing(file: str, path: Path | None, error: str | None) -> Iterator[Family]:
    """1 while gpud cannot write a file it keeps for others (the last write failed), 0 once one succeeds;
    no series where the file is not kept (no path). `file` names the component that keeps it."""
    family = Family("gpud_file_write_failing", "1 while gpud cannot write a file it keeps for another program "
                                               "(the CDI spec, NFD's features, gres.conf): the reason is in /healthz.",
                    "gauge")
    if path is not None:
        family.add({"hostname": HOSTNAME, "file": file, "path": str(path)}, 1 if error else 0)
    yield family


class KeptFileWriter(Component):
    """Subclasses say what the file holds (build), how it is written (write) and what a write logs (written).
    path None: no file, the content is only built (served by the API)."""

    event = "file"  # the log events' prefix: <event>_not_written, <event>_changed_behind_gpud
    setting = ""  # the config key that names the file's place, for the error's remedy
    rewrite_why = ""  # why a file changed behind gpud's back is rewritten
    not_written_consequence = ""

    def __init__(self, path: Path | None, mode: int, inventory: InventoryService, bus: EventBus, log):
        self.path = path
        self._file = KeptFile(path, mode) if path else None
        self._inventory = inventory
        self._bus = bus
        self._log = log
        self.content: Any = None  # what the file holds now (None: nothing built or written by this gpud)
        self.written_at: float | None = None
        self.error: str | None = None  # why the last write failed; None once one succeeds
        # changes to the file made behind gpud's back, each reported and undone
        self.changed_behind_gpud = {"count": 0, "last": None, "at": None}
        self._reasons: set[str] = set()
        self._changed = asyncio.Event()
        self._refreshing = threading.Lock()
        inventory.subscribe(lambda _inventory: self._mark("inventory"))

    async def start(self, tasks: Tasks) -> None:
        tasks.spawn(self.run(), self.name)

    def problems(self) -> list[str]:
        return [self.error] if self.error else []

    def collect(self) -> Iterator[Family]:
        return file_write_failing(self.name, self.path, self.error)

    def build(self, inventory) -> Any:
        raise NotImplementedError

    def write(self, file: KeptFile, content: Any) -> None:
        raise NotImplementedError

    def written(self, content: Any, reason: str) -> None:
        """After a write that succeeded (or, without a file, a content that changed); on refresh's thread."""

    def _mark(self, reason: str) -> None:
        self._reasons.add(reason)
        self._changed.set()

    async def run(self) -> None:
        follower = asyncio.create_task(self._follow_events(), name=f"{self.event}-events")
        try:
            while True:
                try:
                    await within(self._changed.wait(), RECHECK_S)
                except asyncio.TimeoutError:
                    await asyncio.to_thread(self.recheck)
                    continue
                await asyncio.sleep(DEBOUNCE_S)
                if self._inventory.transition is not None:  # the snapshot after it is the one to write
                    self._log.info(f"{self.event}_write_waits", path=str(self.path), until=self._inventory.transition)
                while self._inventory.transition is not None:
                    await asyncio.sleep(DEBOUNCE_S)
                self._changed.clear()
                reasons, self._reasons = self._reasons, set()
                await asyncio.to_thread(self.refresh, ",".join(sorted(reasons)))
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    async def _follow_events(self) -> None:
        """Marks the file stale on every watched event; a subscription cut off for falling behind is renewed."""
        while True:
            subscription = self._bus.subscribe()
            try:
                while isinstance(item := await subscription.queue.get(), tuple):
                    if item.type in WATCHED_EVENTS:
                        self._mark(item.type)
            finally:
                self._bus.unsubscribe(subscription)
            if item == CLOSED:
                return
            self._mark("events overflowed")

    def recheck(self) -> None:
        """Tries a refused or failed write again; else undoes any change made to the file behind gpud's back."""
        if self._file is None:
            return
        if self.error is not None:
            self.refresh("recheck after an error")
            return
        try:
            change = self._file.changed()
        except OSError as exc:  # the directory itself changed hands or mode: refused from now on
            self._failed(exc, "recheck")
            return
        if change is None:
            return
        self.changed_behind_gpud = {"count": self.changed_behind_gpud["count"] + 1, "last": change, "at": time.time()}
        self._log.warning(f"{self.event}_changed_behind_gpud", path=str(self.path), change=change,
                          count=self.changed_behind_gpud["count"], action="gpud rewrites it", why=self.rewrite_why)
        self.refresh("changed behind gpud's back", rewrite=True)

    def refresh(self, reason: str, rewrite: bool = False) -> None:
        """Rebuilds the content and writes it if it changed (or `rewrite`); never raises for a directory it
        cannot write. Called on a thread (a build scans /dev, reads driver files), by run() and by a caller
        that needs the file at once: one at a time."""
        with self._refreshing:
            self._refresh(reason, rewrite)

    def _refresh(self, reason: str, rewrite: bool) -> None:
        inventory = self._inventory.current
        if inventory is None:
            return
        content = self.build(inventory)
        if content == self.content and self.error is None and not rewrite:
            return
        if self._file is not None:
            try:
                self.write(self._file, content)
            except OSError as exc:
                self._failed(exc, reason)
                return
            self.written_at = time.time()
        self.content, self.error = content, None
        self.written(content, reason)

    def _failed(self, exc: OSError, reason: str) -> None:
        error = (f"cannot write {self.path}: {exc if isinstance(exc, UnsafePath) else exc.strerror or exc}; "
                 f"gpud tries again every {RECHECK_S:g} s ({self.setting})")
        if error != self.error:  # once per cause, not every recheck
            self._log.error(f"{self.event}_not_written", path=str(self.path), error=str(exc), reason=reason,
                            consequence=self.not_written_consequence, retry_every_s=RECHECK_S)
        self.error = error
