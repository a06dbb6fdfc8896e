"""The kernel log as a source of XIDs (gpud.health.kmsg follows it): each XID line is matched to its
GPU by PCI bus id and counted by the XID counter, which knows the ones NVML reported too."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

from gpud.base.logs import get_logger
from gpud.health.kmsg import KernelLogFollower
from gpud.health.kmsg_records import KernelXid
from gpud.health.sources.nvml_events import NvmlEvents
from gpud.health.xid_counter import XidCounter, XidSource
from gpud.inventory import InventoryService
from gpud.model.inventory import normal_bus_id

log = get_logger("health")
# On a GPU in MIG mode a kernel-log XID waits this long for NVML's report of it, which names the MIG
# device (the kernel line does not): the XID is then the MIG device's, not the whole GPU's.
KERNEL_XID_GRACE_S = 2.0
KERNEL_XIDS_WAITING = 1000


class KernelLogXids:
    def __init__(self, inventory: InventoryService, xids: XidCounter, events: NvmlEvents, *, kmsg: Path,
                 procfs: Path, cursor_path: Path | None):
        self.inventory = inventory
        self._xids = xids
        self._events = events
        self._kmsg, self._procfs, self._cursor_path = kmsg, procfs, cursor_path
        self.follower: KernelLogFollower | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Kernel-log XIDs read before the first inventory (the ring buffer replayed at start, NVML not up
        # yet): they wait for it, as many as a storm of them would leave worth keeping.
        self._waiting: deque[KernelXid] = deque(maxlen=KERNEL_XIDS_WAITING)

    def start(self) -> None:
        """Starts following the kernel log, once: it needs no NVML, so it starts before it."""
        if self.follower:
            return
        self._loop = asyncio.get_running_loop()
        self.follower = KernelLogFollower(self._kmsg, self._from_thread, cursor_path=self._cursor_path,
                                          boot_id_path=self._procfs / "sys" / "kernel" / "random" / "boot_id")
        self.follower.start()

    async def stop(self) -> None:
        if self.follower:
            await asyncio.to_thread(self.follower.stop)

    async def save_cursor(self) -> None:
        """Saves which records were read, where the kernel log is followed."""
        if self.follower:
            await asyncio.to_thread(self.follower.save_cursor)

    @property
    def problem(self) -> str | None:
        """Why XIDs are not being read from the kernel log now, if they are not."""
        problem = self.follower.problem if self.follower else None
        return f"the kernel log is not being read, XIDs NVML misses go unseen: {problem}" if problem else None

    def inventory_known(self) -> None:
        """Counts the XIDs read before NVML named the GPUs."""
        while self._waiting:
            self._on_xid(self._waiting.popleft())

    def _from_thread(self, line: KernelXid) -> None:
        self._loop.call_soon_threadsafe(self._on_xid, line)

    def _on_xid(self, line: KernelXid) -> None:
        inventory = self.inventory.current
        if inventory is None:
            self._waiting.append(line)
            return
        gpu = next((g for g in inventory.gpus if normal_bus_id(g.pci_bus_id) == line.pci_bus_id), None)
        if gpu is None:
            log.warning("kernel_xid_unknown_gpu", bus_id=line.pci_bus_id, xid=line.xid, detail=line.detail,
                        why="no GPU of the inventory has this PCI bus id")
            return
        xid = (gpu.uuid, line.xid, line.at, XidSource.KERNEL_LOG, None, None, line.detail)
        if gpu.mig.mode == "enabled" and self._events.arriving:
            self._loop.call_later(KERNEL_XID_GRACE_S, self._xids.count, *xid)
        else:
            self._xids.count(*xid)
