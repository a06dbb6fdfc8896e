"""GET /v1/claims: the devices Kubernetes DRA claims hold on this node; PUT and DELETE /v1/claims/{uid}: the
DRA plugin holding and releasing them (gpud/claims.py)."""

from __future__ import annotations

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import read_json_object
from gpud.api.responses import json_response
from gpud.claims import ClaimRegistry


class ClaimRoutes:
    def __init__(self, registry: ClaimRegistry, body_timeout_s: float):
        self.registry = registry
        self._body_timeout_s = body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/claims", self.get)
        app.router.add_put("/v1/claims/{uid}", self.put)
        app.router.add_delete("/v1/claims/{uid}", self.delete)

    async def get(self, request: web.Request) -> web.Response:
        return json_response(self.registry.view())

    @admin_only
    async def put(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self._body_timeout_s, {
            "namespace": (str,), "name": (str,), "driver": (str,), "devices": (list,),
            "sharing": (dict, type(None))})
        return json_response(await self.registry.hold(request.match_info["uid"], body))

    @admin_only
    async def delete(self, request: web.Request) -> web.Response:
        return json_response(await self.registry.release(request.match_info["uid"]))
