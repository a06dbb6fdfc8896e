"""The active check's routes: POST /v1/check runs DCGM's diagnostic (admin only), GET /v1/check/last
answers the last run's document."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, read_json_object
from gpud.api.responses import json_response
from gpud.base.errors import ErrorKind
from gpud.health.diag import LEVELS


class CheckRoutes:
    def __init__(self, run_check: Callable[[int, bool], Awaitable[dict]], last: Callable[[], dict | None],
                 body_timeout_s: float):
        # run_check(level, force) -> the run's document; it raises a GpudError (conflict) when GPUs are busy
        self.run_check, self.last, self.body_timeout_s = run_check, last, body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/check", self.check)
        app.router.add_get("/v1/check/last", self.last_check)

    @admin_only
    async def check(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"level": (int, type(None)),
                                                                      "force": (bool, type(None))}) \
            if request.body_exists else {}
        level = body.get("level")
        level = 1 if level is None else level
        if level not in LEVELS:
            raise ApiError(ErrorKind.INVALID, "invalid-field",
                           f"field 'level' must be one of {', '.join(map(str, LEVELS))} "
                           f"(dcgmi diag -r 1: quick, -r 2: medium), got {level}")
        return json_response(await self.run_check(level, bool(body.get("force", False))))

    async def last_check(self, request: web.Request) -> web.Response:
        document = self.last()
        if document is None:
            raise ApiError(ErrorKind.NOT_FOUND, "no-check-yet",
                           "no check has run on this node yet: POST /v1/check (gpud check) "
                           "runs one")
        return json_response(document)
