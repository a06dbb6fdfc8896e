"""NVML's events, from the event thread onto the event loop: XIDs (to the XID counter), uncorrectable
ECC errors, and GPUs lost or back (the inventory is read again at once)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from gpud.base.logs import get_logger
from gpud.health.reasons import Change
from gpud.health.states import Action, Health
from gpud.health.tracker import HealthTracker
from gpud.health.xid_counter import XidCounter, XidSource
from gpud.inventory import InventoryService
from gpud.nvml.health import EventListener, NvmlEvent
from gpud.nvml.session import NvmlSession

log = get_logger("health")


class NvmlEvents:
    def __init__(self, session: NvmlSession, inventory: InventoryService, tracker: HealthTracker, xids: XidCounter,
                 publish: Callable[[list[Change], str], None]):
        self.session = session
        self.inventory = inventory
        self._tracker = tracker
        self._xids = xids
        self._publish = publish
        self._listener: EventListener | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # A GPU reset shuts NVML down: the event thread frees its set first and registers every
        # GPU again (those that came back included) once NVML is back.
        session.on_release(self._pause, self._resume)

    def start(self) -> None:
        """Starts the event thread (NVML must be initialised)."""
        self._loop = asyncio.get_running_loop()
        self._listener = EventListener(self.session.nvml, self._from_thread)
        self._listener.start()

    def stop(self) -> None:
        if self._listener:
            self._listener.stop()

    @property
    def problem(self) -> str | None:
        """Why events (XIDs, ECC errors) are not being received now, if they are not."""
        failing = self._listener.failing if self._listener else None
        return f"NVML events are not being received, XIDs go unseen: {failing}" if failing else None

    @property
    def arriving(self) -> bool:
        """Whether the event thread runs and its waits answer: an XID NVML reports arrives."""
        return bool(self._listener and self._listener.running and not self._listener.failing)

    async def _pause(self) -> None:
        if self._listener:
            await asyncio.to_thread(self._listener.stop)

    def _resume(self) -> None:
        if self._listener:
            self._listener.start()

    def _from_thread(self, event: NvmlEvent) -> None:
        self._loop.call_soon_threadsafe(self._on_event, event)

    def _on_event(self, event: NvmlEvent) -> None:
        kind, gpu = event.kind, event.gpu
        if kind == "xid":
            self._xids.count(gpu, event.xid, time.time(), XidSource.NVML, event.gi_id, event.ci_id, None)
        elif kind == "ecc-dbe":
            self._publish(self._tracker.observe(gpu, "ecc", "dbe-event", (
                Health.UNHEALTHY, Action.RESET_GPU, "an uncorrectable (double-bit) ECC error was reported")),
                "NVML event")
        elif kind == "lost":
            log.error("gpu_lost", gpu=gpu, error=event.error, noticed_by="NVML event wait")
            asyncio.ensure_future(self.inventory.refresh("a GPU stopped answering NVML events"))
        elif kind == "back":
            log.info("gpu_back", gpu=gpu, noticed_by="NVML event registration")
            asyncio.ensure_future(self.inventory.refresh("a lost GPU answers NVML again"))
        elif kind == "error":
            log.error("nvml_event_wait_failed", error=event.error)
            asyncio.ensure_future(self.inventory.refresh("NVML event wait failed"))
