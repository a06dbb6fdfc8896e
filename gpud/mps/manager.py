"""gpud's MPS control daemons: which devices get one, starting or adopting them, supervision,
live limit changes, and pausing them around a MIG change of their GPU."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from gpud.base.hostfile import PROC_LIST_BYTES, read_host_text
from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile, read_json, write_json_atomic
from gpud.base.samples import Family
from gpud.config import MpsConfig
from gpud.inventory import InventoryService
from gpud.model.dcgm_labels import HOSTNAME
from gpud.model.inventory import Gpu, Inventory
from gpud.model.mps import daemon_name
from gpud.model.named import Named
from gpud.mps.control import MpsBinaryMissing, MpsControl, MpsDirectories, MpsError, process_alive
from gpud.nvml import device as nvml_device
from gpud.nvml.session import NvmlSession

log = get_logger("mps")
HEALTH_PROBE_EVERY = 10  # liveness checks between two full health probes (get_server_list)
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class DaemonSpec:
    """What one daemon should be: its devices and limits. Two equal specs need no change."""

    name: str
    devices: tuple[str, ...]  # UUIDs, in the order the daemon sees them (its device indices)
    device_memory_mib: tuple[int, ...]
    gpu_indices: tuple[int, ...]  # whole GPUs whose compute mode MPS owns; empty for a MIG device
    parent_uuids: tuple[str, ...]  # the GPUs the devices live on (for MIG changes)
    active_thread_percentage: float | None
    pinned_mib: tuple[int | None, ...]


class DaemonRunState(Named):
    RUNNING = "running"
    STARTING = "starting"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass
class DaemonState:
    spec: DaemonSpec
    control: MpsControl
    state: DaemonRunState = DaemonRunState.STOPPED
    pid: int | None = None
    restarts: int = 0
    started_at: float | None = None
    last_error: str | None = None
    server_pids: list[int] = field(default_factory=list)
    next_attempt: float = 0.0
    backoff_s: float = 1.0
    paused: bool = False  # stopped on purpose (API stop, MIG change): not restarted by supervision
    check_inconclusive: bool = False  # the last supervision check could not look (EMFILE and the like)


def client_env(daemon: DaemonState, memory_mib: int | None = None, threads_percent: float | None = None) -> dict:
    """What a container needs to be a client of this daemon (GET /v1/mps/{name}/client-env, the CDI
    spec's MPS replicas): its environment, the pipe directory mount, and the host IPC it shares.
    memory_mib and threads_percent override the daemon's default limits."""
    spec = daemon.spec
    pipe = str(daemon.control.directories.pipe)
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_VISIBLE_DEVICES": ",".join(spec.devices)}
    pinned = [memory_mib if memory_mib is not None else default for default in spec.pinned_mib]
    if any(mib is not None for mib in pinned):
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{i}={mib}M" for i, mib in enumerate(pinned)
                                                          if mib is not None)
    thread_share = threads_percent if threads_percent is not None else spec.active_thread_percentage
    if thread_share is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = f"{thread_share:g}"
    return {"daemon": spec.name, "state": daemon.state, "env": env,
            "mounts": [{"source": pipe, "target": pipe, "read_only": False}],
            "host_ipc": True}  # MPS clients and the server share memory through /dev/shm


def desired_specs(config: MpsConfig, inventory: Inventory, replicas: dict[str, int] | None = None,
                  per_client: frozenset[str] = frozenset()) -> dict[str, DaemonSpec]:
    """The daemons the config asks for on this node, by name. replicas (device UUID -> MPS replicas
    from the sharing config) set the limits the mps section leaves unset: each replica gets
    100/replicas of the SMs and total/replicas of the memory, as the device plugin splits them.
    per_client: device UUIDs that get a daemon whatever the mps section says (gpu_memory covers
    them), with no default limits: each client is given its own."""
    replicas = replicas or {}
    wanted = {str(d) for d in config.devices} if config.enabled else set()
    specs = {}
    for gpu in inventory.gpus:
        if gpu.lost:
            continue
        whole = "all" in wanted or str(gpu.index) in wanted or gpu.uuid in wanted
        if gpu.mig.mode == "enabled":
            for dev in gpu.mig.devices:
                if whole or dev.uuid in wanted or dev.uuid in per_client:
                    name = daemon_name(gpu, dev)
                    specs[name] = _spec(config, name, gpu, (dev.uuid,), (dev.memory_total_mib,), (),
                                        replicas.get(dev.uuid), dev.uuid in per_client)
        elif whole or gpu.uuid in per_client:
            name = daemon_name(gpu)
            specs[name] = _spec(config, name, gpu, (gpu.uuid,), (gpu.memory_total_mib,), (gpu.index,),
                                replicas.get(gpu.uuid), gpu.uuid in per_client)
    return specs


def _spec(config: MpsConfig, name: str, gpu: Gpu, devices: tuple[str, ...], memory: tuple[int, ...],
          gpu_indices: tuple[int, ...], replicas: int | None, per_client: bool) -> DaemonSpec:
    if per_client:  # each client comes with its own limits (gpu_memory: the device plugin's Allocate)
        pinned: tuple[int | None, ...] = tuple(None for _ in memory)
    elif config.pinned_memory_limit_mib is not None:
        pinned = tuple(min(config.pinned_memory_limit_mib, m) for m in memory)
    elif config.pinned_memory_limit_percent is not None:
        pinned = tuple(int(m * config.pinned_memory_limit_percent / 100) for m in memory)
    elif replicas:
        pinned = tuple(m // replicas for m in memory)
    else:
        pinned = tuple(None for _ in memory)
    if per_client:
        threads = None
    elif config.active_thread_percentage is None and replicas:
        threads = float(100 // replicas)  # integer division, as the device plugin does (3 replicas: 33)
    else:
        threads = config.active_thread_percentage
    return DaemonSpec(name=name, devices=devices, device_memory_mib=memory, gpu_indices=gpu_indices,
                      parent_uuids=(gpu.uuid,), active_thread_percentage=threads, pinned_mib=pinned)


class MpsManager(Component):
    """gpud's MPS daemons, one per GPU or MIG device that sharing, gpu_memory or a DRA claim puts MPS on.
    They are left running when gpud stops: their clients keep working, and the next gpud adopts them."""

    name = "mps"

    def __init__(self, session: NvmlSession, inventory: InventoryService, config: MpsConfig,
                 pipe_root: Path, log_root: Path, replicas: Callable[[Inventory], dict[str, int]] | None = None,
                 per_client: tuple[Callable[[Inventory], frozenset[str]], ...] = (),
                 notify: Callable[[str, dict], object] = lambda kind, data: None,
                 restarts_path: Path | None = None):
        self.session = session
        self.inventory = inventory
        self.config = config
        self.pipe_root = pipe_root
        self.log_root = log_root
        self.daemons: dict[str, DaemonState] = {}
        self.error: str | None = None  # node-wide problem, e.g. the binary is missing
        self._lock = asyncio.Lock()
        self._checks = 0
        self._replicas = replicas or (lambda inventory: {})
        self._per_client = list(per_client)  # desired_specs' per_client is their union
        self._notify = notify  # the watch stream
        # Restarts by daemon name, kept across gpud restarts: a daemon that keeps dying shows it.
        self._restarts_path = restarts_path
        self.corrupt_files: list[CorruptFile] = []
        self._restarts: dict[str, int] = {}

    def add_per_client(self, devices: Callable[[Inventory], frozenset[str]]) -> None:
        """One more source of devices whose clients get per-client limits (a DRA claim's, which itself
        converges the daemons: it is made after them)."""
        self._per_client.append(devices)

    async def start(self, tasks: Tasks) -> None:
        if self._restarts_path:
            restarts, corrupt = read_json(self._restarts_path, _restarts_from)
            self.corrupt_files = [corrupt] if corrupt else []
            self._restarts = restarts or {}

    async def start_with_gpus(self, tasks: Tasks) -> None:
        await self.converge("startup")
        tasks.spawn(self.supervise(), "mps")

    def problems(self) -> list[str]:
        return [file.message() for file in self.corrupt_files]

    def _control(self, spec: DaemonSpec) -> MpsControl:
        directories = MpsDirectories(pipe=self.pipe_root / spec.name / "pipe", log=self.log_root / spec.name)
        return MpsControl(self.config.control_binary, directories, spec.devices, user=self.config.user)

    # -- converging on the config -----------------------------------------------------------

    async def converge(self, reason: str) -> None:
        """Starts, adopts, updates and stops daemons so they match the config and the node."""
        async with self._lock:
            inventory = self.inventory.current
            if inventory is None:
                return
            wanted = desired_specs(self.config, inventory, self._replicas(inventory),
                                   frozenset().union(*(devices(inventory) for devices in self._per_client)))
            for name in [n for n in self.daemons if n not in wanted]:
                await self._stop(self.daemons.pop(name), f"no longer configured ({reason})")
            for name, spec in wanted.items():
                daemon = self.daemons.get(name)
                if daemon is None:
                    daemon = self.daemons[name] = DaemonState(spec, self._control(spec),
                                                              restarts=self._restarts.get(name, 0))
                    await self._adopt_or_start(daemon)
                elif daemon.spec != spec:
                    await self._update(daemon, spec)

    async def _adopt_or_start(self, daemon: DaemonState) -> None:
        if not await self._adopt(daemon):
            await self._start(daemon)

    async def _adopt(self, daemon: DaemonState) -> bool:
        """Takes over the daemon already serving this pipe directory, if one runs and answers."""
        pid = daemon.control.find_pid()
        if pid is None or not await daemon.control.answers():
            return False
        daemon.pid, daemon.state, daemon.started_at = pid, DaemonRunState.RUNNING, _process_start_time(pid)
        daemon.last_error = None
        log.info("mps_daemon_adopted", daemon=daemon.spec.name, pid=pid, devices=list(daemon.spec.devices))
        await self._apply_limits(daemon)
        return True

    async def _start(self, daemon: DaemonState) -> None:
        spec = daemon.spec
        daemon.state, daemon.paused = DaemonRunState.STARTING, False
        try:
            # the binary first: EXCLUSIVE_PROCESS without an MPS daemon would leave the GPU to one process
            daemon.control.resolve_binary()
            await self._set_compute_mode(spec, "exclusive_process")
            daemon.pid = await daemon.control.start()
            await self._apply_limits(daemon)
        except MpsBinaryMissing as exc:
            self.error = str(exc)
            self._failed(daemon, str(exc))
            return
        except Exception as exc:  # MPS, OS and NVML errors alike: reported, retried with back-off
            self._failed(daemon, str(exc) or type(exc).__name__)
            return
        self.error = None
        daemon.state, daemon.started_at, daemon.last_error = DaemonRunState.RUNNING, time.time(), None
        daemon.backoff_s = 1.0
        log.info("mps_daemon_started", daemon=spec.name, pid=daemon.pid, devices=list(spec.devices),
                 pipe=str(daemon.control.directories.pipe), restarts=daemon.restarts)
        self._notify("mps", self.daemon_view(daemon))

    async def _set_compute_mode(self, spec: DaemonSpec, mode: str) -> None:
        if spec.gpu_indices:
            for index in spec.gpu_indices:
                await self.session.call(nvml_device.set_compute_mode, index, mode)
            await self.inventory.refresh(f"compute mode {mode} for MPS daemon {spec.name}")

    def _failed(self, daemon: DaemonState, error: str) -> None:
        daemon.state, daemon.last_error, daemon.pid = DaemonRunState.FAILED, error, None
        daemon.next_attempt = time.monotonic() + daemon.backoff_s
        log.error("mps_daemon_failed", daemon=daemon.spec.name, error=error, retry_in_s=daemon.backoff_s)
        daemon.backoff_s = min(daemon.backoff_s * 2, MAX_BACKOFF_S)
        self._notify("mps", self.daemon_view(daemon))

    async def _apply_limits(self, daemon: DaemonState) -> None:
        spec = daemon.spec
        await daemon.control.set_limits(spec.active_thread_percentage,
                                        {i: mib for i, mib in enumerate(spec.pinned_mib) if mib is not None})

    async def _update(self, daemon: DaemonState, spec: DaemonSpec) -> None:
        if (daemon.spec.devices, daemon.spec.gpu_indices) == (spec.devices, spec.gpu_indices):
            daemon.spec = spec
            if daemon.state is DaemonRunState.RUNNING:
                await self._apply_limits(daemon)  # live: clients started from now on get the new limits
                log.info("mps_limits_updated", daemon=spec.name, active_thread_percentage=spec.active_thread_percentage,
                         pinned_mib=list(spec.pinned_mib))
            return
        await self._stop(daemon, "its devices changed")
        daemon.spec, daemon.control = spec, self._control(spec)
        await self._start(daemon)

    async def _stop(self, daemon: DaemonState, why: str) -> None:
        try:
            if daemon.control.find_pid() is not None:
                await daemon.control.quit()
            await self._set_compute_mode(daemon.spec, "default")
        except Exception as exc:
            daemon.last_error = f"stopping: {exc}"
            log.error("mps_daemon_stop_failed", daemon=daemon.spec.name, error=str(exc))
        daemon.state, daemon.pid, daemon.server_pids = DaemonRunState.STOPPED, None, []
        log.info("mps_daemon_stopped", daemon=daemon.spec.name, why=why)
        self._notify("mps", self.daemon_view(daemon))

    # -- supervision ------------------------------------------------------------------------

    async def supervise(self) -> None:
        while True:
            await asyncio.sleep(self.config.check_interval_s)
            self._checks += 1
            async with self._lock:
                for daemon in list(self.daemons.values()):
                    await self._check(daemon, full=self._checks % HEALTH_PROBE_EVERY == 0)

    async def _check(self, daemon: DaemonState, full: bool) -> None:
        if daemon.paused or daemon.state is DaemonRunState.STOPPED:
            return
        try:
            if daemon.state is DaemonRunState.FAILED:
                if time.monotonic() >= daemon.next_attempt and not await self._adopt(daemon):
                    self._count_restart(daemon)
                    await self._start(daemon)
                return
            healthy = daemon.pid is not None and process_alive(daemon.pid)
            if healthy and full:
                try:
                    daemon.server_pids = await daemon.control.server_pids()
                except MpsError as exc:
                    healthy, daemon.last_error = False, str(exc)
            # A daemon still serving its pipe (under another PID, or after a probe that failed once) is
            # taken over again, not counted as a restart.
            if not healthy and not await self._adopt(daemon):
                log.error("mps_daemon_died", daemon=daemon.spec.name, pid=daemon.pid, error=daemon.last_error)
                self._count_restart(daemon)
                await self._start(daemon)
        except MpsError as exc:  # an adopted daemon refused its limits
            self._failed(daemon, str(exc))
        except OSError as exc:  # gpud could not look (EMFILE: no descriptor left): says nothing of the daemon
            if not daemon.check_inconclusive:  # logged once until a check goes through again
                log.warning("mps_check_inconclusive", daemon=daemon.spec.name, pid=daemon.pid, error=str(exc),
                            consequence="checked again at every interval; the daemon is not restarted for it")
            daemon.check_inconclusive = True
        else:
            daemon.check_inconclusive = False

    def _count_restart(self, daemon: DaemonState) -> None:
        daemon.restarts += 1
        self._restarts[daemon.spec.name] = daemon.restarts
        if self._restarts_path is None:
            return
        try:
            write_json_atomic(self._restarts_path, self._restarts)
        except OSError as exc:
            log.error("mps_restarts_not_saved", path=str(self._restarts_path), error=str(exc),
                      consequence="a gpud restart would count this daemon's restarts from an older figure")

    # -- explicit control and MIG changes ---------------------------------------------------

    async def stop_daemon(self, name: str) -> None:
        async with self._lock:
            daemon = self.daemons[name]
            daemon.paused = True
            await self._stop(daemon, "asked through the API")

    async def start_daemon(self, name: str) -> None:
        async with self._lock:
            daemon = self.daemons[name]
            if daemon.state is not DaemonRunState.RUNNING:
                await self._start(daemon)

    async def restart_daemon(self, name: str) -> None:
        async with self._lock:
            daemon = self.daemons[name]
            await self._stop(daemon, "restart asked through the API")
            self._count_restart(daemon)
            await self._start(daemon)

    async def before_mig_change(self, gpu_uuid: str) -> None:
        """Stops the daemons on a GPU whose MIG layout is about to change."""
        async with self._lock:
            for name, daemon in list(self.daemons.items()):
                if gpu_uuid in daemon.spec.parent_uuids and daemon.state is not DaemonRunState.STOPPED:
                    await self._stop(daemon, "MIG layout of its GPU changes")
                    del self.daemons[name]

    async def reconfigure(self, config: MpsConfig) -> None:
        """Takes a re-read config: daemons whose limits alone changed get them live."""
        self.config = config
        await self.converge("reload")

    async def after_mig_change(self, gpu_uuid: str) -> None:
        """Starts the daemons the GPU's new MIG devices call for."""
        await self.inventory.refresh("MIG change, for MPS")
        await self.converge(f"MIG layout of {gpu_uuid} changed")

    # -- views -------------------------------------------------------------------------------

    def own_pids(self) -> set[int]:
        """gpud and the MPS daemons it started: they hold the GPUs, and go away for a reset."""
        mps = {pid for d in self.daemons.values() for pid in (d.pid, *d.server_pids) if pid is not None}
        return {os.getpid(), *mps}

    def client_envs(self) -> dict[str, dict]:
        """Device UUID -> the client environment of the MPS daemon serving it, for the CDI spec's MPS replicas."""
        return {uuid: client_env(daemon) for daemon in self.daemons.values() for uuid in daemon.spec.devices}

    def failures(self) -> dict[str, str]:
        """Device UUID -> why its MPS daemon is down, for the health of those devices."""
        return {device: f"MPS daemon {d.spec.name} failed: {d.last_error}" for d in self.daemons.values()
                if d.state is DaemonRunState.FAILED and not d.paused for device in d.spec.devices}

    def summary(self) -> str | None:
        """The status line's part, e.g. "4/4 MPS daemons", or "0/4 MPS daemons (down: WHY)" while daemons
        meant to run do not (one stopped through the API is not meant to); None without daemons."""
        if not self.daemons:
            return None
        running = sum(d.state is DaemonRunState.RUNNING for d in self.daemons.values())
        why = dict.fromkeys(d.last_error or d.state.value for d in self.daemons.values()
                            if d.state is not DaemonRunState.RUNNING and not d.paused)
        return f"{running}/{len(self.daemons)} MPS daemons" + (f" (down: {'; '.join(why)})" if why else "")

    def collect(self) -> Iterator[Family]:
        """Whether each daemon runs and how often it restarted, for /metrics."""
        up = Family("gpud_mps_daemon_up", "1 when the MPS control daemon runs.", "gauge")
        restarts = Family("gpud_mps_daemon_restarts_total", "Restarts of the MPS control daemon.", "counter")
        for daemon in self.daemons.values():
            labels = {"daemon": daemon.spec.name, "hostname": HOSTNAME}
            up.add(labels, 1 if daemon.state is DaemonRunState.RUNNING else 0)
            restarts.add(labels, daemon.restarts)
        yield up
        yield restarts

    def view(self) -> dict[str, Any]:
        return {"enabled": self.config.enabled, "control_binary": self.config.control_binary, "error": self.error,
                "daemons": [self.daemon_view(d) for d in self.daemons.values()]}

    def daemon_view(self, daemon: DaemonState) -> dict[str, Any]:
        spec = daemon.spec
        return {"name": spec.name, "devices": list(spec.devices), "pid": daemon.pid, "state": daemon.state,
                "pipe_directory": str(daemon.control.directories.pipe),
                "log_directory": str(daemon.control.directories.log),
                "active_thread_percentage": spec.active_thread_percentage,
                "pinned_memory_limit_mib": list(spec.pinned_mib), "device_memory_mib": list(spec.device_memory_mib),
                "server_pids": daemon.server_pids, "restarts": daemon.restarts, "started_at": daemon.started_at,
                "last_error": daemon.last_error}


def _process_start_time(pid: int) -> float | None:
    """When an adopted daemon started (wall clock), from /proc."""
    try:
        ticks = int(read_host_text(f"/proc/{pid}/stat").rsplit(") ", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in read_host_text("/proc/stat", PROC_LIST_BYTES).splitlines()
                    if line.startswith("btime"))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _restarts_from(document: dict) -> dict[str, int]:
    restarts = {str(name): count for name, count in document.items()}
    if not all(type(count) is int and count >= 0 for count in restarts.values()):
        raise ValueError("restart counts must be whole numbers")
    return restarts
