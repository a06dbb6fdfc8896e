"""The process monitor: on a timer, reads each GPU's compute processes through NVML and who owns each
from /proc, and keeps the result as an immutable snapshot for GET /v1/gpus/{id}/processes and /metrics.
A process that exited is gone from the next snapshot, and so are its series."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.base.samples import Family
from gpud.inventory import InventoryService
from gpud.model.dcgm_labels import gpu_labels, instance_labels
from gpud.model.inventory import Gpu, Inventory
from gpud.nvml.processes import DeviceProcesses, read_processes
from gpud.nvml.session import NvmlSession
from gpud.processes.cgroup import CGROUPFS
from gpud.processes.host import PROC, HostProcess, describe

log = get_logger("processes")
# SM samples are asked for over this window at least, so a refresh never misses the driver's last one.
MIN_SAMPLE_WINDOW_S = 1.0


@dataclass(frozen=True)
class ProcessView:
    pid: int
    used_memory_bytes: int | None
    sm_percent: int | None
    host: HostProcess

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "comm": self.host.comm, "uid": self.host.uid,
                "used_memory_bytes": self.used_memory_bytes, "sm_utilization_percent": self.sm_percent,
                "owner": self.host.owner.as_dict()}


@dataclass(frozen=True)
class DeviceView:
    gpu: Gpu
    read: DeviceProcesses
    profile: str | None  # the MIG device's profile ("1g.10gb"); None for a whole GPU
    processes: tuple[ProcessView, ...]

    @property
    def is_mig(self) -> bool:
        return self.read.gi_id is not None

    def as_dict(self) -> dict[str, Any]:
        mig = {"gi_id": self.read.gi_id, "ci_id": self.read.ci_id, "profile": self.profile} if self.is_mig else None
        return {"uuid": self.read.uuid, "mig": mig, "unavailable": self.read.unavailable,
                "sm_utilization_unavailable": self.read.sm_unavailable,
                "processes": [process.as_dict() for process in self.processes]}


@dataclass(frozen=True)
class ProcessSnapshot:
    devices: tuple[DeviceView, ...]
    read_at: float  # wall clock
    error: str | None = None  # why nothing could be read (NVML unavailable)

    def for_device(self, gpu: Gpu, uuid: str) -> list[DeviceView]:
        """The GPU's devices (itself, or its MIG devices), or only the device `uuid` names."""
        return [device for device in self.devices
                if device.gpu.uuid == gpu.uuid and uuid in (gpu.uuid, device.read.uuid)]


class ProcessMonitor(Component):
    name = "processes"

    def __init__(self, session: NvmlSession, inventory: InventoryService, interval_s: float, proc: Path = PROC,
                 cgroupfs: Path = CGROUPFS):
        self.session = session
        self.inventory = inventory
        self.interval_s = interval_s
        self.proc = proc
        self.cgroupfs = cgroupfs
        self.current: ProcessSnapshot | None = None
        self._seen: set[tuple[str, int]] = set()  # (device UUID, PID) in the last snapshot, for the log

    async def start_with_gpus(self, tasks: Tasks) -> None:
        tasks.spawn(self._read_on_interval(), "processes")

    async def _read_on_interval(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def refresh(self) -> None:
        inventory = self.inventory.current
        if inventory is None:
            return
        started = time.time()
        since_us = int((started - max(2 * self.interval_s, MIN_SAMPLE_WINDOW_S)) * 1_000_000)
        uuids = [gpu.uuid for gpu in inventory.gpus]  # a lost GPU too: its entry says it is lost
        try:
            read = await self.session.call(read_processes, uuids, since_us)
        except Exception as exc:  # NVML unavailable or mid-reset: list nothing rather than stale processes
            log.warning("processes_read_failed", error=str(exc))
            self.current = ProcessSnapshot((), started, error=str(exc))
            return
        # /proc reads block (briefly): off the event loop, as the NVML calls are.
        devices = await asyncio.to_thread(self._describe, inventory, read)
        self.current = ProcessSnapshot(tuple(devices), started)
        self._log_changes(devices)

    def _describe(self, inventory: Inventory, read: list[DeviceProcesses]) -> list[DeviceView]:
        gpus = {gpu.uuid: gpu for gpu in inventory.gpus}
        profiles = {dev.uuid: dev.profile for gpu in inventory.gpus for dev in gpu.mig.devices}
        views = []
        for device in read:
            gpu = gpus.get(device.gpu_uuid)
            if gpu is None:
                continue  # gone from the inventory since
            processes = tuple(ProcessView(p.pid, p.used_memory_bytes, p.sm_percent, describe(p.pid, self.proc, self.cgroupfs))
                              for p in device.processes)
            views.append(DeviceView(gpu, device, profiles.get(device.uuid), processes))
        return views

    def _log_changes(self, devices: list[DeviceView]) -> None:
        now = {(device.read.uuid, process.pid): (device, process) for device in devices for process in device.processes}
        for key in now.keys() - self._seen:
            device, process = now[key]
            owner = process.host.owner
            log.info("gpu_process_started", gpu=device.gpu.index, device=device.read.uuid, pid=process.pid,
                     comm=process.host.comm, owner=owner.kind, container_id=owner.container_id,
                     systemd_unit=owner.systemd_unit)
        for device_uuid, pid in self._seen - now.keys():
            log.info("gpu_process_ended", device=device_uuid, pid=pid, why="no longer listed by the driver")
        self._seen = set(now)

    def collect(self) -> Iterator[Family]:
        """Per process: GPU memory and SM utilisation; per device: how many compute processes run."""
        memory = Family("gpud_process_gpu_memory_used_bytes",
                        "GPU memory a compute process uses on a GPU or MIG device.", "gauge")
        sm = Family("gpud_process_sm_utilization_percent",
                    "SM utilisation of a compute process (whole GPUs; NVML has none on MIG devices).", "gauge")
        count = Family("gpud_device_compute_processes", "Compute processes running on a GPU or MIG device.", "gauge")
        snapshot, inventory = self.current, self.inventory.current
        for device in snapshot.devices if snapshot and inventory else ():
            labels = _device_labels(device, inventory.driver_version)
            if device.read.unavailable is None:
                count.add(labels, len(device.processes))
            for process in device.processes:
                process_labels = {**labels, **_process_labels(process)}
                if process.used_memory_bytes is not None:
                    memory.add(process_labels, process.used_memory_bytes)
                if process.sm_percent is not None:
                    sm.add(process_labels, process.sm_percent)
        yield from (memory, sm, count)


def _device_labels(device: DeviceView, driver_version: str) -> dict[str, str]:
    """dcgm-exporter's labels of the GPU, and of its GPU instance for a MIG device (the same as the
    health series', so a dashboard joins them), with the MIG device's UUID."""
    labels = gpu_labels(device.gpu, driver_version)
    mig = next((dev for dev in device.gpu.mig.devices if dev.uuid == device.read.uuid), None)
    return {**instance_labels(labels, device.gpu, mig), "mig_uuid": mig.uuid} if mig else labels


def _process_labels(process: ProcessView) -> dict[str, str]:
    """pid and comm, and the owner: container (runtime, ID, pod UID) or systemd unit. Labels without a
    value are left out (in Prometheus an empty label is an absent one)."""
    owner = process.host.owner
    labels = {"pid": str(process.pid), "comm": process.host.comm, "owner": owner.kind,
              "container_runtime": owner.container_runtime, "container_id": owner.container_id,
              "pod_uid": owner.pod_uid, "systemd_unit": owner.systemd_unit}
    return {name: value for name, value in labels.items() if value}
