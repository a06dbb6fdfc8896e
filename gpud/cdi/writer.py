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

import json
from pathlib import Path
from typing import Callable, Mapping

from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.base.safefs import KeptFile
from gpud.cdi.driver_files import find_driver_files, host_ldconfig
from gpud.cdi.spec import KIND, SPEC_FILE, build_spec, read_host_devices
from gpud.events import EventBus
from gpud.inventory import InventoryService
from gpud.kept_writer import RECHECK_S, KeptFileWriter
from gpud.model.inventory import Inventory
from gpud.sharing.service import SharingView

log = get_logger("cdi")
__all__ = ["CdiWriter", "CdiSpecRemoved", "RECHECK_S"]


class CdiWriter(KeptFileWriter):
    name = "cdi"
    event = "cdi_spec"
    setting = "cdi.spec_dir"
    rewrite_why = "runtimes run the spec's hooks as root: only gpud's spec may be there"
    not_written_consequence = "runtimes keep the previous spec, if any"

    def __init__(self, spec_dir: Path, dev_root: Path, mig_minors_path: Path, inventory: InventoryService,
                 sharing: SharingView, mps_clients: Callable[[], Mapping[str, dict]], bus: EventBus,
                 driver_root: Path | None = None):
        # 0644: runtimes run as other users too (rootless podman reads it)
        super().__init__(spec_dir / SPEC_FILE, 0o644, inventory, bus, log)
        self._dev_root = dev_root
        self._driver_root = driver_root  # None: the driver's files are left to something else
        self._ldconfig = host_ldconfig()
        self._missing_drivers: set[str] = set()
        self._mig_minors_path = mig_minors_path
        self._sharing = sharing
        self._mps_clients = mps_clients
        self.unavailable: list[dict] = []
        self._driver_files = 0

    @property
    def spec(self) -> dict | None:
        """What the file holds now (None: no file written by this gpud)."""
        return self.content

    def view(self) -> dict:
        """GET /v1/cdi."""
        return {"enabled": True, "kind": KIND, "path": str(self.path), "written_at": self.written_at,
                "error": self.error, "devices": [device["name"] for device in (self.spec or {}).get("devices", [])],
                "unavailable": self.unavailable, "spec": self.spec, "changed_behind_gpud": self.changed_behind_gpud}

    def build(self, inventory: Inventory) -> dict:
        host = read_host_devices(self._dev_root, self._mig_minors_path)
        driver = self._driver_edits(inventory.driver_version)
        self._driver_files = len(driver.get("mounts", []))
        built = build_spec(inventory, self._sharing.document, self._mps_clients(), host, driver)
        self.unavailable = built.unavailable
        return built.spec

    def written(self, spec: dict, reason: str) -> None:
        log.info("cdi_spec_written", path=str(self.path), devices=len(spec["devices"]), reason=reason,
                 unavailable=len(self.unavailable), cdi_version=spec["cdiVersion"],
                 driver_files=self._driver_files, driver_version=self._inventory.current.driver_version)

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

    def write(self, file: KeptFile, spec: dict) -> None:
        if not spec["devices"]:
            # CDI readers refuse a spec without devices: no file rather than one that breaks the directory
            file.remove()
            return
        file.write((json.dumps(spec, indent=2) + "\n").encode())


class CdiSpecRemoved(Component):
    """cdi.enabled false: the spec an earlier gpud wrote is removed, so runtimes do not hand out devices
    nobody keeps current. Logs rather than fails."""

    name = "cdi"

    def __init__(self, spec_dir: Path):
        self.path = spec_dir / SPEC_FILE

    async def start(self, tasks: Tasks) -> None:
        path = self.path
        try:
            if not KeptFile(path, 0o644, create_directory=False).remove():
                return
        except FileNotFoundError:  # no directory
            return
        except OSError as exc:
            log.error("cdi_spec_not_removed", path=str(path), error=str(exc), why="cdi.enabled is false")
            return
        log.info("cdi_spec_removed", path=str(path), why="cdi.enabled is false")
