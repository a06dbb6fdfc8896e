"""The daemon: wires the NVML session, the inventory and the API together, and runs them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from dataclasses import replace
from pathlib import Path
from typing import Callable

from aiohttp import web

from gpud import __version__
from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, error_response
from gpud.api.gpus import GpuRoutes
from gpud.api.health import HealthRoutes
from gpud.api.latency import RequestLatency
from gpud.api.metrics import MetricsRoute
from gpud.api.mig import MigRoutes
from gpud.api.mps import MpsRoutes
from gpud.api.server import Api, SocketInUse, UnixSocketListener
from gpud.api.views import encode
from gpud.config import Config, ConfigError
from gpud.events import EventBus
from gpud.gpu_reset import GpuResetter
from gpud.health.catalog import load_catalog
from gpud.health.service import HealthService
from gpud.inventory import InventoryService
from gpud.logs import configure_log_level, get_logger
from gpud.mig.reconciler import ApplyRefused, MigReconciler
from gpud.mps.manager import MpsManager
from gpud.nvml.host_tools import host_tools_for
from gpud.nvml.reader import NodeReader
from gpud.nvml.session import NvmlSession, load_backend
from gpud.sharing.config import SharingConfigError
from gpud.sharing.resources import mps_replicas
from gpud.sharing.service import SharingView, read_sharing_file
from gpud.systemd import Notifier, inherited_socket

log = get_logger("daemon")


class Daemon:
    def __init__(self, config: Config, notifier: Notifier | None = None):
        self.config = config
        self.notifier = notifier or Notifier({})
        self.session = NvmlSession(load_backend(config.simulate, config.sim_state_path, config.sim_driver),
                                   retry_initial_s=config.nvml.init_retry_initial_s,
                                   retry_max_s=config.nvml.init_retry_max_s)
        reader = NodeReader(profiles_path=config.state_path / "mig-profiles.json")
        self.inventory = InventoryService(lambda known: self.session.call(reader.read, known),
                                          config.inventory.refresh_interval_s,
                                          config.state_path / "known-gpus.json")
        node_base = {"hostname": socket.gethostname(), "gpud_version": __version__,
                     "backend": self.session.backend_name, "simulated_preset": config.simulate}
        sharing_path = Path(config.sharing.file)
        self.sharing = SharingView(read_sharing_file(sharing_path), sharing_path)
        self.inventory.subscribe(self.sharing.update)
        self.mps = MpsManager(self.session, self.inventory, config.mps, config.mps_pipe_root, config.mps_log_root,
                              replicas=lambda inventory: mps_replicas(self.sharing.config, inventory))
        around_gpu_change = (self.mps.before_mig_change, self.mps.after_mig_change)
        self.resetter = GpuResetter(self.session, self.inventory,
                                    host_tools_for(self.session.nvml, self.session.simulated),
                                    own_pids=self._own_pids, around=around_gpu_change,
                                    health_reasons=self._health_reasons)
        hooks = config.mig.hooks
        self.mig = MigReconciler(self.session, self.inventory, config.state_path / "mig-desired.json", self.resetter,
                                 allow_reset=config.mig.allow_gpu_reset, pre_apply=hooks.pre_apply,
                                 post_apply=hooks.post_apply, hook_timeout_s=hooks.timeout_s,
                                 around_gpu_change=around_gpu_change)
        mig_routes = MigRoutes(self.mig, self.inventory, Path(config.mig.layouts_file), config.api.body_timeout_s)
        self.bus = EventBus()
        self.latency = RequestLatency()
        health = config.health
        catalog = load_catalog(application_xids=health.application_xids, ignored_xids=health.ignored_xids,
                               unhealthy_xids=health.unhealthy_xids)
        self.health = HealthService(self.session, self.inventory, self.bus, catalog,
                                    check_interval_s=health.check_interval_s,
                                    clear_after_passes=health.clear_after_passes,
                                    mps_failures=self.mps.failures,
                                    nvlinks_path=config.state_path / "nvlinks-seen-up.json")
        self.sharing.unhealthy = lambda: {uuid for uuid, state in self.health.tracker.gpu_states().items()
                                          if state == "unhealthy"}
        self.resetter.after_gpu_reset = self.health.gpu_was_reset
        self.health.listeners.append(lambda: self.sharing.update(self.inventory.current, reason="health"))
        for source in (self.mig, self.mps, self.sharing):
            source.notify = self.bus.publish
        self.inventory.subscribe(self._publish_inventory)
        self.api = Api(self.session, self.inventory, node_base, config.api.body_timeout_s, more_routes=(
            mig_routes.register, GpuRoutes(self.mig, self.inventory, config.api.body_timeout_s).register,
            MpsRoutes(self.mps).register, self.sharing.register,
            HealthRoutes(self.health, self.inventory, self.bus, config.api.body_timeout_s).register,
            MetricsRoute(self.inventory, self.health, self.mig, self.mps, self.latency).register,
            self._register_reload), admin_group=config.api.admin_group)
        self.reread: Callable[[], Config] | None = None  # how SIGHUP and POST /v1/reload re-read the config
        self._mig_routes = mig_routes
        self._listener = UnixSocketListener(config.socket_path, group=config.api.group, inherited=inherited_socket())
        self._runner: web.AppRunner | None = None
        self._node_task: asyncio.Task | None = None
        self._background: list[asyncio.Task] = []
        self._published_inventory: tuple | None = None

    async def start(self) -> None:
        """Serves the API at once (it answers 503 until NVML is up), then brings NVML up in the background."""
        sock = self._listener.open()
        self._runner = web.AppRunner(self.api.app(), handle_signals=False, access_log=RequestLatency.logger(),
                                     access_log_class=self.latency.access_logger_class(),
                                     keepalive_timeout=self.config.api.idle_timeout_s,
                                     # after an error, read the rest of an unwanted body for 1 s at most
                                     lingering_time=1.0,
                                     shutdown_timeout=self.config.api.shutdown_timeout_s)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        cfg = self.config
        log.info("listening", socket=str(cfg.socket_path), backend=self.session.backend_name,
                 simulate=cfg.simulate, sim_state=str(cfg.sim_state_path) if cfg.simulate else None,
                 state_dir=str(cfg.state_path), version=__version__)
        self._node_task = asyncio.create_task(self._run_node(), name="node")
        self._background.append(asyncio.create_task(self.latency.run(), name="latency"))

    async def _run_node(self) -> None:
        self._background.append(asyncio.create_task(self._report_status(), name="status"))
        await self.session.initialise()
        await self.inventory.refresh("startup")
        self.health.start()
        self._background.append(asyncio.create_task(self.health.run_checks(), name="health"))
        await self._converge_mig()
        await self.sharing.apply_time_slice(self.inventory.current)
        await self.mps.converge("startup")
        self._background.append(asyncio.create_task(self.mps.supervise(), name="mps"))
        await self.inventory.run()

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

    def _register_reload(self, app: web.Application) -> None:
        app.router.add_post("/v1/reload", self._reload_route)

    @admin_only
    async def _reload_route(self, request: web.Request) -> web.Response:
        if self.reread is None:
            return error_response(501, "reload-unavailable", "this gpud was started without a config to re-read")
        try:
            await self.reload(self.reread())
        except (ConfigError, SharingConfigError, OSError) as exc:
            log.error("reload_refused", error=str(exc), why="a config file is invalid; the running config stays")
            return error_response(422, "config-invalid", f"{exc}; the running config stays")
        return web.Response(body=encode({"reloaded": True, "status": self.status_line()}),
                            content_type="application/json")

    def status_line(self) -> str:
        """One line for `systemctl status`, e.g. "8 GPUs · MIG all-balanced in sync · 8 MPS daemons · healthy"."""
        inventory = self.inventory.current
        if inventory is None:
            return self.session.error or "starting: reading the GPUs"
        parts = [f"{len(inventory.gpus)} GPUs"]
        mig = self.mig.view(inventory)
        if mig["layout"]:
            parts.append(f"MIG {mig['layout']} " + ("in sync" if mig["in_sync"] else mig["state"]))
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

    async def _converge_mig(self) -> None:
        """Finishes what a crash interrupted, or applies mig.default_layout when it is new."""
        default = self.config.mig.default_layout
        chosen_by_api = self.mig.desired_source == "api"
        try:
            if default and not chosen_by_api and self.mig.status.layout != default:
                await self.mig.apply(self._mig_routes.layout(default), source="default_layout")
                self.mig.started = True
                await self.mig.wait()
            else:
                self.mig.started = True
                await self.mig.reconcile("startup")
        except (ApiError, ApplyRefused) as exc:
            self.mig.started = True
            self.mig.status.state, self.mig.status.error = "failed", f"mig.default_layout '{default}': {exc}"
            log.error("mig_default_layout_failed", layout=default, error=str(exc))

    async def stop(self) -> None:
        self.notifier.stopping()
        log.info("stopping", in_flight_grace_s=self.config.api.shutdown_timeout_s)
        for task in [self._node_task, *self._background]:
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self.health.stop()
        self.bus.close()  # open watch streams end, so in-flight requests can finish
        await self.mig.stop()  # MPS daemons are left running on purpose: their clients keep working
        if self._runner:
            await self._runner.cleanup()  # stops accepting, lets in-flight requests finish
        self._listener.close()
        await self.session.close()
        log.info("stopped")


    async def reload(self, config: Config) -> None:
        """Applies a re-read config without dropping connections or MPS clients: MPS daemons whose
        limits alone changed get them live; other keys take effect at the next start."""
        log.info("reloading")
        self.notifier.reloading()
        configure_log_level(config.log.level)
        self.sharing.update(self.inventory.current, read_sharing_file(Path(config.sharing.file)), "reload")
        await self.sharing.apply_time_slice(self.inventory.current)
        self.mps.config = config.mps
        await self.mps.converge("reload")
        self.config = replace(self.config, mps=config.mps, log=config.log, sharing=config.sharing)
        self.notifier.ready(self.status_line())
        log.info("reloaded")


async def serve(config: Config, reread: Callable[[], Config] | None = None) -> int:
    """Runs until SIGTERM or SIGINT; SIGHUP re-reads the config (reread). Returns the exit code."""
    notifier = Notifier()  # first: it takes NOTIFY_SOCKET out of the environment children inherit
    try:
        daemon = Daemon(config, notifier)
        daemon.reread = reread
    except SharingConfigError as exc:
        log.error("sharing_config_invalid", error=str(exc))
        return 2
    try:
        await daemon.start()
    except (SocketInUse, OSError) as exc:
        log.error("socket_unavailable", socket=str(config.socket_path), error=str(exc))
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    reloads: set[asyncio.Task] = set()
    if reread is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: _spawn(reloads, _reload(daemon, reread)))
    watchdog = asyncio.create_task(notifier.watchdog(), name="watchdog")
    await stop.wait()
    watchdog.cancel()
    await daemon.stop()
    return 0


def _spawn(tasks: set, coroutine) -> None:
    task = asyncio.create_task(coroutine)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _reload(daemon: Daemon, reread: Callable[[], Config]) -> None:
    try:
        await daemon.reload(reread())
    except (ConfigError, SharingConfigError, OSError) as exc:
        log.error("reload_refused", error=str(exc), why="a config file is invalid; the running config stays")
