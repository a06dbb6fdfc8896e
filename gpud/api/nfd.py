"""GET /v1/nfd: the labels gpud's NFD feature file holds, those it left out and why, the last write error."""

from __future__ import annotations

from aiohttp import web

from gpud.api.responses import json_response
from gpud.nfd.writer import NfdWriter


class NfdRoutes:
    def __init__(self, writer: NfdWriter):
        self.writer = writer

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/nfd", self.get)

    async def get(self, request: web.Request) -> web.Response:
        return json_response(self.writer.view())
