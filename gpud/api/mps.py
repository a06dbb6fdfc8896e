"""The MPS routes: daemons, what a client container needs, and start/stop/restart."""

from __future__ import annotations

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError
from gpud.api.responses import json_response
from gpud.base.errors import ErrorKind
from gpud.mps.manager import DaemonRunState, DaemonState, MpsManager, client_env


class MpsRoutes:
    def __init__(self, manager: MpsManager):
        self.manager = manager

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/mps", self.status)
        app.router.add_get("/v1/mps/{name}/client-env", self.client_env)
        for action in ("start", "stop", "restart"):
            app.router.add_post(f"/v1/mps/{{name}}/{action}", self.control)

    async def status(self, request: web.Request) -> web.Response:
        return json_response(self.manager.view())

    def _daemon(self, request: web.Request) -> DaemonState:
        name = request.match_info["name"]
        daemon = self.manager.daemons.get(name)
        if daemon is None:
            known = ", ".join(self.manager.daemons) or "none (is mps.enabled true?)"
            raise ApiError(ErrorKind.NOT_FOUND, "mps-daemon-not-found", f"no MPS daemon '{name}'; daemons: {known}")
        return daemon

    async def client_env(self, request: web.Request) -> web.Response:
        daemon = self._daemon(request)
        spec = daemon.spec
        memory = _query_number(request, "memory_mib", int)
        threads = _query_number(request, "threads_percent", float)
        if memory is not None and not 0 < memory <= min(spec.device_memory_mib):
            raise ApiError(ErrorKind.REFUSED, "limit-beyond-device",
                           f"memory_mib must be between 1 and {min(spec.device_memory_mib)} "
                           f"(the memory of the daemon's devices), got {memory}")
        if threads is not None and not 0 < threads <= 100:
            raise ApiError(ErrorKind.REFUSED, "limit-beyond-device",
                           f"threads_percent must be above 0 and at most 100, got {threads:g}")
        return json_response(client_env(daemon, memory, threads))

    @admin_only
    async def control(self, request: web.Request) -> web.Response:
        daemon = self._daemon(request)
        action = request.path.rsplit("/", 1)[1]
        await getattr(self.manager, f"{action}_daemon")(daemon.spec.name)
        view = self.manager.daemon_view(daemon)
        if action != "stop" and daemon.state is not DaemonRunState.RUNNING:
            raise ApiError(ErrorKind.TOOL_FAILED, "mps-start-failed",
                           daemon.last_error or "the MPS daemon did not start", daemon=view)
        return json_response(view)


def _query_number(request: web.Request, name: str, kind: type):
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        return kind(raw)
    except ValueError:
        raise ApiError(ErrorKind.INVALID, "invalid-query", f"query '{name}' must be a number, got {raw!r}") from None
