"""GET /v1/sharing: the sharing document, answered from its body encoded once per change; PUT
/v1/sharing/config: which named config (sharing.configs_dir) is in force."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import json_errors, read_json_object
from gpud.api.responses import encoded_json_response, json_response
from gpud.sharing.service import SharingView


class SharingRoutes:
    def __init__(self, sharing: SharingView, choose: Callable[[str | None, str | None], Awaitable[dict]],
                 body_timeout_s: float):
        self.sharing = sharing
        self._choose = choose  # (name or None for the default, reason) -> the `config` block; GpudError refuses
        self._body_timeout_s = body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/sharing", self.get)
        app.router.add_put("/v1/sharing/config", self.put_config)

    async def get(self, request: web.Request) -> web.Response:
        return encoded_json_response(self.sharing.body)

    @admin_only
    @json_errors
    async def put_config(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self._body_timeout_s, {"name": (str, type(None)),
                                                                      "reason": (str, type(None))})
        return json_response({"config": await self._choose(body.get("name"), body.get("reason"))})
