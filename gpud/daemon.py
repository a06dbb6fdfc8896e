"""The daemon: wires the NVML session, the inventory and the API together, and runs them."""

from __future__ import annotations

import asyncio
import signal
import socket
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Callable

from gpud import __version__
from gpud.api.cdi import CdiRoutes
from gpud.api.dynamic_mig import DynamicMigRoutes
from gpud.api.check import CheckRoutes
from gpud.api.claims import ClaimRoutes
from gpud.api.gpus import GpuRoutes
from gpud.api.health import HealthRoutes
from gpud.api.kubernetes import KubernetesAgentStatus, KubernetesRoutes
from gpud.api.latency import RequestLatency
from gpud.api.metrics import MetricsRoute
from gpud.api.metrics_listener import MetricsListener, MetricsListenError
from gpud.api.mig import MigRoutes
from gpud.api.mps import MpsRoutes
from gpud.api.nfd import NfdRoutes
from gpud.api.reload import ReloadRoute
from gpud.api.remediation import RemediationRoutes
from gpud.api.server import Api, SocketInUse, UnixSocketListener
from gpud.api.serving import ApiServing, SocketClaim
from gpud.api.sharing import AllocationRoutes, SharingRoutes
from gpud.api.sim import SimRoutes, register_not_simulated
from gpud.api.slurm import SlurmRoutes
from gpud.base.errors import ErrorKind, GpudError
from gpud.base.host import boot_id
from gpud.base.lifecycle import Component, Lifecycle
from gpud.base.logs import configure_log_level, get_logger
from gpud.base.safefs import StateDirectory
from gpud.base.systemd import Notifier, SystemdStatus, inherited_socket
from gpud.cdi.writer import CdiSpecRemoved, CdiWriter
from gpud.claims import ClaimRegistry
from gpud.config import Config, ConfigError
from gpud.events import EventBus, EventType
from gpud.gpu_reset import GpuResetter
from gpud.health.active_check import ActiveCheck
from gpud.health.catalog import load_catalog
from gpud.health.remediation import Remediation
from gpud.health.service import HealthService, HostPaths
from gpud.inventory import InventoryService
from gpud.mig.desired import DesiredStore
from gpud.mig.dynamic import DynamicMig
from gpud.mig.dynamic_gpus import DynamicGpus
from gpud.mig.dynamic_records import DynamicRecords
from gpud.mig.instances import MigInstances
from gpud.mig.layouts import LayoutsFile
from gpud.mig.reconciler import MigReconciler
from gpud.mps.manager import MpsManager
from gpud.nfd.labels import machine_type, node_labels
from gpud.nfd.writer import NfdWriter
from gpud.node_operations import NodeOperations
from gpud.nvml.host_tools import host_tools_for
from gpud.nvml.reader import NodeReader
from gpud.nvml.session import NvmlSession, load_backend
from gpud.nvml.sim.host_files import SimulatedHostFiles
from gpud.nvml.vgpu import VgpuReader
from gpud.pod_resources.reader import PodResourcesReader
from gpud.processes.cgroup import CGROUPFS
from gpud.processes.host import PROC
from gpud.processes.monitor import ProcessMonitor
from gpud.python_libraries import describe as describe_python
from gpud.sharing.config import SharingConfigError
from gpud.sharing.configs import SharingConfigs
from gpud.sharing.control import SharingControl
from gpud.sharing.gpu_memory import GpuMemory
from gpud.sharing.service import SharingView, read_sharing_file
from gpud.sharing.timeslice import claim_time_slice
from gpud.slurm.writer import GresWriter

log = get_logger("daemon")


class Daemon:
    """gpud's components, made once from the config and run by one Lifecycle: started in the list's order,
    stopped in reverse (docs/architecture.md). The constructors only keep what they are given: nothing is
    claimed, read or written until start()."""

    def __init__(self, config: Config, notifier: Notifier | None = None,
                 reread: Callable[[], Config] | None = None):
        self.config, self._reread = config, reread  # reread: how SIGHUP and POST /v1/reload re-read the config
        self.notifier = notifier or Notifier({})
        self.python = describe_python()  # aiohttp is imported by now: its compiled modules, or not
        nvml, simulated = load_backend(config.simulate, config.sim_state_path, config.sim_driver)
        self.session = NvmlSession(nvml, simulated=simulated, retry_initial_s=config.nvml.init_retry_initial_s,
                                   retry_max_s=config.nvml.init_retry_max_s)
        reader = NodeReader(profiles_path=config.state_path / "mig-profiles.json", sysfs=config.sysfs_path)
        self.bus = EventBus(sequence_path=config.state_path / "watch-sequence.json")
        self.inventory = InventoryService(partial(self.session.call, reader.read),
                                          config.inventory.refresh_interval_s, config.state_path / "known-gpus.json",
                                          self.bus)
        self.latency = RequestLatency()
        self.kubernetes_agent = KubernetesAgentStatus()
        self._sharing_and_mps(config)
        self._health_and_mig(config)
        self._outputs(config)
        self._listener = UnixSocketListener(config.socket_path, group=config.api.group, inherited=inherited_socket())
        self.api = self._api(config)
        self.lifecycle = Lifecycle([
            SocketClaim(self._listener), StateDirectory(config.state_path), self.session, self.bus, self.inventory,
            *self._simulated_host_files(config), self.claims, self.health, self.remediation, self.processes,
            self.mig, self.dynamic_mig, self.sharing_control, self.mps, self.gpu_memory, self.latency,
            self.kubernetes_agent, self.nfd, self.cdi, self.slurm_gres, self.pod_resources, self.metrics_listener,
            ApiServing(self._listener, self.api, self.latency, config.api),
            SystemdStatus(self.notifier, self._ready, self.status_line)], self._gpus_ready)

    def _sharing_and_mps(self, config: Config) -> None:
        settings = config.sharing
        self.sharing_configs = SharingConfigs(settings.file, settings.configs_dir, settings.default_config,
                                              config.state_path / "sharing-choice.json")
        self.gpu_memory = GpuMemory(config.gpu_memory, notify=self.bus.publish)
        self.mps = MpsManager(self.session, self.inventory, config.mps, config.mps_pipe_root, config.mps_log_root,
                              replicas=self.sharing_configs.mps_replicas, per_client=(self.gpu_memory.per_client_devices,),
                              notify=self._mps_changed, restarts_path=config.state_path / "mps-restarts.json")
        self.claims = ClaimRegistry(config.state_path / "dra-claims.json", self.inventory,
                                    partial(boot_id, config.procfs_path), notify=self.bus.publish,
                                    converge_mps=self.mps.converge, set_time_slice=claim_time_slice,
                                    gpu_memory=self.gpu_memory, dra=config.dra)
        self.mps.add_per_client(self.claims.mps_devices)

    def _mps_changed(self, kind: str, daemon: dict) -> None:
        """An MPS daemon started, stopped or failed: on the watch stream, and in its devices' health at once
        (a reload's status line would call the node healthy until health's next check otherwise)."""
        self.bus.publish(kind, daemon)
        self.health.mps_changed()

    def _health_and_mig(self, config: Config) -> None:
        health, hooks = config.health, config.mig.hooks
        catalog = load_catalog(application_xids=health.application_xids, ignored_xids=health.ignored_xids,
                               unhealthy_xids=health.unhealthy_xids)
        self.health = HealthService(self.session, self.inventory, self.bus, catalog, settings=health,
                                    host=HostPaths(config.procfs_path, config.sysfs_path, config.kmsg_path),
                                    mps_failures=self.mps.failures,
                                    nvlinks_path=config.state_path / "nvlinks-seen-up.json",
                                    state_path=config.state_path / "health.json",
                                    kernel_log_before_nvml=not self.session.simulated)
        self.sharing = SharingView(self.inventory, self.bus, Path(config.sharing.file),
                                   unhealthy=self.health.unhealthy_devices, gpu_memory=self.gpu_memory,
                                   claimed_memory=self.claims.claimed_memory)
        self.sharing_control = SharingControl(self.sharing_configs, self.sharing, self.inventory, self.mps.converge)
        self.active_check = ActiveCheck(self.health, config.state_path / "check-last.json")
        around_gpu_change = (self.mps.before_mig_change, self.mps.after_mig_change)
        host_tools = host_tools_for(self.session.nvml, self.session.simulated)
        self.node_operations = NodeOperations()  # the one writer of the GPUs: MIG applies and resets take turns
        mig_desired = DesiredStore(config.state_path / "mig-desired.json")
        dynamic_gpus = DynamicGpus(config.dra.dynamic_mig_gpus)
        mig_instances = MigInstances(self.session, host_tools, mig_desired, dynamic_gpus)
        self.resetter = GpuResetter(self.session, self.inventory, host_tools, self.node_operations,
                                    own_pids=self.mps.own_pids, around=around_gpu_change,
                                    health_reasons=self.health.reasons_by_device, on_gpu_reset=self.health.gpu_was_reset,
                                    restore=mig_instances.restore_after_reset)
        self.health.use_resetter(self.resetter.reset_gpu)
        self.remediation = Remediation(self.health, self.resetter, self.active_check)
        self.mig = MigReconciler(self.session, self.inventory, mig_desired, mig_instances, self.resetter,
                                 self.node_operations, allow_reset=config.mig.allow_gpu_reset, dynamic=dynamic_gpus,
                                 pre_apply=hooks.pre_apply, post_apply=hooks.post_apply, hook_timeout_s=hooks.timeout_s,
                                 around_gpu_change=around_gpu_change, notify=self.bus.publish,
                                 default_layout=config.mig.default_layout,
                                 layouts=LayoutsFile(Path(config.mig.layouts_file)))
        # the processes are the host's even on a simulated node: their cgroups too, unless sysfs is set
        sysfs = config.host.sysfs or config.sysfs
        cgroupfs = Path(sysfs) / "fs" / "cgroup" if sysfs else CGROUPFS
        proc = Path(config.host.procfs) if config.host.procfs else PROC  # the host's, unless set: as cgroupfs
        self.processes = ProcessMonitor(self.session, self.inventory, health.check_interval_s, proc=proc,
                                        cgroupfs=cgroupfs)
        self.dynamic_mig = DynamicMig(self.session, self.inventory,
                                      DynamicRecords(config.state_path / "mig-dynamic.json",
                                                     partial(boot_id, config.procfs_path)),
                                      mig_instances, self.resetter, self.node_operations, dynamic_gpus,
                                      allow_reset=config.mig.allow_gpu_reset, processes=self.processes,
                                      files_current=self._files_current)

    def _outputs(self, config: Config) -> None:
        """What gpud keeps written for others (NFD's features, the CDI spec, gres.conf) and /metrics."""
        self.nfd = NfdWriter(config.nfd_features_path, self._nfd_labels, self.bus, enabled=config.nfd.enabled,
                             create_directory=bool(config.nfd.features_file or config.simulate),
                             expiry_s=config.nfd.expiry_s)
        self._sysfs = config.sysfs_path
        self._machine = machine_type(self._sysfs)  # the DMI product name: fixed while the host runs
        self._vgpu = VgpuReader(self._sysfs)  # PCI config space: read with each inventory snapshot
        self.cdi = CdiWriter(config.cdi_spec_path, config.cdi_dev_root, config.mig_minors_path, self.inventory,
                             self.sharing, self.mps.client_envs, self.bus,
                             config.cdi_driver_root if config.cdi.driver_files else None) if config.cdi.enabled \
            else CdiSpecRemoved(config.cdi_spec_path)
        slurm = config.slurm
        self.slurm_gres = GresWriter(Path(slurm.gres_file) if slurm.gres_file else None, config.mig_minors_path,
                                     config.cpu_topology_sysfs, self.inventory, self.sharing, self.bus,
                                     reconfigure=slurm.reconfigure, scontrol=slurm.scontrol,
                                     reconfigure_timeout_s=slurm.reconfigure_timeout_s)
        self.pod_resources = PodResourcesReader(config.pod_resources_socket_path, self.inventory, self.claims,
                                                self.sharing, refresh_s=config.metrics.pod_resources_refresh_s,
                                                timeout_s=config.metrics.pod_resources_timeout_s)
        self.metrics = MetricsRoute(self._collectors, changes=self._metrics_changes,
                                    pod_labels=self.pod_resources.labels)
        self.metrics_listener = MetricsListener(self.metrics, self.latency, idle_timeout_s=config.api.idle_timeout_s,
                                                shutdown_timeout_s=config.api.shutdown_timeout_s,
                                                with_processes=config.metrics.listen_process_series,
                                                with_pods=config.metrics.listen_pod_labels,
                                                listen=config.metrics.listen)

    def _api(self, config: Config) -> Api:
        body_timeout_s = config.api.body_timeout_s
        node_base = {"hostname": socket.gethostname(), "gpud_version": __version__,
                     "backend": self.session.backend_name, "simulated_preset": config.simulate,
                     "python": {key: self.python[key] for key in ("version", "implementation", "libraries")}}
        sim_routes = SimRoutes(self.session, self.inventory, body_timeout_s).register if self.session.simulated \
            else register_not_simulated
        mig_routes = MigRoutes(self.mig, self.inventory, self.mig.layouts, body_timeout_s)
        return Api(self.session, self.inventory, node_base, more_routes=(
            sim_routes, mig_routes.register,
            GpuRoutes(self.resetter, self.inventory, body_timeout_s, self.processes,
                      self.pod_resources.pods_holding).register,
            RemediationRoutes(self.remediation, self._remediation_config, self.inventory, body_timeout_s).register,
            MpsRoutes(self.mps).register,
            SharingRoutes(self.sharing, self.sharing_control.choose, body_timeout_s).register,
            AllocationRoutes(self.gpu_memory, body_timeout_s).register,
            ClaimRoutes(self.claims, body_timeout_s).register,
            DynamicMigRoutes(self.dynamic_mig, body_timeout_s).register,
            KubernetesRoutes(self._kubernetes_config, self.kubernetes_agent, body_timeout_s).register,
            NfdRoutes(self.nfd).register,
            CdiRoutes(self.cdi if isinstance(self.cdi, CdiWriter) else None).register,
            SlurmRoutes(self.slurm_gres).register,
            HealthRoutes(self.health, self.inventory, self.bus, body_timeout_s).register,
            CheckRoutes(self.active_check.run, self.active_check.last, body_timeout_s).register,
            self.metrics.register,
            ReloadRoute(self.reload_from_files if self._reread else None).register),
            admin_group=config.api.admin_group, problems=self._problems)

    def _simulated_host_files(self, config: Config) -> list[SimulatedHostFiles]:
        """On a simulated node with a CDI spec: the files the driver would have put on the host."""
        if not (self.session.simulated and config.cdi.enabled):
            return []
        return [SimulatedHostFiles(config.simulate, config.mig_minors_path,
                                   None if config.cdi.dev_root else config.cdi_dev_root,
                                   config.cdi_driver_root if config.cdi.driver_files and not config.cdi.driver_root
                                   else None, config.sim_driver)]

    async def start(self) -> None:
        """Starts every component (the API serves at once: it answers 503 until NVML is up), then brings
        NVML up in the background. A component that cannot start stops gpud before it serves anything
        (SocketInUse, a locked state directory, an invalid sharing config, MetricsListenError)."""
        python, config = self.python, self.config
        log.info("python_libraries", mode=python["libraries"], python=python["version"],
                 implementation=python["implementation"], path=python["libraries_path"], pure=python["pure"],
                 **({"note": "pure-Python aiohttp: the API serves fewer requests a second; gpud device-plugin "
                             "cannot run on this Python (no grpcio)"} if python["libraries"] != "compiled" else {}))
        await self.lifecycle.start()
        log.info("listening", socket=str(config.socket_path), backend=self.session.backend_name,
                 simulate=config.simulate, sim_state=str(config.sim_state_path) if config.simulate else None,
                 state_dir=str(config.state_path), version=__version__)

    async def _gpus_ready(self) -> None:
        await self.session.initialise()
        await self.inventory.refresh("startup")

    def _ready(self) -> bool:
        """Whether systemd hears READY=1: the first inventory is in, or NVML said why it is not."""
        return self.inventory.current is not None or self.session.error is not None

    def _problems(self) -> list[str]:
        """What /healthz reports as degraded: persisted state gpud could not use, NVML events not arriving,
        files not kept current, a background task that stopped."""
        return self.lifecycle.problems()

    def _collectors(self) -> dict[str, Component]:
        """/metrics' collectors: every component with samples, in the list's order (the text's)."""
        return {component.name: component for component in self.lifecycle.components
                if type(component).collect is not Component.collect}

    def _metrics_changes(self) -> tuple:
        """What makes a cached /metrics render stale before its max age."""
        return self.bus.sequence, self.health.readings, self.processes.current, self.pod_resources.state()

    async def _files_current(self, reason: str) -> None:
        """The CDI spec rebuilt now, not after its debounce: the DRA plugin reads it as soon as a dynamic
        MIG device is made, and a `gpud cdi` typed after a reload shows what a runtime gets. On a thread,
        as the writer's own refreshes: a build scans /dev and reads driver files."""
        if isinstance(self.cdi, CdiWriter):
            await asyncio.to_thread(self.cdi.refresh, reason)

    def _kubernetes_config(self):
        return self.config.kubernetes

    def _remediation_config(self):
        return self.config.remediation

    async def _nfd_labels(self) -> dict[str, str] | None:
        """The node's labels for NFD; None until the first inventory, and while a GPU reset is under way
        (its MIG instances come back after it: no label counts them gone). The vGPU reading scans every
        PCI device's sysfs files: a thread's work, not the event loop's."""
        inventory = self.inventory.current
        if inventory is None or self.inventory.transition is not None:
            return None
        vgpu = await asyncio.to_thread(self._vgpu.reading, inventory)
        return node_labels(inventory, self._sysfs, self._machine, self.sharing.document, self.mig.view(inventory),
                           self.health.view(), vgpu)

    def _reread_checked(self) -> Config:
        config = self._reread()
        if config.sharing.configs_dir is None:  # a named config that is invalid is reported instead
            read_sharing_file(Path(config.sharing.file))
        return config

    async def reload_from_files(self) -> str:
        """SIGHUP and POST /v1/reload: re-reads the config and applies it; returns the status line.
        Every file is read and checked before anything is applied, so one that is invalid changes
        nothing, not even the log level: GpudError (refused) config-invalid. systemd hears READY=1 after
        RELOADING=1 either way, or it would wait for the reload to time out."""
        self.notifier.reloading()
        try:
            try:  # on a thread: a large sharing file takes seconds to read, every client would wait
                config = await asyncio.to_thread(self._reread_checked)
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
        mps = self.mps.summary()
        if mps:
            parts.append(mps)
        parts.append(self.health.view()["status"])
        return " · ".join(parts)

    async def stop(self) -> None:
        log.info("stopping", in_flight_grace_s=self.config.api.shutdown_timeout_s)
        await self.lifecycle.stop()  # MPS daemons are left running on purpose: their clients keep working
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
        self.metrics_listener.with_pods = config.metrics.listen_pod_labels
        configure_log_level(config.log.level)
        await self.sharing_control.reload(config.sharing)
        await self.mps.reconfigure(config.mps)
        if config.kubernetes != self.config.kubernetes:
            self.bus.publish(EventType.KUBERNETES, asdict(config.kubernetes))
        self.config = replace(self.config, mps=config.mps, log=config.log, sharing=config.sharing,
                              metrics=config.metrics, kubernetes=config.kubernetes, remediation=config.remediation)
        # The spec runtimes read follows the new sharing config and MPS daemons before the answer.
        await self._files_current("reload")
        log.info("reloaded")

    async def _move_metrics_listener(self, address: str | None) -> None:
        try:
            await self.metrics_listener.move(address)
        except MetricsListenError as exc:
            log.error("reload_refused", error=str(exc), listening=self.metrics_listener.address,
                      why="the new metrics.listen cannot be listened on; the running config stays")
            raise GpudError(ErrorKind.CONFLICT, "metrics-listen-failed", f"{exc}; the running config stays",
                            listening=self.metrics_listener.address) from None


async def serve(config: Config, reread: Callable[[], Config] | None = None) -> int:
    """Runs until SIGTERM or SIGINT; SIGHUP re-reads the config (reread). Returns the exit code."""
    notifier = Notifier()  # first: it takes NOTIFY_SOCKET out of the environment children inherit
    daemon = Daemon(config, notifier, reread)
    try:
        await daemon.start()
    except SharingConfigError as exc:
        log.error("sharing_config_invalid", error=str(exc))
        return 2
    except MetricsListenError as exc:
        log.error("metrics_listen_failed", address=exc.address, error=exc.reason,
                  why="metrics.listen is set: gpud does not start without the listener it was asked for")
        return 1
    except SocketInUse as exc:
        log.error("socket_unavailable", socket=str(config.socket_path), error=str(exc))
        return 1
    except OSError as exc:  # the state directory is another gpud's, or a path gpud will not use
        log.error("paths_unavailable", socket=str(config.socket_path), state_dir=str(config.state_path),
                  error=str(exc))
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    reloads: set[asyncio.Task] = set()
    if reread is not None:
        loop.add_signal_handler(signal.SIGHUP, _reload_soon, reloads, daemon)
    watchdog = asyncio.create_task(notifier.watchdog(), name="watchdog")
    await stop.wait()
    watchdog.cancel()
    await daemon.stop()
    return 0


def _reload_soon(tasks: set, daemon: Daemon) -> None:
    """SIGHUP: a reload in a task of its own, kept in tasks until it ends."""
    task = asyncio.create_task(_reload_on_signal(daemon))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _reload_on_signal(daemon: Daemon) -> None:
    try:
        await daemon.reload_from_files()
    except GpudError:
        pass  # logged by reload_from_files; the running config stays
