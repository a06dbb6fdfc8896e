"""The node as gpud last read it: an immutable snapshot, and the service that keeps it fresh.

Only gpud.nvml reads NVML; this module holds what it read. A snapshot is never changed after it is
made: a refresh builds a new one and swaps it in, so readers never see half an update.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Awaitable, Callable

from gpud.logs import get_logger

log = get_logger("inventory")


@dataclass(frozen=True)
class Placement:
    start: int
    size: int


@dataclass(frozen=True)
class MigDevice:
    uuid: str
    index: int  # the MIG device index NVML enumerates it at on its parent
    profile: str  # "1g.5gb", "1c.3g.20gb", "1g.5gb+me"
    gi_id: int
    ci_id: int
    gi_profile_id: int
    ci_profile_id: int
    placement: Placement
    memory_total_mib: int
    sm_count: int


@dataclass(frozen=True)
class MigInfo:
    capable: bool
    mode: str | None  # "enabled" | "disabled"; None when not capable
    pending_mode: str | None
    devices: tuple[MigDevice, ...] = ()


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    pci_device_id: str  # "0x20B010DE"
    memory_total_mib: int
    compute_mode: str  # "default" | "exclusive_process" | "prohibited"
    architecture: str
    cuda_compute_capability: str
    serial: str | None
    mig: MigInfo
    lost: bool = False
    error: str | None = None  # what went wrong reading this GPU, if anything


@dataclass(frozen=True)
class Inventory:
    driver_version: str
    cuda_version: str
    nvml_version: str
    gpus: tuple[Gpu, ...]
    read_at: float = field(default_factory=time.time)  # wall clock, for people
    read_duration_ms: float = 0.0

    def find_gpu(self, ident: str) -> Gpu | None:
        """A GPU by index ("3"), UUID ("GPU-…") or PCI bus id (either NVML's or the short form)."""
        for gpu in self.gpus:
            if ident in (str(gpu.index), gpu.uuid) or _same_bus_id(ident, gpu.pci_bus_id):
                return gpu
        return None

    def as_dict(self) -> dict:
        return asdict(self)


def _same_bus_id(ident: str, bus_id: str) -> bool:
    return ":" in ident and normal_bus_id(ident) == normal_bus_id(bus_id)


def normal_bus_id(bus_id: str) -> str | None:
    """'0000:07:00.0', '00000000:07:00.0' and '07:00.0' name the same device; None if not a bus id."""
    parts = bus_id.lower().split(":")
    if len(parts) not in (2, 3):
        return None
    try:
        domain = int(parts[0], 16) if len(parts) == 3 else 0
    except ValueError:
        return None
    return f"{domain:08x}:{':'.join(parts[-2:])}"


Reader = Callable[[Inventory | None], Awaitable[Inventory]]
Listener = Callable[[Inventory], None]


class InventoryService:
    """Holds the current snapshot; re-reads the node on an interval and whenever asked."""

    def __init__(self, read: Reader, interval_s: float):
        self._read = read
        self._interval_s = interval_s
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._listeners: list[Listener] = []
        self.current: Inventory | None = None
        self.error: str | None = None
        self.generation = 0

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def refresh(self, reason: str) -> Inventory | None:
        """Reads the node now and publishes the new snapshot. Concurrent callers share one read order."""
        async with self._lock:
            started = time.perf_counter()
            try:
                snapshot = await self._read(self.current)
            except Exception as exc:
                self.error = f"reading the node failed: {exc}"
                log.error("inventory_read_failed", reason=reason, error=str(exc))
                return self.current
            duration = (time.perf_counter() - started) * 1000
            snapshot = replace(snapshot, read_duration_ms=round(duration, 3))
            changed = self.current is None or _content(self.current) != _content(snapshot)
            self.current, self.error = snapshot, None
            self.generation += 1
            if changed:
                log.info("inventory_changed", reason=reason, gpus=len(snapshot.gpus),
                         mig_devices=sum(len(g.mig.devices) for g in snapshot.gpus),
                         lost=[g.index for g in snapshot.gpus if g.lost], read_ms=round(duration, 1))
            for listener in self._listeners:
                listener(snapshot)
            return snapshot

    def poke(self) -> None:
        """Asks the refresh loop for a re-read soon, without waiting for it."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            reason = "requested"
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            except asyncio.TimeoutError:
                reason = "interval"
            self._wake.clear()
            await self.refresh(reason)


def _content(snapshot: Inventory) -> tuple:
    return (snapshot.driver_version, snapshot.gpus)
