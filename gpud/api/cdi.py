"""GET /v1/cdi: the CDI spec gpud keeps written, its path and device names, from memory."""

from __future__ import annotations

from aiohttp import web

from gpud.api.responses import json_response
from gpud.cdi.spec import KIND
from gpud.cdi.writer import CdiWriter


class CdiRoutes:
    def __init__(self, writer: CdiWriter | None):
        self.writer = writer  # None: cdi.enabled is false

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/cdi", self.get)

    async def get(self, request: web.Request) -> web.Response:
        if self.writer is None:
            return json_response({"enabled": False, "kind": KIND, "path": None, "written_at": None, "error": None,
                                  "devices": [], "unavailable": [], "spec": None,
                                  "changed_behind_gpud": {"count": 0, "last": None, "at": None}})
        return json_response(self.writer.view())
