"""Keeps the CDI spec file current: rebuilt shortly after every inventory, MIG, MPS or sharing change
(and every inventory refresh, which also notices device nodes that appeared or went), written only
when its content changes, by a rename, so a runtime never reads half a file. When gpud stops, the
last spec stays: the devices it names are still there for containers started meanwhile.

The spec names hooks a runtime runs as root, so it is kept only in a directory no other user
controls (safefs.KeptFile): one refused is reported (log, /v1/cdi, /healthz) and looked at again
every RECHECK_S, and the spec is written once the operator fixed it. Every RECHECK_S the file is
also compared with what gpud wrote: a spec swapped, edited, linked or chmodded behind gpud's back
is reported, counted and rewritten."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Callable, Mapping

from gpud.cdi.driver_files import find_driver_files, host_ldconfig
from gpud.cdi.spec import KIND, SPEC_FILE, build_spec, read_host_devices
from gpud.events import CLOSED, EventBus
from gpud.inventory import InventoryService
from gpud.logs import get_logger
from gpud.safefs import KeptFile, UnsafePath
from gpud.sharing.service import SharingView

log = get_logger("cdi")
WATCHED_EVENTS = frozenset({"inventory", "mig", "mps", "sharing"})
DEBOUNCE_S = 0.15  # changes arrive in bursts (a MIG apply: mig, inventory, sharing, mps): one write
# How often the spec directory refused or unwritable is tried again, and the spec compared with what
# gpud wrote: one walk from / to the directory, a stat and a read of the spec each time.
RECHECK_S = 2.0


class CdiWriter:
    def __init__(self, spec_dir: Path, dev_root: Path, mig_minors_path: Path, inventory: InventoryService,
                 sharing: SharingView, mps_clients: Callable[[], Mapping[str, dict]], bus: EventBus,
                 driver_root: Path | None = None):
        self.path = spec_dir / SPEC_FILE
        # 0644: runtimes run as other users too (rootless podman reads it)
        self._file = KeptFile(self.path, 0o644)
        self._dev_root = dev_root
        self._driver_root = driver_root  # None: the driver's files are left to something else
        self._ldconfig = host_ldconfig()
        self._missing_drivers: set[str] = set()
        self._mig_minors_path = mig_minors_path
        self._inventory = inventory
        self._sharing = sharing
        self._mps_clients = mps_clients
        self._bus = bus
        self.spec: dict | None = None  # what the file holds now (None: no file written by this gpud)
        self.unavailable: list[dict] = []
        self.written_at: float | None = None
        self.error: str | None = None  # why the last write failed; None once one succeeds
        # changes to the spec made behind gpud's back, each reported and undone
        self.changed_behind_gpud = {"count": 0, "last": None, "at": None}
        self._reasons: set[str] = set()
        self._changed = asyncio.Event()
        inventory.subscribe(lambda _inventory: self._mark("inventory"))

    def view(self) -> dict:
        """GET /v1/cdi."""
        return {"enabled": True, "kind": KIND, "path": str(self.path), "written_at": self.written_at,
                "error": self.error, "devices": [device["name"] for device in (self.spec or {}).get("devices", [])],
                "unavailable": self.unavailable, "spec": self.spec, "changed_behind_gpud": self.changed_behind_gpud}

    def _mark(self, reason: str) -> None:
        self._reasons.add(reason)
        self._changed.set()

    async def run(self) -> None:
        follower = asyncio.create_task(self._follow_events(), name="cdi-events")
        try:
            while True:
                try:
                    await asyncio.wait_for(self._changed.wait(), RECHECK_S)
                except asyncio.TimeoutError:
                    self.recheck()
                    continue
                await asyncio.sleep(DEBOUNCE_S)
                self._changed.clear()
                reasons, self._reasons = self._reasons, set()
                self.refresh(",".join(sorted(reasons)))
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    async def _follow_events(self) -> None:
        """Marks the spec stale on every watched event; a subscription cut off for falling behind is renewed."""
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
        """Tries a refused or failed write again; else undoes any change made to the spec behind gpud's back."""
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
        log.warning("cdi_spec_changed_behind_gpud", path=str(self.path), change=change,
                    count=self.changed_behind_gpud["count"], action="gpud rewrites it",
                    why="runtimes run the spec's hooks as root: only gpud's spec may be there")
        self.refresh("changed behind gpud's back", rewrite=True)

    def refresh(self, reason: str, rewrite: bool = False) -> None:
        """Rebuilds the spec and writes it if it changed (or `rewrite`); never raises for a directory it cannot write."""
        inventory = self._inventory.current
        if inventory is None:
            return
        host = read_host_devices(self._dev_root, self._mig_minors_path)
        driver = self._driver_edits(inventory.driver_version)
        built = build_spec(inventory, self._sharing.document, self._mps_clients(), host, driver)
        self.unavailable = built.unavailable
        if built.spec == self.spec and self.error is None and not rewrite:
            return
        try:
            self._write(built.spec)
        except OSError as exc:
            self._failed(exc, reason)
            return
        self.spec, self.error, self.written_at = built.spec, None, time.time()
        log.info("cdi_spec_written", path=str(self.path), devices=len(built.spec["devices"]), reason=reason,
                 unavailable=len(built.unavailable), cdi_version=built.spec["cdiVersion"],
                 driver_files=len(driver.get("mounts", [])), driver_version=inventory.driver_version)

    def _failed(self, exc: OSError, reason: str) -> None:
        error = (f"cannot write {self.path}: {exc if isinstance(exc, UnsafePath) else exc.strerror or exc}; "
                 f"gpud tries again every {RECHECK_S:g} s (cdi.spec_dir)")
        if error != self.error:  # once per cause, not every recheck
            log.error("cdi_spec_not_written", path=str(self.path), error=str(exc), reason=reason,
                      consequence="runtimes keep the previous spec, if any", retry_every_s=RECHECK_S)
        self.error = error

    def _driver_edits(self, version: str) -> dict:
        if self._driver_root is None:
            return {}
        edits = find_driver_files(self._driver_root, version).edits(self._ldconfig)
        if not edits and version not in self._missing_drivers:
            self._missing_drivers.add(version)  # said once per version: the refresh runs every 30 s
            log.warning("cdi_driver_files_not_found", driver_version=version, driver_root=str(self._driver_root),
                        looked_in=str(self._driver_root / "etc" / "ld.so.cache"),
                        consequence="containers get device nodes only, no driver libraries")
        return edits

    def _write(self, spec: dict) -> None:
        if not spec["devices"]:
            # CDI readers refuse a spec without devices: no file rather than one that breaks the directory
            self._file.remove()
            return
        self._file.write((json.dumps(spec, indent=2) + "\n").encode())


def remove_spec(spec_dir: Path) -> None:
    """Removes the spec a gpud wrote earlier (cdi turned off); logs rather than fails."""
    path = spec_dir / SPEC_FILE
    try:
        if not KeptFile(path, 0o644, create_directory=False).remove():
            return
    except FileNotFoundError:  # no directory
        return
    except OSError as exc:
        log.error("cdi_spec_not_removed", path=str(path), error=str(exc), why="cdi.enabled is false")
        return
    log.info("cdi_spec_removed", path=str(path), why="cdi.enabled is false")
