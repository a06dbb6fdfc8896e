"""The health monitor: NVML events, the kernel log and periodic checks feed the tracker; state changes
go to the log and the watch stream at once.

Periodic checks: each GPU's readings (the driver's recovery action and the NVLink fabric among them);
the node's own (driver mismatch, Fabric Manager, GPUDirect RDMA) and its InfiniBand ports, which need
no NVML and so are checked while NVML is down too. An XID reported by both NVML and the kernel log is
counted once. With health.auto_reset, a GPU whose driver asks for a reset is reset when nothing holds it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, NamedTuple

from gpud.config import HealthConfig
from gpud.dcgm_labels import gpu_labels, instance_labels
from gpud.events import EventBus
from gpud.health import infiniband, node
from gpud.health.catalog import XidCatalog
from gpud.health.checks import check_readings
from gpud.health.kmsg import KernelLogFollower, KernelXid
from gpud.health.tracker import DRIVER_ACTIONS, NODE, Change, HealthTracker, Key, Reason, parse_reasons
from gpud.host import boot_id
from gpud.inventory import Gpu, Inventory, InventoryService, MigDevice, normal_bus_id
from gpud.lifecycle import Component, Tasks
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
# An XID from NVML and one from the kernel log of the same GPU and number this close in time are one XID.
SAME_XID_WINDOW_S = 10.0
# How long a report waits for its twin from the other source: a kernel-log line read late (a busy
# node) still finds NVML's report of the same XID.
KEEP_SOURCES_S = 120.0
# On a GPU in MIG mode a kernel-log XID waits this long for NVML's report of it, which names the MIG
# device (the kernel line does not): the XID is then the MIG device's, not the whole GPU's.
KERNEL_XID_GRACE_S = 2.0
KERNEL_XIDS_WAITING = 1000
FABRIC_MANAGER_EVERY_S = 30.0  # systemctl is asked at most this often
AUTO_RESET_ACTIONS = ("gpu-reset", "drain-and-reset")  # the driver's actions a GPU reset answers


@dataclass(frozen=True)
class HostPaths:
    """Where the host's procfs, sysfs and kernel log are (config host.*)."""

    procfs: Path = Path("/proc")
    sysfs: Path = Path("/sys")
    kmsg: Path = Path("/dev/kmsg")


class HealthService(Component):
    name = "health"

    def __init__(self, session: NvmlSession, inventory: InventoryService, bus: EventBus, catalog: XidCatalog, *,
                 settings: HealthConfig = HealthConfig(), host: HostPaths | None = None,
                 mps_failures: Callable[[], dict[str, str]] = dict, nvlinks_path: Path | None = None,
                 state_path: Path | None = None, reset_gpu: Callable[[int, str], Awaitable[object]] | None = None,
                 kernel_log_before_nvml: bool = True):
        self.session = session
        self.inventory = inventory
        self.bus = bus
        self.catalog = catalog
        self.settings = settings
        # Without host paths (tests of one part) the node's own checks and the kernel log are off.
        self.host = host
        self.boot_id = boot_id(host.procfs) if host else ""
        self.tracker = HealthTracker(clear_after_passes=settings.clear_after_passes, boot_id=self.boot_id,
                                     reboot_escalation=(settings.reboot_escalation_count,
                                                        settings.reboot_escalation_window_h * 3600))
        self.check_interval_s = settings.check_interval_s
        self.readings: dict[str, Readings | None] = {}
        self.mig_memory: dict[str, FbMemory | None] = {}  # MIG device UUID (one per GPU instance) -> memory
        self.nvlink_bandwidth: dict[str, int] = {}  # GPU UUID -> NVLink data rate between the last two readings
        self.recent_xids: deque[tuple[str, int, float]] = deque(maxlen=XID_WINDOW_MAX)  # (GPU, XID, monotonic)
        self.last_xid: dict[str, tuple[int, float]] = {}  # GPU UUID -> (XID, when): dcgm-exporter's gauge
        self.xid_counts: dict[tuple[str, int], int] = {}
        self._mps_failures = mps_failures  # device UUID -> why its MPS daemon is down
        self._mps_watched: set[str] = set()
        # a simulated node's kernel log comes with its simulator: once NVML is up
        self._kernel_log_before_nvml = kernel_log_before_nvml
        self._listener: EventListener | None = None
        self._kernel_log: KernelLogFollower | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # (GPU UUID, XID) -> [(when, source, counted)] of the last SAME_XID_WINDOW_S: one XID, two sources
        self._recent_sources: dict[tuple[str, int], list[list]] = {}
        # Kernel-log XIDs read before the first inventory (the ring buffer replayed at start, NVML not up
        # yet): they wait for it, as many as a storm of them would leave worth keeping.
        self._kernel_xids_waiting: deque[KernelXid] = deque(maxlen=KERNEL_XIDS_WAITING)
        self.xids_by_source: dict[str, int] = {"nvml": 0, "kernel-log": 0, "both": 0}
        self.ib_ports: list[infiniband.IbPort] = []
        self._ib = infiniband.IbHealth()
        self._fabric_manager_checked = 0.0
        self.driver_versions: dict[str, str | None] = {"kernel_module": None, "library": None}
        # health.auto_reset: when gpud reset a GPU by itself (persisted: the hourly limit holds across restarts)
        self._reset_gpu = reset_gpu
        self.auto_resets: list[float] = []
        self.auto_reset_results: dict[str, int] = {}
        self._auto_reset_task: asyncio.Task | None = None
        self._last_auto_reset_said: tuple[str, str] | None = None
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
            earlier_boot = bool(self.boot_id and restored.boot_id and restored.boot_id != self.boot_id)
            self.tracker.restore(restored.reasons, earlier_boot=earlier_boot, reboot_needs=restored.reboot_needs)
            self.xid_counts, self.last_xid = restored.xid_counts, restored.last_xid
            self.auto_resets = restored.auto_resets
            log.info("health_restored", path=str(state_path), devices=len(restored.reasons), earlier_boot=earlier_boot)
        inventory.subscribe(self._on_inventory)
        # A GPU reset shuts NVML down: the event thread frees its set first and registers every
        # GPU again (those that came back included) once NVML is back.
        session.on_release(self._pause_events, self._resume_events)

    # -- inputs ------------------------------------------------------------------------------

    def _on_inventory(self, inventory: Inventory) -> None:
        self._publish(self.tracker.set_inventory(inventory), "inventory")
        while self._kernel_xids_waiting:  # read from the kernel log before NVML named the GPUs
            self._on_kernel_xid(self._kernel_xids_waiting.popleft())

    async def start(self, tasks: Tasks) -> None:
        """The kernel log and the node's own checks need no NVML: they start before it."""
        if self._kernel_log_before_nvml:
            self.start_kernel_log()
        tasks.spawn(self.run_node_checks(), "node-health")

    async def start_with_gpus(self, tasks: Tasks) -> None:
        self.start_events()
        tasks.spawn(self.run_checks(), "health")

    def problems(self) -> list[str]:
        return [problem for problem in (self.events_problem, self.kernel_log_problem) if problem] + \
            [file.message() for file in self.corrupt_files]

    def use_resetter(self, reset_gpu: Callable[[int, str], Awaitable[object]]) -> None:
        """health.auto_reset's way to reset a GPU (made after health: it reports health reasons)."""
        self._reset_gpu = reset_gpu

    def unhealthy_devices(self) -> set[str]:
        """Device UUIDs health calls unhealthy: their sharing replicas are served unhealthy."""
        return {uuid for uuid, state in self.tracker.gpu_states().items() if state == "unhealthy"}

    def reasons_by_device(self) -> dict[str, list[dict]]:
        """Device UUID -> its health reasons now, GPUs and MIG devices."""
        reasons = {}
        for gpu in self.view()["gpus"]:
            reasons[gpu["uuid"]] = gpu["reasons"]
            reasons.update({device["uuid"]: device["reasons"] for device in gpu["mig_devices"]})
        return reasons

    def start_events(self) -> None:
        """Starts the NVML event thread (NVML must be initialised)."""
        self._loop = asyncio.get_running_loop()
        self._listener = EventListener(self.session.nvml, self._from_thread)
        self._listener.start()
        self.start_kernel_log()

    def start_kernel_log(self) -> None:
        """Starts following the kernel log, if configured: it needs no NVML, so it starts before it."""
        if self.host is None or not self.settings.kernel_log or self._kernel_log:
            return
        self._loop = asyncio.get_running_loop()
        cursor = self._state_path.with_name("kmsg-cursor.json") if self._state_path else None
        self._kernel_log = KernelLogFollower(self.host.kmsg, self._kernel_xid_from_thread, cursor_path=cursor,
                                             boot_id_path=self.host.procfs / "sys" / "kernel" / "random" / "boot_id")
        self._kernel_log.start()

    async def stop(self) -> None:
        """Stops the event thread and the kernel log, and saves what is not saved yet."""
        if self._listener:
            self._listener.stop()
        if self._kernel_log:
            await asyncio.to_thread(self._kernel_log.stop)
        if self._auto_reset_task:
            self._auto_reset_task.cancel()
        if self._saver:
            await self._saver

    @property
    def kernel_log_problem(self) -> str | None:
        """Why XIDs are not being read from the kernel log now, if they are not."""
        problem = self._kernel_log.problem if self._kernel_log else None
        return f"the kernel log is not being read, XIDs NVML misses go unseen: {problem}" if problem else None

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

    def _kernel_xid_from_thread(self, line: KernelXid) -> None:
        self._loop.call_soon_threadsafe(self._on_kernel_xid, line)

    def _on_kernel_xid(self, line: KernelXid) -> None:
        inventory = self.inventory.current
        if inventory is None:
            self._kernel_xids_waiting.append(line)
            return
        gpu = next((g for g in inventory.gpus if normal_bus_id(g.pci_bus_id) == line.pci_bus_id), None)
        if gpu is None:
            log.warning("kernel_xid_unknown_gpu", bus_id=line.pci_bus_id, xid=line.xid, detail=line.detail,
                        why="no GPU of the inventory has this PCI bus id")
            return
        if gpu.mig.mode == "enabled" and self._listener and self._listener.running and not self._listener.failing:
            self._loop.call_later(KERNEL_XID_GRACE_S, self._count_xid, gpu.uuid, line.xid, line.at, "kernel-log",
                                  None, None, line.detail)
        else:
            self._count_xid(gpu.uuid, line.xid, line.at, "kernel-log", None, None, line.detail)

    def _on_xid(self, event: NvmlEvent) -> None:
        self._count_xid(event.gpu, event.xid, time.time(), "nvml", event.gi_id, event.ci_id, None)

    def _count_xid(self, gpu: str, xid: int, at: float, source: str, gi_id: int | None, ci_id: int | None,
                   detail: str | None) -> None:
        """An XID from one source; the same XID from the other source within SAME_XID_WINDOW_S is the
        one already counted."""
        recent = self._recent_sources.setdefault((gpu, xid), [])
        now = time.time()
        recent[:] = [entry for entry in recent if now - entry[0] <= KEEP_SOURCES_S]
        twin = next((entry for entry in recent if entry[1] != source and entry[2]
                     and abs(entry[0] - at) <= SAME_XID_WINDOW_S), None)
        if twin is not None:
            twin[2] = False  # matched: a third report of the same number is a new XID
            self.xids_by_source[twin[1]] -= 1
            self.xids_by_source["both"] += 1
            log.info("xid_also_reported", gpu=gpu, xid=xid, source=source, first_source=twin[1])
            return
        recent.append([at, source, True])
        self.xids_by_source[source] += 1
        self._record_xid(gpu, xid, gi_id, ci_id, source, detail)

    def _record_xid(self, gpu: str, xid: int, gi_id: int | None, ci_id: int | None, source: str,
                    detail: str | None) -> None:
        info = self.catalog.info(xid)
        self.last_xid[gpu] = (xid, time.time())
        self.recent_xids.append((gpu, xid, time.monotonic()))
        self.xid_counts[(gpu, xid)] = self.xid_counts.get((gpu, xid), 0) + 1
        (log.warning if info.affects_health else log.info)(
            "xid", gpu=gpu, xid=xid, name=info.name, gi_id=gi_id, ci_id=ci_id, severity=info.severity,
            action=info.action, affects_health=info.affects_health, source=source, detail=detail)
        self._publish(self.tracker.record_xid(gpu, info, gi_id, ci_id), f"XID {xid} ({source})")
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
            action = readings.recovery_action
            changes += self.tracker.record_driver_action(
                uuid, None if action is None else DRIVER_ACTIONS.get(action, f"action-{action}"))
        failures = self._mps_failures()
        for device in self._mps_watched - set(failures):
            changes += self.tracker.observe(device, "mps", "daemon", None)  # passes count toward clearing
        for device, why in failures.items():
            changes += self.tracker.observe(device, "mps", "daemon", ("degraded", "restart-app", why))
        self._mps_watched |= set(failures)
        self._publish(changes, "periodic checks")
        if self.settings.auto_reset:
            self._consider_auto_reset(inventory)

    # -- the node's own checks ---------------------------------------------------------------

    async def run_node_checks(self) -> None:
        """The checks that need no NVML (driver mismatch, Fabric Manager, InfiniBand), every check interval."""
        if self.host is None:
            return
        while True:
            try:
                await self.check_node_once()
            except Exception:  # a host file of a shape nobody foresaw: said, and the next pass tries again
                log.exception("node_checks_failed", retry_in_s=self.check_interval_s)
            await asyncio.sleep(self.check_interval_s)

    async def check_node_once(self) -> None:
        host = self.host
        module = await asyncio.to_thread(node.module_version, host.procfs)
        # the library gpud mapped stays what it is while gpud runs: read until found
        library = self.driver_versions["library"] or await asyncio.to_thread(node.library_version, self.session.nvml)
        self.driver_versions = {"kernel_module": module, "library": library}
        changes = self.tracker.observe(NODE, "driver", "mismatch", node.driver_mismatch(module, library))
        if time.monotonic() - self._fabric_manager_checked >= FABRIC_MANAGER_EVERY_S:
            self._fabric_manager_checked = time.monotonic()
            changes += self.tracker.observe(NODE, "fabric-manager", "not-running", await self._fabric_manager())
        if self.settings.infiniband:
            self.ib_ports = await asyncio.to_thread(infiniband.read_ports, host.sysfs)
            changes += self.tracker.set_subjects("ib:", [port.subject for port in self.ib_ports])
            for subject, problems in self._ib.check(self.ib_ports).items():
                for (kind, code), problem in problems.items():
                    changes += self.tracker.observe(subject, kind, code, problem)
            if self.settings.peermem:
                missing = await asyncio.to_thread(infiniband.peermem_problem, host.procfs, self.ib_ports)
                changes += self.tracker.observe(NODE, "rdma", "peermem",
                                                ("degraded", "fix-service", missing) if missing else None)
        self._publish(changes, "node checks")

    async def _fabric_manager(self) -> tuple[str, str, str] | None:
        """Fabric Manager's unit, where this node has NVSwitches of its own."""
        if not await asyncio.to_thread(node.local_nvswitches, self.host.procfs):
            return None
        unit = self.settings.fabric_manager_unit
        nvml = self.session.nvml
        if hasattr(nvml, "sim_fabric_manager_running"):  # the simulated node's service
            running = nvml.sim_fabric_manager_running()
            properties = {"LoadState": "loaded", "ActiveState": "active" if running else "inactive",
                          "SubState": "running" if running else "dead"}
        else:
            properties = await asyncio.to_thread(node.fabric_manager_unit, unit)
        return node.fabric_manager_problem(unit, properties)

    # -- health.auto_reset -------------------------------------------------------------------

    def _consider_auto_reset(self, inventory: Inventory) -> None:
        """One GPU at a time: the first whose driver asks for a reset, within the hourly limit."""
        if self._reset_gpu is None or (self._auto_reset_task and not self._auto_reset_task.done()):
            return
        wanting = [gpu for gpu in inventory.gpus if not gpu.lost
                   and self.tracker.driver_action(gpu.uuid) in AUTO_RESET_ACTIONS]
        if not wanting:
            return
        gpu = wanting[0]
        now = time.time()
        self.auto_resets = [when for when in self.auto_resets if now - when < 3600]
        if len(self.auto_resets) >= self.settings.auto_reset_max_per_hour:
            self._auto_reset_said(gpu, "rate-limited", f"{len(self.auto_resets)} automatic resets in the last hour "
                                                       f"already (health.auto_reset_max_per_hour): reset it by hand",
                                  once=True)
            return
        self.auto_resets.append(now)
        self._save_soon()
        self._auto_reset_task = asyncio.ensure_future(self._auto_reset(gpu))

    async def _auto_reset(self, gpu: Gpu) -> None:
        action = self.tracker.driver_action(gpu.uuid)
        log.warning("gpu_auto_reset", gpu=gpu.index, uuid=gpu.uuid, driver_action=action,
                    why="health.auto_reset: the driver asks for a GPU reset")
        try:
            await self._reset_gpu(gpu.index, f"the driver asks for a GPU reset ({action}): health.auto_reset")
        except Exception as exc:  # ResetBlocked (held, processes), ResetBusy, ResetFailed, NVML down
            blocked = type(exc).__name__ in ("ResetBlocked", "ResetBusy")
            self._auto_reset_said(gpu, "refused" if blocked else "failed", str(exc))
            return
        self._auto_reset_said(gpu, "done", "the GPU was reset")

    def _auto_reset_said(self, gpu: Gpu, result: str, message: str, once: bool = False) -> None:
        """Logged, counted and on the watch stream; `once`: only when it differs from the last said."""
        said = (gpu.uuid, result)
        if once and self._last_auto_reset_said == said:
            return
        self._last_auto_reset_said = said
        self.auto_reset_results[result] = self.auto_reset_results.get(result, 0) + 1
        (log.warning if result == "done" else log.error)("gpu_auto_reset_result", gpu=gpu.index, uuid=gpu.uuid,
                                                          result=result, message=message)
        self.bus.publish("health", {"device": gpu.uuid, "gpu_index": gpu.index, "auto_reset": result,
                                    "message": message, "cause": "health.auto_reset"})

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
                "last_xid": {uuid: [xid, when] for uuid, (xid, when) in self.last_xid.items()},
                "boot_id": self.boot_id, "reboot_needs": self.tracker.reboot_needs, "auto_resets": self.auto_resets}

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
            if self._kernel_log:  # first the records read, then what they counted: a crash between the two
                await asyncio.to_thread(self._kernel_log.save_cursor)  # saves re-counts no XID at the restart
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
                                        "driver_action": change.driver_action,
                                        "reasons": [_reason(r) for r in change.reasons]})
        if changes:
            self._save_soon()

    def fold_check(self, kind: str, verdicts: dict[str, tuple[str, str, str] | None]) -> None:
        """An active check's verdict per GPU UUID: a problem is a reason (code "dcgm") until a later run
        passes on that GPU, which takes it away at once (a run is no periodic reading to hover)."""
        changes = []
        for uuid, problem in verdicts.items():
            if problem is None:
                changes += self.tracker.clear(uuid, kind) if uuid in self.tracker.gpu_states() else []
            else:
                changes += self.tracker.observe(uuid, kind, "dcgm", problem)
        self._publish(changes, "gpud check (DCGM diagnostic)")

    def gpu_was_reset(self, uuid: str) -> None:
        self._publish(self.tracker.record_reset(uuid), "GPU reset")

    def clear(self, uuid: str, kind: str | None) -> None:
        self._publish(self.tracker.clear(uuid, kind), "cleared by an administrator")

    def view(self) -> dict[str, Any]:
        if self.inventory.current:
            return self.tracker.view(self.inventory.current)
        node_view, subjects = self.tracker.subjects_view()
        return {"status": "unknown", "node": node_view, "gpus": [], "subjects": subjects}

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
        yield from self._recovery_families(gpus)
        yield from self._node_families()

    def _recovery_families(self, gpus: list[tuple[Gpu, dict[str, str]]]) -> Iterator[Family]:
        action = Family("gpud_gpu_recovery_action", "The driver's recovery action (NVML_GPU_RECOVERY_ACTION_*: "
                                                    "0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and "
                                                    "reset), where the driver reports it.", "gauge")
        codes = {name: code for code, name in DRIVER_ACTIONS.items()}
        for gpu, labels in gpus:
            name = self.tracker.driver_action(gpu.uuid)
            if name in codes:
                action.add({**labels, "action": name}, codes[name])
        yield action
        fabric_state = Family("gpud_gpu_fabric_state", "The GPU's NVLink fabric state (1 not started, 2 in "
                                                       "progress, 3 completed), on NVSwitch systems.", "gauge")
        fabric_mask = Family("gpud_gpu_fabric_health_mask", "The GPU's NVLink fabric health mask (nvml.h "
                                                            "NVML_GPU_FABRIC_HEALTH_MASK_*).", "gauge")
        for gpu, labels in gpus:
            fabric = getattr(self.readings.get(gpu.uuid), "fabric", None)
            if fabric is not None:
                fabric_state.add(labels, fabric.state)
                _add(fabric_mask, labels, fabric.health_mask)
        yield fabric_state
        yield fabric_mask
        resets = Family("gpud_gpu_auto_resets_total", "GPU resets health.auto_reset tried, by result.", "counter")
        for result, count in sorted(self.auto_reset_results.items()):
            resets.add({"result": result}, count)
        yield resets

    def _node_families(self) -> Iterator[Family]:
        health = Family("gpud_health", "The health of what is no GPU: the node, InfiniBand ports (0 healthy, "
                                       "1 degraded, 2 unhealthy).", "gauge")
        for subject, state in sorted(self.tracker.subject_states().items()):
            health.add({"subject": subject}, HEALTH_VALUES.get(state, 2))
        yield health
        sources = Family("gpud_xids_by_source_total", "XIDs counted, by who reported them: nvml, kernel-log, "
                                                      "or both (counted once).", "counter")
        for source, count in self.xids_by_source.items():
            sources.add({"source": source}, count)
        yield sources
        versions = self.driver_versions
        if versions["kernel_module"] or versions["library"]:
            info = Family("gpud_driver_info", "The NVIDIA kernel module's and NVML library's versions (they "
                                              "differ after an unfinished driver upgrade).", "gauge")
            info.add({"kernel_module": versions["kernel_module"] or "", "library": versions["library"] or ""}, 1)
            yield info
        yield from infiniband.families(self.ib_ports)

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
    boot_id: str
    reboot_needs: dict[str, dict[str, float]]
    auto_resets: list[float]


def _persisted_from(document: dict) -> _Persisted:
    """The health file as _document() wrote it; TypeError, ValueError or KeyError otherwise. The keys
    after last_xid are absent in files of older gpud versions."""
    return _Persisted(parse_reasons(document["reasons"]),
                      {(str(uuid), int(xid)): int(count) for uuid, xid, count in document["xid_counts"]},
                      {str(uuid): (int(xid), float(when)) for uuid, (xid, when) in document["last_xid"].items()},
                      str(document.get("boot_id", "")),
                      {str(uuid): {str(boot): float(when) for boot, when in boots.items()}
                       for uuid, boots in document.get("reboot_needs", {}).items()},
                      [float(when) for when in document.get("auto_resets", [])])


def _links_from(document: dict) -> dict[str, frozenset[int]]:
    return {str(uuid): frozenset(int(link) for link in links) for uuid, links in document.items()}
