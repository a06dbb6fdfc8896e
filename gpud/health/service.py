"""The health monitor: NVML events and periodic checks feed the tracker; state changes go to the
log and the watch stream at once."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from gpud.dcgm_labels import gpu_labels, instance_labels
from gpud.events import EventBus
from gpud.health.catalog import XidCatalog
from gpud.health.checks import check_readings
from gpud.health.tracker import Change, HealthTracker, Key, Reason, parse_reasons
from gpud.inventory import Gpu, Inventory, InventoryService, MigDevice
from gpud.logs import get_logger
from gpud.nvml.health import EventListener, FbMemory, NvmlEvent, Readings, read_mig_memory, read_readings
from gpud.nvml.session import NvmlSession
from gpud.persist import CorruptFile, read_json, write_json_atomic
from gpud.samples import Family

log = get_logger("health")
HEALTH_VALUES = {"healthy": 0, "degraded": 1, "unhealthy": 2}
# How long health changes gather before they are saved: an XID storm costs one write, not one per
# XID, and a crash loses at most this much.
SAVE_DELAY_S = 0.2
# What /metrics says of the readings, with dcgm-exporter's names, units and types (its default counters,
# etc/default-counters.csv; docs/metrics.md): (metric, help, type, reading attribute)
GPU_READINGS = (
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock (MHz).", "gauge", "sm_clock_mhz"),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock (MHz).", "gauge", "mem_clock_mhz"),
    ("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (C).", "gauge", "memory_temp_c"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (C).", "gauge", "temperature_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (W).", "gauge", "power_w"),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Energy used since the driver loaded (mJ).", "counter", "energy_mj"),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "PCIe replays.", "counter", "pcie_replays"),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilisation (%).", "gauge", "gpu_util"),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilisation (%).", "gauge", "mem_copy_util"),
    ("DCGM_FI_DEV_ENC_UTIL", "Encoder utilisation (%).", "gauge", "enc_util"),
    ("DCGM_FI_DEV_DEC_UTIL", "Decoder utilisation (%).", "gauge", "dec_util"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (MiB).", "gauge", "fb_free_mib"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (MiB).", "gauge", "fb_used_mib"),
    ("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory the driver reserves (MiB).", "gauge", "fb_reserved_mib"),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Single-bit ECC errors since the last reset.", "counter", "ecc_sbe_volatile"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Double-bit ECC errors since the last reset.", "counter", "ecc_dbe_volatile"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Rows remapped for uncorrectable errors.", "counter",
     "remapped_uncorrectable"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Rows remapped for correctable errors.", "counter",
     "remapped_correctable"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether row remapping has failed.", "gauge", "remap_failed"),
)
# The readings a MIG device has of its own: its GPU instance's memory (FbMemory's attributes).
MIG_READINGS = frozenset(FbMemory.__dataclass_fields__)
# dcgm-exporter's window for DCGM_EXP_XID_ERRORS_COUNT (its --xid-count-window-size default, 5 min).
XID_WINDOW_MS = 300_000
# The XIDs kept for that window: an XID storm (NVIDIA/NVSentinel#1710: 168,924 XID 45 in two days on a
# fleet) costs bounded memory; past this many in 5 minutes the window count stops growing.
XID_WINDOW_MAX = 10_000
NO_XID = "No Error"  # dcgm-exporter's err_msg for err_code 0 (internal/pkg/collector/xid_errors.go)


class HealthService:
    def __init__(self, session: NvmlSession, inventory: InventoryService, bus: EventBus, catalog: XidCatalog, *,
                 check_interval_s: float = 5.0, clear_after_passes: int = 3,
                 mps_failures: Callable[[], dict[str, str]] = dict, nvlinks_path: Path | None = None,
                 state_path: Path | None = None, on_change: Callable[[], object] = lambda: None):
        self.session = session
        self.inventory = inventory
        self.bus = bus
        self.catalog = catalog
        self.tracker = HealthTracker(clear_after_passes=clear_after_passes)
        self.check_interval_s = check_interval_s
        self.readings: dict[str, Readings | None] = {}
        self.mig_memory: dict[str, FbMemory | None] = {}  # MIG device UUID (one per GPU instance) -> memory
        self.nvlink_bandwidth: dict[str, int] = {}  # GPU UUID -> NVLink data rate between the last two readings
        self.recent_xids: deque[tuple[str, int, float]] = deque(maxlen=XID_WINDOW_MAX)  # (GPU, XID, monotonic)
        self.last_xid: dict[str, tuple[int, float]] = {}  # GPU UUID -> (XID, when): dcgm-exporter's gauge
        self.xid_counts: dict[tuple[str, int], int] = {}
        self._mps_failures = mps_failures  # device UUID -> why its MPS daemon is down
        self._mps_watched: set[str] = set()
        self._on_change = on_change  # told after any health change (sharing follows)
        self._listener: EventListener | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # NVLink links seen active on each GPU (since gpud started, or kept in nvlinks_path): only
        # those count when down. A board without a bridge has every link present but inactive
        # from the start, which is no fault (reference README.md corrections).
        self._nvlinks_path = nvlinks_path
        self.corrupt_files: list[CorruptFile] = []  # persisted files that could not be read back
        self.nvlinks_ever_up: dict[str, frozenset[int]] = self._load(nvlinks_path, _links_from) or {}
        # Reasons, XID counts and the last XID of each GPU, saved on every change: a GPU unhealthy
        # before a restart is unhealthy after it, for the same reasons, and what was cleared stays so.
        self._state_path = state_path
        self._saver: asyncio.Task | None = None
        self._unsaved = False
        restored = self._load(state_path, _persisted_from)
        if restored:
            self.tracker.restore(restored.reasons)
            self.xid_counts, self.last_xid = restored.xid_counts, restored.last_xid
            log.info("health_restored", path=str(state_path), devices=len(restored.reasons))
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

    async def stop(self) -> None:
        """Stops the event thread and saves what is not saved yet."""
        if self._listener:
            self._listener.stop()
        if self._saver:
            await self._saver

    @property
    def events_problem(self) -> str | None:
        """Why NVML events (XIDs, ECC errors) are not being received now, if they are not."""
        failing = self._listener.failing if self._listener else None
        return f"NVML events are not being received, XIDs go unseen: {failing}" if failing else None

    async def _pause_events(self) -> None:
        if self._listener:
            await asyncio.to_thread(self._listener.stop)

    def _resume_events(self) -> None:
        if self._listener:
            self._listener.start()

    def _from_thread(self, event: NvmlEvent) -> None:
        self._loop.call_soon_threadsafe(self._on_event, event)

    def _on_event(self, event: NvmlEvent) -> None:
        kind, gpu = event.kind, event.gpu
        if kind == "xid":
            self._on_xid(event)
        elif kind == "ecc-dbe":
            self._publish(self.tracker.observe(gpu, "ecc", "dbe-event", (
                "unhealthy", "reset-gpu", "an uncorrectable (double-bit) ECC error was reported")), "NVML event")
        elif kind == "lost":
            log.error("gpu_lost", gpu=gpu, error=event.error, noticed_by="NVML event wait")
            asyncio.ensure_future(self.inventory.refresh("a GPU stopped answering NVML events"))
        elif kind == "back":
            log.info("gpu_back", gpu=gpu, noticed_by="NVML event registration")
            asyncio.ensure_future(self.inventory.refresh("a lost GPU answers NVML again"))
        elif kind == "error":
            log.error("nvml_event_wait_failed", error=event.error)
            asyncio.ensure_future(self.inventory.refresh("NVML event wait failed"))

    def _on_xid(self, event: NvmlEvent) -> None:
        gpu, xid = event.gpu, event.xid
        info = self.catalog.info(xid)
        self.last_xid[gpu] = (xid, time.time())
        self.recent_xids.append((gpu, xid, time.monotonic()))
        self.xid_counts[(gpu, xid)] = self.xid_counts.get((gpu, xid), 0) + 1
        (log.warning if info.affects_health else log.info)(
            "xid", gpu=gpu, xid=xid, name=info.name, gi_id=event.gi_id, ci_id=event.ci_id, severity=info.severity,
            action=info.action, affects_health=info.affects_health)
        self._publish(self.tracker.record_xid(gpu, info, event.gi_id, event.ci_id), f"XID {xid}")
        self._save_soon()  # the counts changed, whether the state did or not

    async def run_checks(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.check_interval_s)

    async def check_once(self) -> None:
        inventory = self.inventory.current
        if inventory is None:
            return
        uuids = [g.uuid for g in inventory.gpus if not g.lost]
        instances = [dev.uuid for g in inventory.gpus if not g.lost for dev in _instance_devices(g)]
        previous = self.readings
        try:
            self.readings = await self.session.call(read_readings, uuids)
            self.mig_memory = await self.session.call(read_mig_memory, instances) if instances else {}
        except Exception as exc:  # NVML unavailable: the inventory and /healthz say so
            log.warning("health_readings_failed", error=str(exc))
            return
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

    # -- persistence -------------------------------------------------------------------------

    def _load(self, path: Path | None, parse: Callable[[Any], Any]) -> Any:
        if path is None:
            return None
        document, corrupt = read_json(path, parse)
        if corrupt:
            self.corrupt_files.append(corrupt)
        return document

    def _document(self) -> dict:
        return {"reasons": self.tracker.export(),
                "xid_counts": [[uuid, xid, count] for (uuid, xid), count in sorted(self.xid_counts.items())],
                "last_xid": {uuid: [xid, when] for uuid, (xid, when) in self.last_xid.items()}}

    def _save_soon(self) -> None:
        """Saves the health state shortly, off the event loop, one write for the changes of that while."""
        if self._state_path is None:
            return
        self._unsaved = True
        if self._saver is None or self._saver.done():
            self._saver = asyncio.ensure_future(self._save_while_unsaved())

    async def _save_while_unsaved(self) -> None:
        while self._unsaved:
            await asyncio.sleep(SAVE_DELAY_S)
            self._unsaved = False
            try:
                await asyncio.to_thread(write_json_atomic, self._state_path, self._document())
            except OSError as exc:
                log.error("health_not_saved", path=str(self._state_path), error=str(exc),
                          consequence="a restart would forget the health changes since the last save")

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
            self._on_change()
            self._save_soon()

    def gpu_was_reset(self, uuid: str) -> None:
        self._publish(self.tracker.record_reset(uuid), "GPU reset")

    def clear(self, uuid: str, kind: str | None) -> None:
        self._publish(self.tracker.clear(uuid, kind), "cleared by an administrator")

    def view(self) -> dict[str, Any]:
        return self.tracker.view(self.inventory.current) if self.inventory.current else {"status": "unknown", "gpus": []}

    def collect(self) -> Iterator[Family]:
        """The readings, XIDs and health of every GPU, for /metrics, as dcgm-exporter writes them."""
        inventory = self.inventory.current
        if inventory is None:
            return
        gpus = [(gpu, gpu_labels(gpu, inventory.driver_version)) for gpu in inventory.gpus]
        for name, help_text, kind, attribute in GPU_READINGS:
            family = Family(name, help_text, kind)
            for gpu, labels in gpus:
                _add(family, labels, getattr(self.readings.get(gpu.uuid), attribute, None))
                if attribute in MIG_READINGS:
                    for dev in _instance_devices(gpu):
                        _add(family, instance_labels(labels, gpu, dev),
                             getattr(self.mig_memory.get(dev.uuid), attribute, None))
            yield family
        bandwidth = Family("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
                           "NVLink data received and sent over all links, as DCGM rates it (KiB/s / 1000).", "gauge")
        for gpu, labels in gpus:
            _add(bandwidth, labels, self.nvlink_bandwidth.get(gpu.uuid))
        yield bandwidth
        yield from self._xid_families(gpus)
        yield from self._health_families(gpus)

    def _xid_families(self, gpus: list[tuple[Gpu, dict[str, str]]]) -> Iterator[Family]:
        last_xid = Family("DCGM_FI_DEV_XID_ERRORS", "The last XID error seen on the GPU (0: none).", "gauge")
        for gpu, labels in gpus:
            xid = self.last_xid.get(gpu.uuid, (0, 0.0))[0]
            last_xid.add({**labels, "err_code": str(xid), "err_msg": self.catalog.info(xid).name if xid else NO_XID},
                         xid)
        yield last_xid
        window = Family("DCGM_EXP_XID_ERRORS_COUNT", "XID errors seen in the last window_size_in_ms, by XID.", "gauge")
        in_window = self._xids_in_window()
        for gpu, labels in gpus:
            labels = {**labels, "window_size_in_ms": str(XID_WINDOW_MS)}
            counts = sorted((xid, count) for (uuid, xid), count in in_window.items() if uuid == gpu.uuid)
            for xid, count in counts or [(None, 0)]:  # a GPU without XIDs in the window counts 0, without an xid
                window.add(labels if xid is None else {**labels, "xid": str(xid)}, count)
        yield window
        totals = {"DCGM_EXP_XID_ERRORS_TOTAL": "XID errors seen, by XID.",
                  "gpud_xid_errors_total": "XID errors seen, by GPU and XID (as DCGM_EXP_XID_ERRORS_TOTAL)."}
        by_uuid = {gpu.uuid: labels for gpu, labels in gpus}
        for name, help_text in totals.items():
            family = Family(name, help_text, "counter")
            for (uuid, xid), count in sorted(self.xid_counts.items()):
                if uuid in by_uuid:
                    family.add({**by_uuid[uuid], "xid": str(xid)}, count)
            yield family

    def _xids_in_window(self) -> dict[tuple[str, int], int]:
        since = time.monotonic() - XID_WINDOW_MS / 1000
        while self.recent_xids and self.recent_xids[0][2] < since:
            self.recent_xids.popleft()
        counts: dict[tuple[str, int], int] = {}
        for uuid, xid, _ in self.recent_xids:
            counts[(uuid, xid)] = counts.get((uuid, xid), 0) + 1
        return counts

    def _health_families(self, gpus: list[tuple[Gpu, dict[str, str]]]) -> Iterator[Family]:
        states = self.tracker.gpu_states()
        health = Family("gpud_gpu_health", "Device health: 0 healthy, 1 degraded, 2 unhealthy.", "gauge")
        for gpu, labels in gpus:
            health.add(labels, HEALTH_VALUES.get(states.get(gpu.uuid, "healthy"), 2))
            for dev in gpu.mig.devices:
                mig_labels = {**instance_labels(labels, gpu, dev), "mig_uuid": dev.uuid}
                health.add(mig_labels, HEALTH_VALUES.get(states.get(dev.uuid, "healthy"), 2))
        yield health
        lost = Family("gpud_gpu_lost", "1 when NVML reports the GPU lost.", "gauge")
        for gpu, labels in gpus:
            lost.add(labels, 1 if gpu.lost else 0)
        yield lost


def _add(family: Family, labels: dict[str, str], value: float | None) -> None:
    if value is not None:
        family.add(labels, float(value))


def _instance_devices(gpu: Gpu) -> list[MigDevice]:
    """One MIG device per GPU instance, its first compute instance's: dcgm-exporter reports GPU instances,
    and every MIG device of an instance sees the instance's memory."""
    first: dict[int, MigDevice] = {}
    for dev in sorted(gpu.mig.devices, key=lambda dev: (dev.gi_id, dev.ci_id)):
        first.setdefault(dev.gi_id, dev)
    return list(first.values())


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


def _reason(reason: Any) -> dict:
    return {key: getattr(reason, key) for key in reason.__dataclass_fields__}


class _Persisted(NamedTuple):
    reasons: dict[str, dict[Key, Reason]]
    xid_counts: dict[tuple[str, int], int]
    last_xid: dict[str, tuple[int, float]]


def _persisted_from(document: dict) -> _Persisted:
    """The health file as _document() wrote it; TypeError, ValueError or KeyError otherwise."""
    return _Persisted(parse_reasons(document["reasons"]),
                      {(str(uuid), int(xid)): int(count) for uuid, xid, count in document["xid_counts"]},
                      {str(uuid): (int(xid), float(when)) for uuid, (xid, when) in document["last_xid"].items()})


def _links_from(document: dict) -> dict[str, frozenset[int]]:
    return {str(uuid): frozenset(int(link) for link in links) for uuid, links in document.items()}
