"""The health monitor: NVML events, the kernel log and periodic checks feed the tracker; state changes
go to the log and the watch stream at once.

Each source and concern has its module: NVML's events, the kernel log, each GPU's readings and the
node's own checks (gpud.health.sources), the XID counter (an XID both NVML and the kernel log report
is counted once), health.auto_reset, what is persisted, and one module per metric collector
(gpud.health.collectors). This service wires them to the tracker and is what the daemon and the API
speak to.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from gpud.base.host import boot_id
from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile
from gpud.base.samples import Family
from gpud.config import HealthConfig
from gpud.events import EventBus, EventType
from gpud.health import persistence
from gpud.health.auto_reset import AutoReset
from gpud.health.catalog import XidCatalog
from gpud.health.collectors import device_health, gpu_readings, node_health, profiling, recovery, xid_errors
from gpud.health.reasons import Change
from gpud.health.reset_budget import ResetBudget
from gpud.health.sources.gpu_checks import GpuChecks
from gpud.health.sources.kernel_log import KernelLogXids
from gpud.health.sources.node_checks import NodeChecks
from gpud.health.sources.profiling import GpmProfiling
from gpud.health.sources.nvml_events import NvmlEvents
from gpud.health.states import Health
from gpud.health.tracker import HealthTracker
from gpud.health.xid_counter import XidCounter
from gpud.inventory import InventoryService
from gpud.model.dcgm_labels import gpu_labels
from gpud.model.inventory import Inventory
from gpud.nvml.health import Readings
from gpud.nvml.session import NvmlSession

log = get_logger("health")


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
        # a simulated node's kernel log comes with its simulator: once NVML is up
        self._kernel_log_before_nvml = kernel_log_before_nvml
        self._state_path = state_path
        self.corrupt_files: list[CorruptFile] = []  # persisted files that could not be read back
        self.saver = persistence.HealthSaver(state_path, self._document, self._save_cursor)
        self.xids = XidCounter(catalog, self.tracker, self._publish, self.saver.soon)
        self.reset_budget = ResetBudget(settings.auto_reset_max_per_hour, self.saver.soon)
        self.auto_reset = AutoReset(self.tracker, bus, self.reset_budget, reset_gpu)
        self.gpu_checks = GpuChecks(session, inventory, self.tracker, mps_failures=mps_failures,
                                    nvlinks_path=nvlinks_path, corrupt_files=self.corrupt_files)
        paths = host or HostPaths()
        self.node_checks = NodeChecks(session, self.tracker, settings, procfs=paths.procfs, sysfs=paths.sysfs)
        self.events = NvmlEvents(session, inventory, self.tracker, self.xids, self._publish)
        self.profiling = GpmProfiling(session, inventory, interval_s=settings.profiling_interval_s)
        cursor = state_path.with_name("kmsg-cursor.json") if state_path else None
        self.kernel_log = KernelLogXids(inventory, self.xids, self.events, kmsg=paths.kmsg, procfs=paths.procfs,
                                        cursor_path=cursor)
        inventory.subscribe(self._on_inventory)

    def load(self) -> None:
        """Reads back what was persisted: a GPU unhealthy before a restart is unhealthy after it."""
        self.gpu_checks.load()
        state_path = self._state_path
        restored = persistence.load(state_path, persistence.persisted_from, self.corrupt_files)
        if restored:
            earlier_boot = bool(self.boot_id and restored.boot_id and restored.boot_id != self.boot_id)
            self.tracker.restore(restored.reasons, earlier_boot=earlier_boot, reboot_needs=restored.reboot_needs)
            self.xids.counts, self.xids.last_xid = restored.xid_counts, restored.last_xid
            self.reset_budget.times = restored.auto_resets
            log.info("health_restored", path=str(state_path), devices=len(restored.reasons), earlier_boot=earlier_boot)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, tasks: Tasks) -> None:
        """What was persisted read back; the kernel log and the node's own checks need no NVML: they start
        before it."""
        self.load()
        if self._kernel_log_before_nvml:
            self.start_kernel_log()
        tasks.spawn(self.run_node_checks(), "node-health")

    async def start_with_gpus(self, tasks: Tasks) -> None:
        self.start_events()
        tasks.spawn(self.run_checks(), "health")
        if self.settings.profiling:
            tasks.spawn(self.profiling.run(), "profiling")

    def start_events(self) -> None:
        """Starts the NVML event thread (NVML must be initialised)."""
        self.events.start()
        self.start_kernel_log()

    def problems(self) -> list[str]:
        return [problem for problem in (self.events_problem, self.kernel_log_problem, self.node_checks.stuck)
                if problem] + [file.message() for file in self.corrupt_files]

    def use_resetter(self, reset_gpu: Callable[[int, str], Awaitable[object]]) -> None:
        """health.auto_reset's way to reset a GPU. The resetter is made after health, whose reasons it
        reports: this is how health gets it (docs/architecture.md)."""
        self.auto_reset.reset_gpu = reset_gpu

    def unhealthy_devices(self) -> set[str]:
        """Device UUIDs health calls unhealthy: their sharing replicas are served unhealthy."""
        return {uuid for uuid, state in self.tracker.gpu_states().items() if state == Health.UNHEALTHY}

    def reasons_by_device(self) -> dict[str, list[dict]]:
        """Device UUID -> its health reasons now, GPUs and MIG devices."""
        reasons = {}
        for gpu in self.view()["gpus"]:
            reasons[gpu["uuid"]] = gpu["reasons"]
            reasons.update({device["uuid"]: device["reasons"] for device in gpu["mig_devices"]})
        return reasons

    def start_kernel_log(self) -> None:
        """Starts following the kernel log, if configured: it needs no NVML, so it starts before it."""
        if self.host is not None and self.settings.kernel_log:
            self.kernel_log.start()

    async def stop(self) -> None:
        """Stops the event thread and the kernel log, and saves what is not saved yet."""
        self.events.stop()
        await self.kernel_log.stop()
        await self.profiling.stop()
        self.auto_reset.stop()
        await self.saver.flush()

    @property
    def kernel_log_problem(self) -> str | None:
        return self.kernel_log.problem

    @property
    def events_problem(self) -> str | None:
        return self.events.problem

    @property
    def readings(self) -> dict[str, Readings | None]:
        """Each GPU's last readings, by UUID (None: the GPU could not be read)."""
        return self.gpu_checks.readings

    # -- checks ------------------------------------------------------------------------------

    async def run_checks(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.settings.check_interval_s)

    async def check_once(self) -> None:
        inventory = self.inventory.current
        if inventory is None:
            return
        changes = await self.gpu_checks.check(inventory)
        if changes is None:
            return
        self._publish(changes, "periodic checks")
        if self.settings.auto_reset:
            self.auto_reset.consider(inventory)

    async def run_node_checks(self) -> None:
        """The checks that need no NVML (driver mismatch, Fabric Manager, InfiniBand), every check interval."""
        if self.host is None:
            return
        while True:
            try:
                await self.check_node_once()
            except Exception:  # a host file of a shape nobody foresaw: said, and the next pass tries again
                log.exception("node_checks_failed", retry_in_s=self.settings.check_interval_s)
            await asyncio.sleep(self.settings.check_interval_s)

    async def check_node_once(self) -> None:
        self._publish(await self.node_checks.check(), "node checks")

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

    def mps_changed(self) -> None:
        """An MPS daemon started, stopped or failed: a failed one is its devices' problem at once, not at the
        next periodic check (which counts the passes that clear it)."""
        self._publish(self.gpu_checks.observe_mps_failures(), "MPS daemon failed")

    def gpu_was_reset(self, uuid: str) -> None:
        self._publish(self.tracker.record_reset(uuid), "GPU reset")

    def clear(self, uuid: str, kind: str | None) -> None:
        self._publish(self.tracker.clear(uuid, kind), "cleared by an administrator")

    # -- outputs -----------------------------------------------------------------------------

    def _on_inventory(self, inventory: Inventory) -> None:
        self._publish(self.tracker.set_inventory(inventory), "inventory")
        self.kernel_log.inventory_known()

    def _publish(self, changes: list[Change], cause: str) -> None:
        for change in changes:
            level = (log.error if change.state == Health.UNHEALTHY
                     else log.warning if change.state == Health.DEGRADED else log.info)
            level("device_health_changed", device=change.device, gpu=change.gpu_index, previous=change.previous,
                  state=change.state, cause=cause, reasons=[f"{r.kind}:{r.code}" for r in change.reasons])
            self.bus.publish(EventType.HEALTH, {"device": change.device, "gpu_index": change.gpu_index,
                                        "previous": change.previous, "state": change.state, "cause": cause,
                                        "driver_action": change.driver_action,
                                        "reasons": [_fields(r) for r in change.reasons]})
        if changes:
            self.saver.soon()

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
        yield from gpu_readings.collect(gpus, self.gpu_checks)
        yield from profiling.collect(gpus, self.profiling.profiles)
        yield from xid_errors.collect(gpus, self.xids)
        yield from device_health.collect(gpus, self.tracker)
        yield from recovery.collect(gpus, self.tracker, self.gpu_checks.readings, self.auto_reset)
        yield from node_health.collect(self.tracker, self.xids, self.node_checks)

    # -- persistence -------------------------------------------------------------------------

    def _document(self) -> dict:
        return persistence.health_document(reasons=self.tracker.export(), xid_counts=self.xids.counts,
                                           last_xid=self.xids.last_xid, boot_id=self.boot_id,
                                           reboot_needs=self.tracker.reboot_needs,
                                           auto_resets=self.reset_budget.times)

    async def _save_cursor(self) -> None:
        await self.kernel_log.save_cursor()


def _fields(reason: Any) -> dict:
    return {key: getattr(reason, key) for key in reason.__dataclass_fields__}
