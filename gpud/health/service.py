"""The health monitor: NVML events and periodic checks feed the tracker; state changes go to the
log and the watch stream at once."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable

from gpud.events import EventBus
from gpud.health.catalog import XidCatalog
from gpud.health.checks import check_readings
from gpud.health.tracker import Change, HealthTracker
from gpud.inventory import Inventory, InventoryService
from gpud.logs import get_logger
from gpud.nvml.health import EventListener, Readings, read_readings
from gpud.nvml.session import NvmlSession
from gpud.persist import write_json_atomic

log = get_logger("health")


class HealthService:
    def __init__(self, session: NvmlSession, inventory: InventoryService, bus: EventBus, catalog: XidCatalog, *,
                 check_interval_s: float = 5.0, clear_after_passes: int = 3,
                 mps_failures: Callable[[], dict[str, str]] = dict, nvlinks_path: Path | None = None):
        self.session = session
        self.inventory = inventory
        self.bus = bus
        self.catalog = catalog
        self.tracker = HealthTracker(catalog, clear_after_passes=clear_after_passes)
        self.check_interval_s = check_interval_s
        self.readings: dict[str, Readings | None] = {}
        self.last_xid: dict[str, tuple[int, float]] = {}  # GPU UUID -> (XID, when): dcgm-exporter's gauge
        self.xid_counts: dict[tuple[str, int], int] = {}
        self._mps_failures = mps_failures  # device UUID -> why its MPS daemon is down
        self._mps_watched: set[str] = set()
        self.listeners: list[Callable[[], None]] = []  # told after any health change (sharing follows)
        self._listener: EventListener | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # NVLink links seen active on each GPU (since gpud started, or kept in nvlinks_path): only
        # those count when down. A board without a bridge has every link present but inactive
        # from the start, which is no fault (reference README.md corrections).
        self._nvlinks_path = nvlinks_path
        self.nvlinks_ever_up: dict[str, frozenset[int]] = _load_links(nvlinks_path)
        inventory.subscribe(self._on_inventory)
        # A GPU reset shuts NVML down: the event thread frees its set first and registers every
        # GPU again (those that came back included) once NVML is back.
        session.on_release(self._pause_events, self._resume_events)

    # -- inputs ------------------------------------------------------------------------------

    def _on_inventory(self, inventory: Inventory) -> None:
        self._publish(self.tracker.set_inventory(inventory), "inventory")

    def start(self) -> None:
        """Starts the NVML event thread (NVML must be initialised)."""
        self._loop = asyncio.get_running_loop()
        self._listener = EventListener(self.session.nvml, self._from_thread)
        self._listener.start()

    def stop(self) -> None:
        if self._listener:
            self._listener.stop()

    async def _pause_events(self) -> None:
        if self._listener:
            await asyncio.to_thread(self._listener.stop)

    def _resume_events(self) -> None:
        if self._listener:
            self._listener.start()

    def _from_thread(self, event: dict) -> None:
        self._loop.call_soon_threadsafe(self._on_event, event)

    def _on_event(self, event: dict) -> None:
        kind, gpu = event["kind"], event.get("gpu")
        if kind == "xid":
            self._on_xid(gpu, event["xid"], event["gi_id"], event["ci_id"])
        elif kind == "ecc-dbe":
            self._publish(self.tracker.observe(gpu, "ecc", "dbe-event", (
                "unhealthy", "reset-gpu", "an uncorrectable (double-bit) ECC error was reported")), "NVML event")
        elif kind == "lost":
            log.error("gpu_lost", gpu=gpu, error=event.get("error"), noticed_by="NVML event wait")
            asyncio.ensure_future(self.inventory.refresh("a GPU stopped answering NVML events"))
        elif kind == "back":
            log.info("gpu_back", gpu=gpu, noticed_by="NVML event registration")
            asyncio.ensure_future(self.inventory.refresh("a lost GPU answers NVML again"))
        elif kind == "error":
            log.error("nvml_event_wait_failed", error=event.get("error"))
            asyncio.ensure_future(self.inventory.refresh("NVML event wait failed"))

    def _on_xid(self, gpu: str, xid: int, gi_id: int | None, ci_id: int | None) -> None:
        info = self.catalog.info(xid)
        self.last_xid[gpu] = (xid, time.time())
        self.xid_counts[(gpu, xid)] = self.xid_counts.get((gpu, xid), 0) + 1
        affects = self.catalog.affects_health(xid)
        (log.warning if affects else log.info)("xid", gpu=gpu, xid=xid, name=info.name, gi_id=gi_id, ci_id=ci_id,
                                               severity=info.severity, action=info.action,
                                               affects_health=affects)
        self._publish(self.tracker.record_xid(gpu, xid, gi_id, ci_id), f"XID {xid}")

    async def run_checks(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.check_interval_s)

    async def check_once(self) -> None:
        inventory = self.inventory.current
        if inventory is None:
            return
        uuids = [g.uuid for g in inventory.gpus if not g.lost]
        previous = self.readings
        try:
            self.readings = await self.session.call(read_readings, uuids)
        except Exception as exc:  # NVML unavailable: the inventory and /healthz say so
            log.warning("health_readings_failed", error=str(exc))
            return
        changes: list[Change] = []
        unreachable = [uuid for uuid, readings in self.readings.items() if readings is None]
        if unreachable:  # lost since the inventory was read: the inventory says so at once
            log.warning("health_readings_unreachable", gpus=unreachable)
            asyncio.ensure_future(self.inventory.refresh("health readings could not reach a GPU"))
        for uuid, readings in self.readings.items():
            if readings is None:
                continue
            ever_up = self._note_links_up(uuid, readings)
            for (kind, code), problem in check_readings(readings, previous.get(uuid), ever_up).items():
                changes += self.tracker.observe(uuid, kind, code, problem)
        failures = self._mps_failures()
        for device in self._mps_watched - set(failures):
            changes += self.tracker.observe(device, "mps", "daemon", None)  # passes count toward clearing
        for device, why in failures.items():
            changes += self.tracker.observe(device, "mps", "daemon", ("degraded", "restart-app", why))
        self._mps_watched |= set(failures)
        self._publish(changes, "periodic checks")

    def _note_links_up(self, uuid: str, readings: Readings) -> frozenset[int]:
        known = self.nvlinks_ever_up.get(uuid, frozenset())
        ever_up = known | {link for link, up in enumerate(readings.nvlinks_up or ()) if up}
        if ever_up != known:
            self.nvlinks_ever_up[uuid] = ever_up
            self._save_links()
        return ever_up

    def _save_links(self) -> None:
        if self._nvlinks_path is None:
            return
        try:
            document = {uuid: sorted(links) for uuid, links in self.nvlinks_ever_up.items()}
            write_json_atomic(self._nvlinks_path, document)
        except OSError as exc:
            log.warning("nvlinks_not_saved", path=str(self._nvlinks_path), error=str(exc))

    # -- outputs -----------------------------------------------------------------------------

    def _publish(self, changes: list[Change], cause: str) -> None:
        for change in changes:
            level = log.error if change.state == "unhealthy" else log.warning if change.state == "degraded" else log.info
            level("device_health_changed", device=change.device, gpu=change.gpu_index, previous=change.previous,
                  state=change.state, cause=cause, reasons=[f"{r.kind}:{r.code}" for r in change.reasons])
            self.bus.publish("health", {"device": change.device, "gpu_index": change.gpu_index,
                                        "previous": change.previous, "state": change.state, "cause": cause,
                                        "reasons": [_reason(r) for r in change.reasons]})
        if changes:
            for listener in self.listeners:
                listener()

    def gpu_was_reset(self, uuid: str) -> None:
        self._publish(self.tracker.record_reset(uuid), "GPU reset")

    def clear(self, uuid: str, kind: str | None) -> None:
        self._publish(self.tracker.clear(uuid, kind), "cleared by an administrator")

    def view(self) -> dict[str, Any]:
        return self.tracker.view(self.inventory.current) if self.inventory.current else {"status": "unknown", "gpus": []}


def _reason(reason: Any) -> dict:
    return {key: getattr(reason, key) for key in reason.__dataclass_fields__}


def _load_links(path: Path | None) -> dict[str, frozenset[int]]:
    if path is None:
        return {}
    try:
        document = json.loads(path.read_text())
        return {str(uuid): frozenset(int(link) for link in links) for uuid, links in document.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("nvlinks_unreadable", path=str(path), error=str(exc))
        return {}
