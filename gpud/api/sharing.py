"""GET /v1/sharing: the sharing document, answered from its body encoded once per change; PUT
/v1/sharing/config: which named config (sharing.configs_dir) is in force; GET and PUT
/v1/allocations: gpu_memory's units as the device plugin reports the kubelet allocated them."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import read_json_object
from gpud.api.responses import encoded_json_response, json_response
from gpud.sharing.gpu_memory import MAX_REPORTED_IDS, MAX_REPORTED_PODS, GpuMemory
from gpud.sharing.service import SharingView

# PUT /v1/allocations' bounds: MAX_REPORTED_IDS IDs of up to ~100 bytes quoted, and each pod's object.
ALLOCATIONS_MAX_BYTES = 16 << 20
ALLOCATIONS_MAX_VALUES = MAX_REPORTED_IDS + 8 * MAX_REPORTED_PODS + 16


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
    async def put_config(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self._body_timeout_s, {"name": (str, type(None)),
                                                                      "reason": (str, type(None))})
        return json_response({"config": await self._choose(body.get("name"), body.get("reason"))})


class AllocationRoutes:
    def __init__(self, gpu_memory: GpuMemory, body_timeout_s: float):
        self.gpu_memory = gpu_memory
        self._body_timeout_s = body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/allocations", self.get)
        app.router.add_put("/v1/allocations", self.put)

    async def get(self, request: web.Request) -> web.Response:
        return json_response(self.gpu_memory.view())

    @admin_only
    async def put(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self._body_timeout_s,
                                      {"resource": (str,), "read_at": (int, float), "pods": (list,)},
                                      limit=ALLOCATIONS_MAX_BYTES, max_values=ALLOCATIONS_MAX_VALUES)
        return json_response(self.gpu_memory.report(body))
