"""GET /v1/slurm/gres: Slurm's gres.conf of this node as gpud keeps it, from memory."""

from __future__ import annotations

from aiohttp import web

from gpud.api.responses import json_response
from gpud.slurm.writer import GresWriter


class SlurmRoutes:
    def __init__(self, writer: GresWriter):
        self.writer = writer

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/slurm/gres", self.get)

    async def get(self, request: web.Request) -> web.Response:
        return json_response(self.writer.view())
