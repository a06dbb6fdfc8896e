"""Health routes and the watch stream."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, json_errors, read_json_object
from gpud.api.responses import json_response
from gpud.encoding import encode
from gpud.events import CLOSED, EVENT_TYPES, OVERFLOW, Event, EventBus
from gpud.health.service import HealthService
from gpud.inventory import InventoryService

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
        return json_response(self.health.view())

    def _gpu(self, ident: str):
        gpu = self.inventory.current.find_gpu(ident) if self.inventory.current else None
        if gpu is None:
            raise ApiError(404, "device-not-found", f"no GPU or MIG device '{ident}' on this node")
        return gpu

    @json_errors
    async def gpu(self, request: web.Request) -> web.Response:
        uuid = self._gpu(request.match_info["id"]).uuid
        gpu = next(g for g in self.health.view()["gpus"] if g["uuid"] == uuid)
        return json_response(gpu)

    @admin_only
    @json_errors
    async def clear(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"kind": (str, type(None))}) \
            if request.body_exists else {}
        ident = request.match_info["id"]
        gpu = self._gpu(ident)
        uuid = ident if any(dev.uuid == ident for dev in gpu.mig.devices) else gpu.uuid  # a MIG device: only it
        self.health.clear(uuid, body.get("kind"))
        return json_response(self.health.tracker.device(uuid))

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
            for event in backlog:
                last = await _write_if_wanted(response, event, types, last)
            while True:
                try:
                    item = await asyncio.wait_for(subscription.queue.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    await response.write(encode({"seq": self.bus.sequence, "type": "heartbeat"}) + b"\n")
                    continue
                if item is CLOSED:
                    return response
                if item is OVERFLOW:
                    await response.write(encode({"seq": last, "type": "overflow", "data": {
                        "message": "too slow: reconnect with ?since=" + str(last)}}) + b"\n")
                    return response
                last = await _write_if_wanted(response, item, types, last)
        finally:
            self.bus.unsubscribe(subscription)


async def _write_if_wanted(response: web.StreamResponse, event: Event, types: set[str], last: int) -> int:
    """Writes an event unless it is older than `last` (already sent) or of an unwanted type."""
    if event.seq <= last:
        return last
    if event.type in types:
        await response.write(event.line)
    return event.seq
