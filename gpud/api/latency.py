"""Request latency per route, for /metrics, recorded through aiohttp's access-log hook (called
after the response is sent). Every request is counted; one in SAMPLE_EVERY has its latency noted
and bucketed later, off the hot path: noting every request cost ~10% of peak throughput
(bench/api.py), a sample costs nothing measurable and gives the same percentiles."""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
from typing import Iterator

from aiohttp.abc import AbstractAccessLogger

from gpud.base.lifecycle import Component, Tasks
from gpud.base.samples import Family
from gpud.model.dcgm_labels import HOSTNAME

SAMPLE_EVERY = 8
BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class RequestLatency(Component):
    name = "latency"

    def __init__(self) -> None:
        self._routes: dict[tuple[str, str], list] = {}  # (method, route) -> [bucket counts…, sum, count]
        # Requests are only noted here (an append is the cheapest thing to do per request) and
        # counted into buckets every second and when /metrics asks. The bound keeps memory flat;
        # it is far above what gpud serves in a second.
        self._pending: collections.deque = collections.deque(maxlen=1 << 17)
        self._route_names: dict = {}  # aiohttp route object -> its path template
        self._requests = [0]  # every request, sampled or not (a list: the recorder closes over it)

    @property
    def requests(self) -> int:
        return self._requests[0]

    @property
    def routes(self) -> dict[tuple[str, str], list]:
        self.drain()
        return self._routes

    def drain(self) -> None:
        pending, names = self._pending, self._route_names
        for _ in range(len(pending)):
            method, route, seconds = pending.popleft()
            name = names.get(route)
            if name is None:
                name = names[route] = route.resource.canonical if route.resource else "other"
            self.observe(method, name, seconds)

    async def start(self, tasks: Tasks) -> None:
        tasks.spawn(self._drain_every_second(), "latency")

    async def _drain_every_second(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.drain()

    def observe(self, method: str, route: str, seconds: float) -> None:
        entry = self._routes.get((method, route))
        if entry is None:
            entry = self._routes[(method, route)] = [0] * len(BUCKETS_S) + [0.0, 0]
        index = bisect.bisect_left(BUCKETS_S, seconds)
        if index < len(BUCKETS_S):  # slower than the last bound: only in +Inf (the count)
            entry[index] += 1
        entry[-2] += seconds
        entry[-1] += 1

    def collect(self) -> Iterator[Family]:
        """Requests served and the sampled latency histogram per route, for /metrics."""
        requests = Family("gpud_http_requests_total", "API requests served.", "counter")
        requests.add({"hostname": HOSTNAME}, self.requests)
        yield requests
        name = "gpud_http_request_duration_seconds"
        durations = Family(name, f"API request latency by method and route, sampled: one request in {SAMPLE_EVERY}.",
                           "histogram")
        for (method, route), entry in sorted(self.routes.items()):
            labels = {"method": method, "route": route}
            cumulative = 0
            for bound, count in zip(BUCKETS_S, entry):
                cumulative += count
                durations.add({**labels, "le": f"{bound:g}"}, cumulative, f"{name}_bucket")
            durations.add({**labels, "le": "+Inf"}, entry[-1], f"{name}_bucket")
            durations.add(labels, entry[-2], f"{name}_sum")
            durations.add(labels, entry[-1], f"{name}_count")
        yield durations

    def access_logger_class(self) -> type[AbstractAccessLogger]:
        note, requests = self._pending.append, self._requests

        class Recorder(AbstractAccessLogger):
            def log(self, request, response, time: float) -> None:
                requests[0] += 1
                # A request aiohttp could not parse never reached the router: it has no route to time,
                # and aiohttp's match_info property asserts one exists (the attribute is read instead).
                match_info = getattr(request, "_match_info", None)
                if not requests[0] % SAMPLE_EVERY and match_info is not None:
                    note((request.method, match_info.route, time))

        return Recorder

    @staticmethod
    def logger() -> logging.Logger:
        return logging.getLogger("gpud.access")  # aiohttp wants one; the recorder never writes to it
