"""The daemon: wires the NVML session, the inventory and the API together, and runs them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from gpud import __version__
from gpud.api.gpus import GpuRoutes
from gpud.api.cdi import CdiRoutes
from gpud.api.check import CheckRoutes
from gpud.api.health import HealthRoutes
from gpud.api.kubernetes import KubernetesAgentStatus, KubernetesRoutes
from gpud.api.latency import RequestLatency
from gpud.api.metrics import MetricsRoute
from gpud.api.metrics_listener import MetricsListener, MetricsListenError
from gpud.api.mig import MigRoutes
from gpud.api.mps import MpsRoutes
from gpud.api.nfd import NfdRoutes
from gpud.api.reload import ReloadRoute
from gpud.api.server import Api, SocketInUse, UnixSocketListener
from gpud.api.claims import ClaimRoutes
from gpud.api.sharing import AllocationRoutes, SharingRoutes
from gpud.api.sim import SimRoutes, register_not_simulated
from gpud.api.slurm import SlurmRoutes
from gpud.cdi.writer import CdiWriter, remove_spec
from gpud.config import Config, ConfigError
from gpud.errors import ErrorKind, GpudError
from gpud.events import EventBus
from gpud.gpu_reset import GpuResetter
from gpud.health.catalog import load_catalog
from gpud.health.active_check import ActiveCheck
from gpud.health.service import HealthService, HostPaths
from gpud.inventory import InventoryService
from gpud.logs import configure_log_level, get_logger
from gpud.mig.layouts import LayoutsFile
from gpud.mig.reconciler import MigReconciler
from gpud.mps.manager import MpsManager, client_env
from gpud.nfd.labels import machine_type, node_labels
from gpud.nfd.writer import NfdWriter
from gpud.nvml.host_tools import host_tools_for
from gpud.nvml.reader import NodeReader
from gpud.nvml.session import NvmlSession, load_backend
from gpud.processes.cgroup import CGROUPFS
from gpud.processes.host import PROC
from gpud.processes.monitor import ProcessMonitor
from gpud.python_libraries import describe as describe_python
from gpud.safefs import claim_directory
from gpud.sharing.config import SharingConfigError
from gpud.sharing.configs import POLL_INTERVAL_S, SharingConfigs
from gpud.claims import ClaimRegistry
from gpud.host import boot_id
from gpud.sharing.gpu_memory import GpuMemory
from gpud.sharing.timeslice import set_time_slice
from gpud.sharing.resources import mps_replicas
from gpud.sharing.service import SharingView, read_sharing_file
from gpud.slurm.writer import GresWriter
from gpud.systemd import Notifier, inherited_socket

log = get_logger("daemon")


class Daemon:
    def __init__(self, config: Config, notifier: Notifier | None = None,
                 reread: Callable[[], Config] | None = None):
        self.config = config
        self.notifier = notifier or Notifier({})
        # Before anything reads or writes state: a second gpud on the same socket or the same state
        # directory stops here (the socket first, so a gpud started twice is told so).
        self._listener = UnixSocketListener(config.socket_path, group=config.api.group, inherited=inherited_socket())
        self._listener.claim()
        try:
            self._state_lock = claim_directory(config.state_path, "the state directory")
        except OSError:
            self._listener.close()
            raise
        nvml, simulated = load_backend(config.simulate, config.sim_state_path, config.sim_driver)
        self.session = NvmlSession(nvml, simulated=simulated, retry_initial_s=config.nvml.init_retry_initial_s,
                                   retry_max_s=config.nvml.init_retry_max_s)
        reader = NodeReader(profiles_path=config.state_path / "mig-profiles.json", sysfs=config.sysfs_path)
        self.inventory = InventoryService(lambda known: self.session.call(reader.read, known),
                                          config.inventory.refresh_interval_s,
                                          config.state_path / "known-gpus.json")
        self.python = describe_python()  # aiohttp is imported by now: its compiled modules, or not
        node_base = {"hostname": socket.gethostname(), "gpud_version": __version__,
                     "backend": self.session.backend_name, "simulated_preset": config.simulate,
                     "python": {key: self.python[key] for key in ("version", "implementation", "libraries")}}
        self.bus = EventBus(sequence_path=config.state_path / "watch-sequence.json")
        self.latency = RequestLatency()
        settings = config.sharing
        self.sharing_configs = SharingConfigs(settings.file, settings.configs_dir, settings.default_config,
                                              config.state_path / "sharing-choice.json")
        self.sharing_configs.select(at_start=True)
        self.gpu_memory = GpuMemory(config.gpu_memory, notify=self.bus.publish)
        self.sharing = SharingView(self.sharing_configs.config, self.sharing_configs.in_force.path,
                                   unhealthy=self._unhealthy_devices, notify=self.bus.publish,
                                   about=self.sharing_configs.view(), gpu_memory=self.gpu_memory)
        self._sharing_changes = asyncio.Lock()  # a choice, a reload and the directory's poll take turns
        self.kubernetes_agent = KubernetesAgentStatus()
        self.inventory.subscribe(self.sharing.update)
        self.claims = ClaimRegistry(config.state_path / "dra-claims.json", self.inventory,
                                    lambda: boot_id(config.procfs_path), notify=self.bus.publish,
                                    on_mps_change=lambda why: self.mps.converge(why),
                                    set_time_slice=_claim_time_slice)
        self.mps = MpsManager(self.session, self.inventory, config.mps, config.mps_pipe_root, config.mps_log_root,
                              replicas=lambda inventory: mps_replicas(self.sharing.config, inventory),
                              per_client=lambda inventory: (self.gpu_memory.per_client_devices(inventory)
                                                            | self.claims.mps_devices(inventory)),
                              notify=self.bus.publish, restarts_path=config.state_path / "mps-restarts.json")
        health = config.health
        catalog = load_catalog(application_xids=health.application_xids, ignored_xids=health.ignored_xids,
                               unhealthy_xids=health.unhealthy_xids)
        self.health = HealthService(self.session, self.inventory, self.bus, catalog, settings=health,
                                    host=HostPaths(config.procfs_path, config.sysfs_path, config.kmsg_path),
                                    reset_gpu=lambda index, why: self.mig.reset_gpus([index], why=why),
                                    mps_failures=self.mps.failures,
                                    nvlinks_path=config.state_path / "nvlinks-seen-up.json",
                                    state_path=config.state_path / "health.json",
                                    on_change=lambda: self.sharing.update(self.inventory.current, reason="health"))
        self.active_check = ActiveCheck(self.health, config.state_path / "check-last.json")
        around_gpu_change = (self.mps.before_mig_change, self.mps.after_mig_change)
        self.resetter = GpuResetter(self.session, self.inventory,
                                    host_tools_for(self.session.nvml, self.session.simulated),
                                    own_pids=self._own_pids, around=around_gpu_change,
                                    health_reasons=self._health_reasons, on_gpu_reset=self.health.gpu_was_reset)
        hooks = config.mig.hooks
        self.mig = MigReconciler(self.session, self.inventory, config.state_path / "mig-desired.json", self.resetter,
                                 allow_reset=config.mig.allow_gpu_reset, pre_apply=hooks.pre_apply,
                                 post_apply=hooks.post_apply, hook_timeout_s=hooks.timeout_s,
                                 around_gpu_change=around_gpu_change, notify=self.bus.publish)
        self._mig_layouts = LayoutsFile(Path(config.mig.layouts_file))
        mig_routes = MigRoutes(self.mig, self.inventory, self._mig_layouts, config.api.body_timeout_s)
        self.inventory.subscribe(self._publish_inventory)
        self._reread = reread  # how SIGHUP and POST /v1/reload re-read the config
        body_timeout_s = config.api.body_timeout_s
        sim_routes = SimRoutes(self.session, self.inventory, body_timeout_s).register if self.session.simulated \
            else register_not_simulated
        # the processes are the host's even on a simulated node: their cgroups too, unless sysfs is set
        sysfs = config.host.sysfs or config.sysfs
        cgroupfs = Path(sysfs) / "fs" / "cgroup" if sysfs else CGROUPFS
        proc = Path(config.host.procfs) if config.host.procfs else PROC  # the host's, unless set: as cgroupfs
        self.processes = ProcessMonitor(self.session, self.inventory, health.check_interval_s, proc=proc,
                                        cgroupfs=cgroupfs)
        self.nfd = NfdWriter(config.nfd_features_path, self._nfd_labels, self.bus, enabled=config.nfd.enabled,
                             create_directory=bool(config.nfd.features_file or config.simulate),
                             expiry_s=config.nfd.expiry_s)
        self._sysfs = config.sysfs_path
        self._machine = machine_type(self._sysfs)  # the DMI product name: fixed while the host runs
        self.cdi = self._cdi_writer(config)
        slurm = config.slurm
        self.slurm_gres = GresWriter(Path(slurm.gres_file) if slurm.gres_file else None, config.mig_minors_path,
                                     config.cpu_topology_sysfs, self.inventory, self.sharing, self.bus,
                                     reconfigure=slurm.reconfigure, scontrol=slurm.scontrol,
                                     reconfigure_timeout_s=slurm.reconfigure_timeout_s)
        self.metrics = MetricsRoute({"health": self.health, "mig": self.mig, "mps": self.mps,
                                     "gpu_memory": self.gpu_memory,
                                     "latency": self.latency, "processes": self.processes},
                                    # what makes a cached render stale before its max age
                                    changes=lambda: (self.bus.sequence, self.health.readings, self.processes.current))
        # metrics.listen: the same /metrics on TCP, for Prometheus; nothing else is reachable there
        self.metrics_listener = MetricsListener(self.metrics, self.latency, idle_timeout_s=config.api.idle_timeout_s,
                                                shutdown_timeout_s=config.api.shutdown_timeout_s,
                                                with_processes=config.metrics.listen_process_series)
        self.api = Api(self.session, self.inventory, node_base, more_routes=(
            sim_routes, mig_routes.register, GpuRoutes(self.mig, self.inventory, body_timeout_s,
                                                       self.processes).register,
            MpsRoutes(self.mps).register,
            SharingRoutes(self.sharing, self.choose_sharing_config, body_timeout_s).register,
            AllocationRoutes(self.gpu_memory, body_timeout_s).register,
            ClaimRoutes(self.claims, body_timeout_s).register,
            KubernetesRoutes(lambda: self.config.kubernetes, self.kubernetes_agent, body_timeout_s).register,
            NfdRoutes(self.nfd).register,
            CdiRoutes(self.cdi).register,
            SlurmRoutes(self.slurm_gres).register,
            HealthRoutes(self.health, self.inventory, self.bus, body_timeout_s).register,
            CheckRoutes(self.active_check.run, self.active_check.last, body_timeout_s).register,
            self.metrics.register,
            ReloadRoute(self.reload_from_files if reread else None).register), admin_group=config.api.admin_group,
            problems=self._state_problems)
        self._node_task: asyncio.Task | None = None
        self._background: list[asyncio.Task] = []
        self._crashed: dict[str, str] = {}  # background task name -> what it raised
        self._published_inventory: tuple | None = None

    async def start(self) -> None:
        """Serves the API at once (it answers 503 until NVML is up), then brings NVML up in the background.
        The metrics listener first: an address that cannot be listened on stops gpud before it serves
        anything (MetricsListenError), as a listener explicitly asked for should."""
        await self.metrics_listener.start(self.config.metrics.listen)
        sock = self._listener.open()
        api = self.config.api
        await self.api.start(sock, self.latency, idle_timeout_s=api.idle_timeout_s,
                             shutdown_timeout_s=api.shutdown_timeout_s, max_connections=api.max_connections,
                             max_connections_per_peer=api.max_connections_per_peer,
                             admin_reserved_connections=api.admin_reserved_connections)
        cfg = self.config
        python = self.python
        log.info("python_libraries", mode=python["libraries"], python=python["version"],
                 implementation=python["implementation"], path=python["libraries_path"], pure=python["pure"],
                 **({"note": "pure-Python aiohttp: the API serves fewer requests a second; gpud device-plugin "
                             "cannot run on this Python (no grpcio)"} if python["libraries"] != "compiled" else {}))
        log.info("listening", socket=str(cfg.socket_path), backend=self.session.backend_name,
                 simulate=cfg.simulate, sim_state=str(cfg.sim_state_path) if cfg.simulate else None,
                 state_dir=str(cfg.state_path), version=__version__)
        self._node_task = asyncio.create_task(self._run_node(), name="node")
        if not self.session.simulated:  # a simulated node's kernel comes with its simulator: once NVML is up
            self.health.start_kernel_log()  # the kernel log and the node's own checks need no NVML
        self._start(self.health.run_node_checks(), "node-health")
        self._start(self.latency.run(), "latency")
        self._start(self.nfd.run(), "nfd")
        self._start(self._follow_sharing_configs(), "sharing-configs")
        if self.cdi:
            self._start(self.cdi.run(), "cdi")
        self._start(self.slurm_gres.run(), "slurm-gres")

    def _start(self, coroutine, name: str) -> None:
        """A task that runs as long as gpud does; one that raises is said loudly and in /healthz."""
        task = asyncio.create_task(coroutine, name=name)
        task.add_done_callback(self._background_ended)
        self._background.append(task)

    def _background_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        self._crashed[task.get_name()] = f"{type(error).__name__}: {error}"
        log.error("background_task_crashed", task=task.get_name(), error=self._crashed[task.get_name()],
                  consequence="what it keeps current stays as it was until gpud restarts", exc_info=error)

    async def _run_node(self) -> None:
        self._start(self._report_status(), "status")
        await self.session.initialise()
        await self.inventory.refresh("startup")
        self.claims.drop_earlier_boots()  # the node's boot id is known now (a simulated node's once NVML is up)
        self.health.start()
        self._start(self.health.run_checks(), "health")
        self._start(self.processes.run(), "processes")
        await self.mig.converge_at_start(self.config.mig.default_layout, self._mig_layouts)
        await self.sharing.apply_time_slice(self.inventory.current)
        await self.mps.converge("startup")
        self._start(self.mps.supervise(), "mps")
        await self.inventory.run()

    def _state_problems(self) -> list[str]:
        """What /healthz reports as degraded: persisted state gpud could not use, NVML events not arriving."""
        corrupt = [*self.health.corrupt_files, *self.bus.corrupt_files, *self.mps.corrupt_files,
                   *self.claims.corrupt_files, *self.mig.corrupt_files, *self.sharing_configs.corrupt_files]
        problems = [self.mig.problem, self.health.events_problem, self.health.kernel_log_problem, self.nfd.problem,
                    self.cdi and self.cdi.error, self.slurm_gres.error]
        crashed = [f"gpud's {name} task stopped ({error}): a bug; restart gpud" for name, error in self._crashed.items()]
        return [problem for problem in problems if problem] + [file.message() for file in corrupt] + crashed

    def _own_pids(self) -> set[int]:
        """gpud and the MPS daemons it started: they hold the GPUs, and go away for a reset."""
        mps = {pid for d in self.mps.daemons.values() for pid in (d.pid, *d.server_pids) if pid is not None}
        return {os.getpid(), *mps}

    def _health_reasons(self) -> dict[str, list[dict]]:
        """Device UUID -> its health reasons now, GPUs and MIG devices."""
        reasons = {}
        for gpu in self.health.view()["gpus"]:
            reasons[gpu["uuid"]] = gpu["reasons"]
            reasons.update({device["uuid"]: device["reasons"] for device in gpu["mig_devices"]})
        return reasons

    def _cdi_writer(self, config: Config) -> CdiWriter | None:
        """The CDI spec writer; None when cdi.enabled is false (and the spec an earlier gpud wrote is removed,
        so runtimes do not hand out devices nobody keeps current)."""
        if not config.cdi.enabled:
            remove_spec(config.cdi_spec_path)
            return None
        if self.session.simulated:
            from gpud.nvml.sim.mig_minors import write_mig_minors
            write_mig_minors(config.mig_minors_path)
            if not config.cdi.dev_root:  # the simulator's device nodes, which it makes as the driver would
                from gpud.nvml.sim.device_nodes import write_device_nodes
                write_device_nodes(config.cdi_dev_root, config.simulate)
            if config.cdi.driver_files and not config.cdi.driver_root:  # and its driver's files
                from gpud.nvml.sim.driver_tree import write_driver_tree
                write_driver_tree(config.cdi_driver_root, config.sim_driver)
        return CdiWriter(config.cdi_spec_path, config.cdi_dev_root, config.mig_minors_path, self.inventory,
                         self.sharing, self._mps_clients, self.bus,
                         config.cdi_driver_root if config.cdi.driver_files else None)

    def _mps_clients(self) -> dict[str, dict]:
        """Device UUID -> the client environment of the MPS daemon serving it, for the CDI spec's MPS replicas."""
        return {uuid: client_env(daemon) for daemon in self.mps.daemons.values() for uuid in daemon.spec.devices}

    def _nfd_labels(self) -> dict[str, str] | None:
        """The node's labels for NFD; None until the first inventory."""
        inventory = self.inventory.current
        if inventory is None:
            return None
        return node_labels(inventory, self._sysfs, self._machine, self.sharing.document, self.mig.view(inventory),
                           self.health.view())

    def _unhealthy_devices(self) -> set[str]:
        """Device UUIDs health calls unhealthy: their sharing replicas are served unhealthy. (Sharing is
        made before health, which tells it of changes, so this asks health only when called.)"""
        return {uuid for uuid, state in self.health.tracker.gpu_states().items() if state == "unhealthy"}

    async def reload_from_files(self) -> str:
        """SIGHUP and POST /v1/reload: re-reads the config and applies it; returns the status line.
        Every file is read and checked before anything is applied, so one that is invalid changes
        nothing, not even the log level: GpudError (refused) config-invalid. systemd hears READY=1 after
        RELOADING=1 either way, or it would wait for the reload to time out."""
        self.notifier.reloading()
        try:
            try:
                config = self._reread()
                if config.sharing.configs_dir is None:  # a named config that is invalid is reported instead
                    read_sharing_file(Path(config.sharing.file))
            except (ConfigError, SharingConfigError, OSError) as exc:
                log.error("reload_refused", error=str(exc), why="a config file is invalid; the running config stays")
                raise GpudError(ErrorKind.REFUSED, "config-invalid", f"{exc}; the running config stays") from None
            await self.reload(config)
        finally:
            self.notifier.ready(self.status_line())
        return self.status_line()

    def status_line(self) -> str:
        """One line for `systemctl status`, e.g. "8 GPUs · MIG all-balanced in sync · 8 MPS daemons · healthy"."""
        inventory = self.inventory.current
        if inventory is None:
            return self.session.error or "starting: reading the GPUs"
        parts = [f"{len(inventory.gpus)} GPUs"]
        mig = self.mig.view(inventory)
        if mig["layout"]:
            parts.append(f"MIG {mig['layout']} " + ("in sync" if mig["in_sync"] else mig["state"]))
        if self.mig.problem:
            parts.append(f"MIG desired state lost: {self.mig.problem}")
        running = sum(d.state == "running" for d in self.mps.daemons.values())
        if self.mps.daemons:
            parts.append(f"{running}/{len(self.mps.daemons)} MPS daemons")
        parts.append(self.health.view()["status"])
        return " · ".join(parts)

    async def _report_status(self) -> None:
        """READY=1 once the API answers and the first inventory is in (or NVML said why it is not:
        gpud serves 503 then, and systemd must not time the start out), then STATUS on changes."""
        while self.inventory.current is None and self.session.error is None:
            await asyncio.sleep(0.05)
        self.notifier.ready(self.status_line())
        log.info("ready", status=self.status_line())
        while True:
            await asyncio.sleep(1.0)
            self.notifier.status(self.status_line())

    def _publish_inventory(self, inventory) -> None:
        summary = tuple((g.uuid, g.lost, g.mig.mode, tuple(d.uuid for d in g.mig.devices)) for g in inventory.gpus)
        if summary != self._published_inventory:
            self._published_inventory = summary
            self.bus.publish("inventory", {"gpus": len(inventory.gpus),
                                           "mig_devices": sum(len(g.mig.devices) for g in inventory.gpus),
                                           "lost": [g.index for g in inventory.gpus if g.lost]})

    async def stop(self) -> None:
        self.notifier.stopping()
        log.info("stopping", in_flight_grace_s=self.config.api.shutdown_timeout_s)
        for task in [self._node_task, *self._background]:
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.health.stop()  # saves what is not saved yet
        self.bus.close()  # open watch streams end, so in-flight requests can finish
        await self.mig.stop()  # MPS daemons are left running on purpose: their clients keep working
        await self.api.stop()  # stops accepting, lets in-flight requests finish
        await self.metrics_listener.stop()
        self._listener.close()
        os.close(self._state_lock)
        await self.session.close()
        log.info("stopped")


    async def reload(self, config: Config) -> None:
        """Applies a re-read (and checked) config without dropping connections or MPS clients: MPS
        daemons whose limits alone changed get them live, a changed metrics.listen is listened on at
        once, the sharing config in force is chosen again (sharing.file, or a named config); changed
        kubernetes settings are published on the watch stream for the agent; other keys take effect
        at the next start."""
        log.info("reloading")
        await self._move_metrics_listener(config.metrics.listen)  # first: when it fails, nothing changed
        self.metrics_listener.with_processes = config.metrics.listen_process_series
        configure_log_level(config.log.level)
        settings = config.sharing
        async with self._sharing_changes:
            self.sharing_configs.configure(settings.file, settings.configs_dir, settings.default_config)
            self.sharing_configs.select(at_start=False)
            await self._apply_sharing("reload")
        await self.mps.reconfigure(config.mps)
        if config.kubernetes != self.config.kubernetes:
            self.bus.publish("kubernetes", asdict(config.kubernetes))
        self.config = replace(self.config, mps=config.mps, log=config.log, sharing=config.sharing,
                              metrics=config.metrics, kubernetes=config.kubernetes)
        log.info("reloaded")

    async def choose_sharing_config(self, name: str | None, reason: str | None) -> dict:
        """PUT /v1/sharing/config: makes `name` (None: the default) the config in force, persisted, and
        applies it as a reload does; returns the `config` block. Refusals (GpudError) change nothing."""
        async with self._sharing_changes:
            self.sharing_configs.choose(name, reason)
            self.sharing_configs.select(at_start=False)
            await self._apply_sharing("config chosen")
        await self.mps.converge("sharing config chosen")
        return self.sharing_configs.view()

    async def _follow_sharing_configs(self) -> None:
        """Re-applies the named config in force when its file changes (a ConfigMap update swaps ..data)
        or the directory's names do, without a reload: a stat and a listing every POLL_INTERVAL_S."""
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            if not self.sharing_configs.changed():
                continue
            async with self._sharing_changes:
                self.sharing_configs.select(at_start=False)
                await self._apply_sharing("configs_dir changed")
            await self.mps.converge("sharing config changed")

    async def _apply_sharing(self, reason: str) -> None:
        """The sharing document recomputed from the config in force, and its time slice applied."""
        configs = self.sharing_configs
        self.sharing.set_config(configs.config, self.inventory.current, configs.in_force.path, configs.view(), reason)
        await self.sharing.apply_time_slice(self.inventory.current)

    async def _move_metrics_listener(self, address: str | None) -> None:
        try:
            await self.metrics_listener.move(address)
        except MetricsListenError as exc:
            log.error("reload_refused", error=str(exc), listening=self.metrics_listener.address,
                      why="the new metrics.listen cannot be listened on; the running config stays")
            raise GpudError(ErrorKind.CONFLICT, "metrics-listen-failed", f"{exc}; the running config stays",
                            listening=self.metrics_listener.address) from None


async def _claim_time_slice(indices: list[int], interval: str) -> str | None:
    """A DRA claim's time-slice interval set on its GPUs: why it failed, or None."""
    result = await set_time_slice(interval.lower(), indices)
    if result["applied"]:
        return None
    return result["reason"] or "; ".join(f"GPU {g['index']}: {g['reason']}" for g in result["gpus"] if not g["applied"])


async def serve(config: Config, reread: Callable[[], Config] | None = None) -> int:
    """Runs until SIGTERM or SIGINT; SIGHUP re-reads the config (reread). Returns the exit code."""
    notifier = Notifier()  # first: it takes NOTIFY_SOCKET out of the environment children inherit
    try:
        daemon = Daemon(config, notifier, reread)
    except SharingConfigError as exc:
        log.error("sharing_config_invalid", error=str(exc))
        return 2
    except SocketInUse as exc:
        log.error("socket_unavailable", socket=str(config.socket_path), error=str(exc))
        return 1
    except OSError as exc:  # the state directory is another gpud's, or a path gpud will not use
        log.error("paths_unavailable", socket=str(config.socket_path), state_dir=str(config.state_path),
                  error=str(exc))
        return 1
    try:
        await daemon.start()
    except MetricsListenError as exc:
        log.error("metrics_listen_failed", address=exc.address, error=exc.reason,
                  why="metrics.listen is set: gpud does not start without the listener it was asked for")
        return 1
    except (SocketInUse, OSError) as exc:
        log.error("socket_unavailable", socket=str(config.socket_path), error=str(exc))
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    reloads: set[asyncio.Task] = set()
    if reread is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: _spawn(reloads, _reload_on_signal(daemon)))
    watchdog = asyncio.create_task(notifier.watchdog(), name="watchdog")
    await stop.wait()
    watchdog.cancel()
    await daemon.stop()
    return 0


def _spawn(tasks: set, coroutine) -> None:
    task = asyncio.create_task(coroutine)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _reload_on_signal(daemon: Daemon) -> None:
    try:
        await daemon.reload_from_files()
    except GpudError:
        pass  # logged by reload_from_files; the running config stays
