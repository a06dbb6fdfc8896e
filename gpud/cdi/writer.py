"""Keeps the CDI spec file current: rebuilt shortly after every inventory, MIG, MPS or sharing change
(and every inventory refresh, which also notices device nodes that appeared or went), written only
when its content changes, by a rename, so a runtime never reads half a file. When gpud stops, the
last spec stays: the devices it names are still there for containers started meanwhile."""

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
from gpud.persist import write_text_atomic
from gpud.sharing.service import SharingView

log = get_logger("cdi")
WATCHED_EVENTS = frozenset({"inventory", "mig", "mps", "sharing"})
DEBOUNCE_S = 0.15  # changes arrive in bursts (a MIG apply: mig, inventory, sharing, mps): one write


class CdiWriter:
    def __init__(self, spec_dir: Path, dev_root: Path, mig_minors_path: Path, inventory: InventoryService,
                 sharing: SharingView, mps_clients: Callable[[], Mapping[str, dict]], bus: EventBus,
                 driver_root: Path | None = None):
        self.path = spec_dir / SPEC_FILE
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
        self._reasons: set[str] = set()
        self._changed = asyncio.Event()
        inventory.subscribe(lambda _inventory: self._mark("inventory"))

    def view(self) -> dict:
        """GET /v1/cdi."""
        return {"enabled": True, "kind": KIND, "path": str(self.path), "written_at": self.written_at,
                "error": self.error, "devices": [device["name"] for device in (self.spec or {}).get("devices", [])],
                "unavailable": self.unavailable, "spec": self.spec}

    def _mark(self, reason: str) -> None:
        self._reasons.add(reason)
        self._changed.set()

    async def run(self) -> None:
        follower = asyncio.create_task(self._follow_events(), name="cdi-events")
        try:
            while True:
                await self._changed.wait()
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

    def refresh(self, reason: str) -> None:
        """Rebuilds the spec and writes it if it changed; never raises for a directory it cannot write."""
        inventory = self._inventory.current
        if inventory is None:
            return
        host = read_host_devices(self._dev_root, self._mig_minors_path)
        driver = self._driver_edits(inventory.driver_version)
        built = build_spec(inventory, self._sharing.document, self._mps_clients(), host, driver)
        self.unavailable = built.unavailable
        if built.spec == self.spec and self.error is None:
            return
        try:
            self._write(built.spec)
        except OSError as exc:
            self.error = f"cannot write {self.path}: {exc.strerror or exc}"
            log.error("cdi_spec_not_written", path=str(self.path), error=str(exc), reason=reason,
                      consequence="runtimes keep the previous spec, if any")
            return
        self.spec, self.error, self.written_at = built.spec, None, time.time()
        log.info("cdi_spec_written", path=str(self.path), devices=len(built.spec["devices"]), reason=reason,
                 unavailable=len(built.unavailable), cdi_version=built.spec["cdiVersion"],
                 driver_files=len(driver.get("mounts", [])), driver_version=inventory.driver_version)

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
            self.path.unlink(missing_ok=True)
            return
        # 0644: runtimes run as other users too (rootless podman reads it)
        write_text_atomic(self.path, json.dumps(spec, indent=2) + "\n", mode=0o644)


def remove_spec(spec_dir: Path) -> None:
    """Removes the spec a gpud wrote earlier (cdi turned off); logs rather than fails."""
    path = spec_dir / SPEC_FILE
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        log.error("cdi_spec_not_removed", path=str(path), error=str(exc), why="cdi.enabled is false")
        return
    log.info("cdi_spec_removed", path=str(path), why="cdi.enabled is false")
