"""The daemon: wires the NVML session, the inventory and the API together, and runs them."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

from aiohttp import web

from gpud import __version__
from gpud.api.errors import ApiError
from gpud.api.mig import MigRoutes
from gpud.api.server import Api, SocketInUse, UnixSocketListener
from gpud.config import Config
from gpud.inventory import InventoryService
from gpud.logs import get_logger
from gpud.mig.reconciler import ApplyRefused, MigReconciler
from gpud.nvml.reader import NodeReader
from gpud.nvml.session import NvmlSession, load_backend

log = get_logger("daemon")


class Daemon:
    def __init__(self, config: Config):
        self.config = config
        self.session = NvmlSession(load_backend(config.simulate, config.sim_state_path),
                                   retry_initial_s=config.nvml.init_retry_initial_s,
                                   retry_max_s=config.nvml.init_retry_max_s)
        reader = NodeReader()
        self.inventory = InventoryService(lambda known: self.session.call(reader.read, known),
                                          config.inventory.refresh_interval_s,
                                          config.state_path / "known-gpus.json")
        node_base = {"hostname": socket.gethostname(), "gpud_version": __version__,
                     "backend": self.session.backend_name, "simulated_preset": config.simulate}
        hooks = config.mig.hooks
        self.mig = MigReconciler(self.session, self.inventory, config.state_path / "mig-desired.json",
                                 allow_reset=config.mig.allow_gpu_reset, pre_apply=hooks.pre_apply,
                                 post_apply=hooks.post_apply, hook_timeout_s=hooks.timeout_s)
        mig_routes = MigRoutes(self.mig, self.inventory, Path(config.mig.layouts_file), config.api.body_timeout_s)
        self.api = Api(self.session, self.inventory, node_base, config.api.body_timeout_s,
                       more_routes=(mig_routes.register,))
        self._mig_routes = mig_routes
        self._listener = UnixSocketListener(config.socket_path)
        self._runner: web.AppRunner | None = None
        self._node_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Serves the API at once (it answers 503 until NVML is up), then brings NVML up in the background."""
        sock = self._listener.open()
        self._runner = web.AppRunner(self.api.app(), handle_signals=False, access_log=None,
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

    async def _run_node(self) -> None:
        await self.session.initialise()
        await self.inventory.refresh("startup")
        await self._converge_mig()
        await self.inventory.run()

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
        log.info("stopping", in_flight_grace_s=self.config.api.shutdown_timeout_s)
        if self._node_task:
            self._node_task.cancel()
            await asyncio.gather(self._node_task, return_exceptions=True)
        await self.mig.stop()
        if self._runner:
            await self._runner.cleanup()  # stops accepting, lets in-flight requests finish
        self._listener.close()
        await self.session.close()
        log.info("stopped")


async def serve(config: Config) -> int:
    """Runs until SIGTERM or SIGINT. Returns the process exit code."""
    daemon = Daemon(config)
    try:
        await daemon.start()
    except (SocketInUse, OSError) as exc:
        log.error("socket_unavailable", socket=str(config.socket_path), error=str(exc))
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await daemon.stop()
    return 0
