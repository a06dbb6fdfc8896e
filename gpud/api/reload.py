"""POST /v1/reload: re-reads the config files and applies what can change while gpud runs (as SIGHUP)."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError
from gpud.api.responses import json_response
from gpud.base.errors import ErrorKind


class ReloadRoute:
    def __init__(self, reload: Callable[[], Awaitable[str]] | None):
        # Re-reads and applies the config, returns the status line, raises a GpudError for an invalid
        # file; None when gpud was started without a config file to re-read.
        self._reload = reload

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/reload", self.post)

    @admin_only
    async def post(self, request: web.Request) -> web.Response:
        if self._reload is None:
            raise ApiError(ErrorKind.UNSUPPORTED, "reload-unavailable",
                           "this gpud was started without a config to re-read")
        return json_response({"reloaded": True, "status": await self._reload()})
