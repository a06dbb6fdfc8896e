"""Health routes and the watch stream."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, json_errors, read_json_object
from gpud.api.views import encode
from gpud.events import EVENT_TYPES, EventBus
from gpud.health.service import HealthService
from gpud.inventory import InventoryService

JSON = "application/json"
HEARTBEAT_S = 15.0


class HealthRoutes:
    def __init__(self, health: HealthService, inventory: InventoryService, bus: EventBus, body_timeout_s: float):
        self.health, self.inventory, self.bus, self.body_timeout_s = health, inventory, bus, body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/health", self.node)
        app.router.add_get("/v1/gpus/{id}/health", self.gpu)
        app.router.add_post("/v1/health/{id}/clear", self.clear)
        app.router.add_get("/v1/watch", self.watch)

    async def node(self, request: web.Request) -> web.Response:
        return web.Response(body=encode(self.health.view()), content_type=JSON)

    def _gpu(self, ident: str):
        gpu = self.inventory.current.find_gpu(ident) if self.inventory.current else None
        if gpu is None:
            raise ApiError(404, "device-not-found", f"no GPU or MIG device '{ident}' on this node")
        return gpu

    @json_errors
    async def gpu(self, request: web.Request) -> web.Response:
        uuid = self._gpu(request.match_info["id"]).uuid
        gpu = next(g for g in self.health.view()["gpus"] if g["uuid"] == uuid)
        return web.Response(body=encode(gpu), content_type=JSON)

    @admin_only
    @json_errors
    async def clear(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"kind": (str, type(None))}) \
            if request.body_exists else {}
        ident = request.match_info["id"]
        gpu = self._gpu(ident)
        uuid = ident if any(dev.uuid == ident for dev in gpu.mig.devices) else gpu.uuid  # a MIG device: only it
        self.health.clear(uuid, body.get("kind"))
        return web.Response(body=encode(self.health.tracker.device(uuid)), content_type=JSON)

    @json_errors
    async def watch(self, request: web.Request) -> web.StreamResponse:
        since = request.query.get("since", "")
        if since and not since.isdigit():
            raise ApiError(400, "invalid-query", f"query 'since' must be a sequence number, got {since!r}")
        types = set(request.query.get("types", ",".join(EVENT_TYPES)).split(","))
        if not types <= set(EVENT_TYPES):
            raise ApiError(400, "invalid-query", f"unknown event types {sorted(types - set(EVENT_TYPES))}; "
                                                 f"known: {', '.join(EVENT_TYPES)}")
        subscription = self.bus.subscribe()  # before the backlog is read, so nothing falls in between
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            start = int(since) if since else self.bus.sequence
            backlog, gap = self.bus.backlog_after(start)
            if gap:
                await response.write(encode({"seq": start, "type": "gap", "data": {
                    "message": "events after the given sequence number were dropped from the backlog"}}) + b"\n")
            last = start
            for line in backlog:
                last = await _write_if_wanted(response, line, types, last)
            while True:
                try:
                    line = await asyncio.wait_for(subscription.queue.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    await response.write(encode({"seq": self.bus.sequence, "type": "heartbeat"}) + b"\n")
                    continue
                if line == b"":  # gpud is stopping
                    return response
                if line is None:  # this watcher fell too far behind
                    await response.write(encode({"seq": last, "type": "overflow", "data": {
                        "message": "too slow: reconnect with ?since=" + str(last)}}) + b"\n")
                    return response
                last = await _write_if_wanted(response, line, types, last)
        finally:
            self.bus.unsubscribe(subscription)


async def _write_if_wanted(response: web.StreamResponse, line: bytes, types: set[str], last: int) -> int:
    """Writes an event line unless it is older than `last` (already sent) or of an unwanted type."""
    seq = int(line[7:line.index(b",")])  # lines start with {"seq":N,
    if seq <= last:
        return last
    kind = line.split(b'"type":"', 1)[1].split(b'"', 1)[0].decode()
    if kind in types:
        await response.write(line)
    return seq
