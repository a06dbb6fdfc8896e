"""The service that keeps the node's snapshot (gpud.model.inventory) fresh: it re-reads the node on an
interval and whenever a change is made, publishes each new snapshot, and remembers every GPU it described.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Awaitable, Callable, Iterator

from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.base.persist import write_json_atomic
from gpud.events import EventBus, EventType
from gpud.model.inventory import IDENTITY_FIELDS, Gpu, Inventory, unknown_gpu

log = get_logger("inventory")


Reader = Callable[[dict[int, Gpu]], Awaitable[Inventory]]
Listener = Callable[[Inventory], None]


class InventoryService(Component):
    """Holds the current snapshot; re-reads the node on an interval and whenever a change is made.
    Components that follow the node subscribe to its snapshots (docs/architecture.md)."""

    name = "inventory"

    def __init__(self, read: Reader, interval_s: float, known_gpus_path: Path, bus: EventBus | None = None):
        self._read = read
        self._bus = bus  # told when GPUs or MIG devices come, go or are lost
        self._published: tuple | None = None
        self._interval_s = interval_s
        self._lock = asyncio.Lock()
        self._listeners: list[Listener] = []
        self.current: Inventory | None = None
        self.error: str | None = None
        # The last good description of each GPU, kept on disk too: a GPU that falls off the bus
        # while gpud is down is still named (UUID, bus id) when gpud comes back.
        self._known_path = known_gpus_path
        self.known: dict[int, Gpu] = {}
        # Why the snapshots show a passing state (a reset's MIG instances not made again yet), None
        # otherwise: the files gpud keeps for others (gres.conf, the CDI spec) wait it out.
        self.transition: str | None = None

    @contextmanager
    def in_transition(self, why: str) -> Iterator[None]:
        self.transition = why
        try:
            yield
        finally:
            self.transition = None

    async def start(self, tasks: Tasks) -> None:
        self.known = _load_known(self._known_path)

    async def start_with_gpus(self, tasks: Tasks) -> None:
        tasks.spawn(self._reread_on_interval(), "inventory")

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def refresh(self, reason: str) -> Inventory | None:
        """Reads the node now and publishes the new snapshot. Concurrent callers share one read order."""
        async with self._lock:
            started = time.perf_counter()
            try:
                snapshot = await self._read(self.known)
            except Exception as exc:
                self.error = f"reading the node failed: {exc}"
                log.error("inventory_read_failed", reason=reason, error=str(exc))
                return self.current
            duration = (time.perf_counter() - started) * 1000
            changed = self.current is None or _content(self.current) != _content(snapshot)
            self.current, self.error = snapshot, None
            self._remember(snapshot)
            if changed:
                log.info("inventory_changed", reason=reason, gpus=len(snapshot.gpus),
                         mig_devices=sum(len(g.mig.devices) for g in snapshot.gpus),
                         lost=[g.index for g in snapshot.gpus if g.lost], read_ms=round(duration, 1))
            for listener in self._listeners:
                listener(snapshot)
            self._publish(snapshot)
            return snapshot

    def _publish(self, snapshot: Inventory) -> None:
        summary = tuple((g.uuid, g.lost, g.mig.mode, tuple(d.uuid for d in g.mig.devices)) for g in snapshot.gpus)
        if self._bus is None or summary == self._published:
            return
        self._published = summary
        self._bus.publish(EventType.INVENTORY, {"gpus": len(snapshot.gpus),
                                                "mig_devices": sum(len(g.mig.devices) for g in snapshot.gpus),
                                                "lost": [g.index for g in snapshot.gpus if g.lost]})

    def _remember(self, snapshot: Inventory) -> None:
        known = dict(self.known)
        known.update({gpu.index: gpu for gpu in snapshot.gpus if not gpu.lost and not gpu.error})
        if _identities(known) != _identities(self.known):
            try:
                write_json_atomic(self._known_path, _identities(known))
            except OSError as exc:
                log.warning("known_gpus_not_saved", path=str(self._known_path), error=str(exc))
        self.known = known

    async def _reread_on_interval(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh("interval")


def _content(snapshot: Inventory) -> tuple:
    return (snapshot.driver_version, snapshot.gpus)


def _identities(gpus: dict[int, Gpu]) -> dict[str, dict]:
    return {str(index): {name: getattr(gpu, name) for name in IDENTITY_FIELDS} for index, gpu in gpus.items()}


def _load_known(path: Path) -> dict[int, Gpu]:
    try:
        document = json.loads(path.read_text())
        return {int(index): unknown_gpu(int(index), **{k: v for k, v in fields.items() if k in IDENTITY_FIELDS})
                for index, fields in document.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("known_gpus_unreadable", path=str(path), error=str(exc))
        return {}
