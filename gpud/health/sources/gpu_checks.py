"""Each GPU's readings, every check interval: what they mean for its health (gpud.health.checks), the
driver's recovery action, and each MPS daemon's failure, as the tracker's changes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable

from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile
from gpud.health import persistence
from gpud.health.checks import check_readings
from gpud.health.dcgm_fields import instance_devices
from gpud.health.driver_actions import driver_action_name
from gpud.health.reasons import Change
from gpud.health.states import Action, Health
from gpud.health.tracker import HealthTracker
from gpud.inventory import InventoryService
from gpud.model.inventory import Inventory
from gpud.nvml.health import FbMemory, Readings, read_mig_memory, read_readings
from gpud.nvml.session import NvmlSession

log = get_logger("health")


class GpuChecks:
    def __init__(self, session: NvmlSession, inventory: InventoryService, tracker: HealthTracker, *,
                 mps_failures: Callable[[], dict[str, str]], nvlinks_path: Path | None,
                 corrupt_files: list[CorruptFile]):
        self.session = session
        self.inventory = inventory
        self._tracker = tracker
        self.readings: dict[str, Readings | None] = {}
        self.mig_memory: dict[str, FbMemory | None] = {}  # MIG device UUID (one per GPU instance) -> memory
        self.nvlink_bandwidth: dict[str, int] = {}  # GPU UUID -> NVLink data rate between the last two readings
        self._mps_failures = mps_failures  # device UUID -> why its MPS daemon is down
        self._mps_watched: set[str] = set()
        # NVLink links seen active on each GPU (since gpud started, or kept in nvlinks_path): only
        # those count when down. A board without a bridge has every link present but inactive
        # from the start, which is no fault (NVIDIA/NVSentinel#1481, NVIDIA/DCGM#198).
        self._nvlinks_path = nvlinks_path
        self._corrupt_files = corrupt_files
        self.nvlinks_ever_up: dict[str, frozenset[int]] = {}

    def load(self) -> None:
        """Reads back the links seen up before (a corrupt file is set aside and reported)."""
        self.nvlinks_ever_up = persistence.load(self._nvlinks_path, persistence.links_from, self._corrupt_files) or {}

    async def check(self, inventory: Inventory) -> list[Change] | None:
        """The changes the readings of the inventory's GPUs caused; None when NVML could not be read
        (the inventory and /healthz say why)."""
        uuids = [g.uuid for g in inventory.gpus if not g.lost]
        instances = [dev.uuid for g in inventory.gpus if not g.lost for dev in instance_devices(g)]
        previous = self.readings
        try:
            self.readings = await self.session.call(read_readings, uuids)
            self.mig_memory = await self.session.call(read_mig_memory, instances) if instances else {}
        except Exception as exc:  # NVML unavailable: the inventory and /healthz say so
            log.warning("health_readings_failed", error=str(exc))
            return None
        self.nvlink_bandwidth = {uuid: rate for uuid, readings in self.readings.items()
                                 if (rate := nvlink_mb_s(readings, previous.get(uuid))) is not None}
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
                changes += self._tracker.observe(uuid, kind, code, problem)
            changes += self._tracker.record_driver_action(uuid, driver_action_name(readings.recovery_action))
        return changes + self._check_mps()

    def _check_mps(self) -> list[Change]:
        changes: list[Change] = []
        failures = self._mps_failures()
        for device in self._mps_watched - set(failures):
            changes += self._tracker.observe(device, "mps", "daemon", None)  # passes count toward clearing
        return changes + self.observe_mps_failures(failures)

    def observe_mps_failures(self, failures: dict[str, str] | None = None) -> list[Change]:
        """The MPS daemons down now, as problems of their devices (also at once when one fails, between
        two periodic checks)."""
        changes: list[Change] = []
        failures = self._mps_failures() if failures is None else failures
        for device, why in failures.items():
            changes += self._tracker.observe(device, "mps", "daemon", (Health.DEGRADED, Action.RESTART_APP, why))
        self._mps_watched |= set(failures)
        return changes

    def _note_links_up(self, uuid: str, readings: Readings) -> frozenset[int]:
        known = self.nvlinks_ever_up.get(uuid, frozenset())
        ever_up = known | {link for link, up in enumerate(readings.nvlinks_up or ()) if up}
        if ever_up != known:
            self.nvlinks_ever_up[uuid] = ever_up
            persistence.save_links(self._nvlinks_path, self.nvlinks_ever_up)
        return ever_up


def nvlink_mb_s(readings: Readings | None, previous: Readings | None) -> int | None:
    """DCGM's DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL: the growth of the NVLink data counters (KiB) per second
    between two readings, divided by 1000, 0 on the first reading or after the counters went back (a
    driver reload) (DcgmCacheManager.cpp ReadAndCacheNvLinkBandwidth). None without NVLink."""
    if readings is None or readings.nvlink_data_kib is None:
        return None
    if previous is None or previous.nvlink_data_kib is None or readings.read_at <= previous.read_at:
        return 0
    grown = readings.nvlink_data_kib - previous.nvlink_data_kib
    return max(0, int(grown / (readings.read_at - previous.read_at) / 1000))
