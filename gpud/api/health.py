"""Health routes and the watch stream."""

from __future__ import annotations

import asyncio
import re

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, read_json_object
from gpud.api.responses import json_response
from gpud.base.encoding import encode
from gpud.base.errors import ErrorKind
from gpud.base.logs import get_logger
from gpud.base.loops import within
from gpud.events import CLOSED, EVENT_TYPES, OVERFLOW, Event, EventBus, Subscription
from gpud.health.service import HealthService
from gpud.inventory import InventoryService

log = get_logger("api")

HEARTBEAT_S = 15.0
MAX_SEQUENCE = (1 << 63) - 1  # what a client may hold a sequence number in


class HealthRoutes:
    def __init__(self, health: HealthService, inventory: InventoryService, bus: EventBus, body_timeout_s: float):
        self.health, self.inventory, self.bus, self.body_timeout_s = health, inventory, bus, body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/health", self.node)
        app.router.add_get("/v1/gpus/{id}/health", self.gpu)
        app.router.add_post("/v1/health/{id}/clear", self.clear)
        app.router.add_get("/v1/watch", self.watch)
        # Open watch streams end as gpud stops, so the in-flight requests can finish: aiohttp runs on_shutdown
        # before it waits for them (https://docs.aiohttp.org/en/stable/web_advanced.html#graceful-shutdown).
        app.on_shutdown.append(self._end_watch_streams)

    async def _end_watch_streams(self, app: web.Application) -> None:
        self.bus.close()

    async def node(self, request: web.Request) -> web.Response:
        return json_response(self.health.view())

    def _gpu(self, ident: str):
        gpu = self.inventory.current.find_gpu(ident) if self.inventory.current else None
        if gpu is None:
            raise ApiError(ErrorKind.NOT_FOUND, "device-not-found", f"no GPU or MIG device '{ident}' on this node")
        return gpu

    async def gpu(self, request: web.Request) -> web.Response:
        uuid = self._gpu(request.match_info["id"]).uuid
        gpu = next(g for g in self.health.view()["gpus"] if g["uuid"] == uuid)
        return json_response(gpu)

    @admin_only
    async def clear(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"kind": (str, type(None))}) \
            if request.body_exists else {}
        ident = request.match_info["id"]
        gpu = self._gpu(ident)
        uuid = ident if any(dev.uuid == ident for dev in gpu.mig.devices) else gpu.uuid  # a MIG device: only it
        self.health.clear(uuid, body.get("kind"))
        return json_response(self.health.tracker.device(uuid))

    async def watch(self, request: web.Request) -> web.StreamResponse:
        since = _since(request.query.get("since", ""))
        epoch = request.query.get("epoch")
        if since is not None and epoch == self.bus.epoch and since > self.bus.sequence:
            raise ApiError(ErrorKind.INVALID, "invalid-query", f"query 'since' is {since}, after this run's last event "
                                                               f"{self.bus.sequence}")
        types = set(request.query.get("types", ",".join(EVENT_TYPES)).split(","))
        if not types <= set(EVENT_TYPES):
            raise ApiError(ErrorKind.INVALID, "invalid-query",
                           f"unknown event types {sorted(types - set(EVENT_TYPES))}; "
                           f"known: {', '.join(EVENT_TYPES)}")
        subscription = self.bus.subscribe()  # before the backlog is read, so nothing falls in between
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            return await self._stream(response, subscription, since, epoch, types)
        except ConnectionResetError:  # aiohttp's "Cannot write to closing transport" is one
            # A watcher hanging up is how most streams end: one line, not an error with a traceback.
            log.info("watch_client_gone", why="the client closed the stream")
            return response
        finally:
            self.bus.unsubscribe(subscription)

    async def _stream(self, response: web.StreamResponse, subscription: Subscription, since: int | None,
                      epoch: str | None, types: set[str]) -> web.StreamResponse:
        """Writes the backlog after `since`, then each event as it comes, until gpud closes the bus or
        the watcher falls too far behind."""
        start = self.bus.sequence if since is None else since
        reset = since is not None and self.bus.from_earlier_run(since, epoch)
        if reset:  # all of this run's events are new to the watcher
            start = self.bus.first
            await response.write(self._gap(start, "reset", "gpud restarted since that sequence number: the "
                                           f"stream of run {self.bus.epoch} follows from its start"))
        backlog, dropped = self.bus.backlog_after(start)
        if dropped:
            await response.write(self._gap(start, "dropped", "events after the given sequence number were "
                                                             "dropped from the backlog"))
        last = start
        for event in backlog:
            last = await _write_if_wanted(response, event, types, last)
        while True:
            try:
                item = await within(subscription.queue.get(), HEARTBEAT_S)
            except asyncio.TimeoutError:
                await response.write(encode({"seq": self.bus.sequence, "type": "heartbeat",
                                             "epoch": self.bus.epoch}) + b"\n")
                continue
            if item is CLOSED:
                return response
            if item is OVERFLOW:
                await response.write(encode({"seq": last, "type": "overflow", "epoch": self.bus.epoch, "data": {
                    "message": f"too slow: reconnect with ?since={last}&epoch={self.bus.epoch}"}}) + b"\n")
                return response
            last = await _write_if_wanted(response, item, types, last)

    def _gap(self, seq: int, reason: str, message: str) -> bytes:
        return encode({"seq": seq, "type": "gap", "epoch": self.bus.epoch,
                       "data": {"reason": reason, "message": message}}) + b"\n"


def _since(text: str) -> int | None:
    """The `since` query: None when absent; ApiError 400 for anything but a sequence number (ASCII
    digits, no sign, no more than a 64-bit client can hold)."""
    if not text:
        return None
    if not re.fullmatch(r"[0-9]{1,19}", text) or int(text) > MAX_SEQUENCE:
        raise ApiError(ErrorKind.INVALID, "invalid-query",
                       f"query 'since' must be a sequence number from 0 to {MAX_SEQUENCE}, "
                       f"got {text[:40]!r}")
    return int(text)


async def _write_if_wanted(response: web.StreamResponse, event: Event, types: set[str], last: int) -> int:
    """Writes an event unless it is older than `last` (already sent) or of an unwanted type."""
    if event.seq <= last:
        return last
    if event.type in types:
        await response.write(event.line)
    return event.seq
