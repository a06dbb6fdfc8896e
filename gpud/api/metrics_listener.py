"""metrics.listen: a read-only TCP listener for Prometheus, which cannot scrape a Unix socket.

It is an aiohttp app of its own. It serves GET (and HEAD) /metrics, from the socket API's one
MetricsRoute, and nothing else: no other route is registered on it, so no route of the socket API
can be reached through it; any other path is a 404, and any other method on /metrics a 405.
TCP carries no peer credentials, so nothing here is authenticated: whoever reaches the address
reads the metrics. Hence the advice to bind it to loopback or a private interface, and the
per-process series (a pid label: every local user's GPU processes) are left out here unless
metrics.listen_process_series is set, and the Kubernetes labels (the node's pods) unless
metrics.listen_pod_labels is.

Any local user can connect, from any of 127.0.0.0/8's addresses, so its slots are kept for those
who scrape (Slots): a new connection must send its whole request head within HEAD_TIMEOUT_S; when
every slot is taken, or its address holds its share, a newcomer that has sent a whole request head
(a scraper sends its at once) takes the place of the connection that has done least (one still to
complete a request before one that completed a scrape; among those, one of the address holding
most; then the oldest), and one that has not is given DECIDE_WITHIN_S to send it, or is closed; and
each address's requests take turns.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gpud.api.connections import FairTurns, follow_connections
from gpud.api.errors import REQUEST_ERROR_LOG, answer_malformed_requests_with_json, error_response
from gpud.api.latency import RequestLatency
from gpud.api.metrics import MetricsRoute
from gpud.api.server import ShallowRouter
from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.config import listen_address

log = get_logger("metrics")
# A Prometheus server keeps one connection open per target; a few servers (an HA pair) and a
# curl leave room under these. Beyond either cap a connection makes room or is closed (Slots).
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_ADDRESS = 8
# Prometheus sends its request head in one write as soon as it connects; a peer that has not sent
# a whole head by then is holding a slot. (Later heads on a kept-alive connection: idle_timeout_s.)
HEAD_TIMEOUT_S = 2.0
# What one connection may make gpud hold: Prometheus sends about 6 header lines, each bounded at
# aiohttp's 8190 bytes, so a head is at most ~256 KiB, and all the slots together ~16 MiB.
MAX_HEADERS = 32
SHED_LOGGED_EVERY_S = 10.0
# A newcomer beyond a cap from an address whose other connections still wait for their heads wins a
# place only with a whole head of its own, looked for (MSG_PEEK, unread) in what it sent: a scraper
# writes its request as it connects, a trickler never completes one. Its bytes can land well after
# gpud accepts when the scraper's host is loaded (0.1 s lost one scrape of 53 in CI), so it is looked
# at again after DECIDE_FIRST_LOOK_S, then after twice as long each time, until DECIDE_WITHIN_S, before
# it is closed: some eight looks in all. At most the address's share wait so at once, reading paused.
DECIDE_WITHIN_S = 1.0
DECIDE_FIRST_LOOK_S = 0.01
HEAD_PEEK_BYTES = 16384  # Prometheus's head is some 300 bytes; one longer is not a scraper's
NO_BODY_BYTES = 1024  # no route here reads a body


class MetricsListenError(Exception):
    """The configured address cannot be listened on: its syntax, its name, or the bind failed."""

    def __init__(self, address: str, reason: str):
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address, self.reason = address, reason


class MetricsListener(Component):
    """metrics.listen: the same /metrics on TCP, for Prometheus; nothing else is reachable there. It is
    started before the socket's API: an address that cannot be listened on stops gpud before it serves
    anything (MetricsListenError), as a listener explicitly asked for should."""

    name = "metrics-listener"

    def __init__(self, route: MetricsRoute, latency: RequestLatency, *, idle_timeout_s: float,
                 shutdown_timeout_s: float, with_processes: bool = False, with_pods: bool = False,
                 listen: str | None = None):
        self.route = route
        self.listen_at_start = listen
        self.with_processes = with_processes  # metrics.listen_process_series: read per request, so a reload applies
        self.with_pods = with_pods  # metrics.listen_pod_labels: the same
        self.latency = latency  # scrapes over TCP are API requests too: counted and timed with the others
        self.idle_timeout_s = idle_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.address: str | None = None  # where it listens now; None: it does not
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=NO_BODY_BYTES)
        app.router.__class__ = ShallowRouter  # the socket's: an unknown query parameter is refused, here too
        app.router.query_parameters = {("/metrics", "GET"): frozenset()}
        app.router.add_get("/metrics", self.metrics)  # HEAD too (aiohttp's allow_head)
        app.router.add_route("*", "/{path:.*}", _nothing_else)
        return app

    async def start(self, tasks: Tasks) -> None:
        await self.listen(self.listen_at_start)

    async def listen(self, address: str | None) -> None:
        """Listens on address (host:port; None: does nothing). MetricsListenError when it cannot."""
        if address is None:
            return
        try:
            host, port = listen_address(address)
        except ValueError as exc:  # an address given on the command line, not checked by the config file
            raise MetricsListenError(address, str(exc)) from None
        runner = web.AppRunner(self.app(), handle_signals=False, access_log=RequestLatency.logger(),
                               access_log_class=self.latency.access_logger_class(),
                               logger=REQUEST_ERROR_LOG,  # no request bytes, rate-limited
                               keepalive_timeout=self.idle_timeout_s, max_headers=MAX_HEADERS,
                               lingering_time=1.0, shutdown_timeout=self.shutdown_timeout_s)
        await runner.setup()
        answer_malformed_requests_with_json(runner.server)
        Slots(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS, HEAD_TIMEOUT_S).attach(runner.server)
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:  # in use, not this host's address, a name that does not resolve, a port < 1024
            await runner.cleanup()
            raise MetricsListenError(address, str(exc)) from None
        self._runner, self.address = runner, address
        bound = [_host_port(sockname) for sockname in runner.addresses]  # a host name may be several
        log.info("metrics_listening", address=address, bound=bound, url=f"http://{address}/metrics",
                 authentication="none: bind to loopback or a private interface")

    async def metrics(self, request: web.Request) -> web.Response:
        return self.route.response(self.route.text(with_processes=self.with_processes, with_pods=self.with_pods))

    async def stop(self) -> None:
        """Stops listening; a scrape in flight gets shutdown_timeout_s to finish."""
        if self._runner is None:
            return
        await self._runner.cleanup()
        log.info("metrics_listener_stopped", address=self.address)
        self._runner, self.address = None, None

    async def move(self, address: str | None) -> None:
        """Listens on address instead (a reload): the old listener closes first, since the new
        address may overlap it (127.0.0.1:9400 -> 0.0.0.0:9400). When the new one cannot be
        opened, the old one is opened again and MetricsListenError says why."""
        previous = self.address
        if address == previous:
            return
        await self.stop()
        try:
            await self.listen(address)
        except MetricsListenError:
            try:
                await self.listen(previous)
            except MetricsListenError as again:  # taken by another process in between
                log.error("metrics_listener_lost", address=previous, error=again.reason)
            raise


async def _nothing_else(request: web.Request) -> web.Response:
    if request.path == "/metrics":
        response = error_response(405, "method-not-allowed", f"{request.method} is not allowed on /metrics; "
                                  "this listener is read-only", allowed=["GET", "HEAD"])
        response.headers["Allow"] = "GET, HEAD"  # RFC 9110: a 405 must say what is allowed
        return response
    return error_response(404, "not-found", f"no such route: {request.path}; this listener serves only "
                                            "GET /metrics (the API is on gpud's Unix socket)")


def _host_port(sockname: tuple) -> str:
    host, port = sockname[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(eq=False)
class Slot:
    """One accepted connection, as Slots weighs it."""

    address: str
    transport: asyncio.Transport
    since: float  # accepted, or its last request answered
    head_timer: asyncio.TimerHandle | None
    served: bool = False  # it completed a request: kept before those that have not
    handling: bool = False  # a request of it is being answered: never closed for room


@dataclass(eq=False)
class _Deciding:
    address: str
    transport: asyncio.Transport
    until: float
    next_look_s: float = DECIDE_FIRST_LOOK_S


def _whole_head_sent(transport: asyncio.Transport) -> bool:
    """Whether the peer has sent a whole request head, as yet unread: looked at through a duplicate of
    the socket, with MSG_PEEK, so that aiohttp still reads every byte."""
    transport_socket = transport.get_extra_info("socket")
    if transport_socket is None:
        return False
    try:
        with socket.socket(fileno=os.dup(transport_socket.fileno())) as peek:
            sent = peek.recv(HEAD_PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:  # nothing yet (EAGAIN), or the peer is gone
        return False
    return b"\r\n\r\n" in sent


class Slots:
    """Connections open at once, in all and per peer IP address. TCP peers have no credentials to
    weigh (connections.py weighs the socket's), and one local user can connect from every address
    of 127.0.0.0/8; so a connection beyond a cap is not simply refused: it takes the slot of the
    connection that has done least (see shed_for). When its address still waits for a head of its
    own, it must show a whole head first (a reconnecting trickler would otherwise push its own
    connections out in a loop, and a scraper beside it would lose to it): it is closed when it does
    not within DECIDE_WITHIN_S, and whenever every slot is answering a request. A connection that has
    not sent its first request head within head_timeout_s is closed. Each address's requests take turns (FairTurns)."""

    def __init__(self, max_connections: int, per_address: int, head_timeout_s: float):
        self.max_connections, self.per_address, self.head_timeout_s = max_connections, per_address, head_timeout_s
        self._slots: dict[RequestHandler, Slot] = {}
        self._deciding: dict[RequestHandler, _Deciding] = {}  # newcomers looked at again before a place
        self._by_address: Counter[str] = Counter()
        self._shed_unlogged: Counter[str] = Counter()  # why -> connections closed since the last log line
        self._shed_logged_at = -SHED_LOGGED_EVERY_S

    def attach(self, server: web.Server) -> None:
        follow_connections(server, self._admit, self._release)
        handle, turns = server.request_handler, FairTurns()

        async def request_handler(request: web.BaseRequest) -> web.StreamResponse:
            slot = self._slots.get(request.protocol)
            if slot is None:  # closed for room while its head was parsed: its answer goes nowhere
                return await handle(request)
            slot.handling = True
            if slot.head_timer is not None:
                slot.head_timer.cancel()
                slot.head_timer = None
            try:
                return await turns.take(slot.address, handle, request)
            finally:
                slot.handling, slot.served, slot.since = False, True, time.monotonic()

        server.request_handler = request_handler

    def _admit(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if peer else "unknown"
        if self._full_for(address) and self._waits_for_head(address) and not _whole_head_sent(transport):
            # Its address's other connections still wait for their heads: it may be one more of a
            # peer that reconnects whatever is closed, and pushing out one of them would only make
            # that peer connect again. It gets a place only once it shows a whole head (_decide).
            if sum(waiting.address == address for waiting in self._deciding.values()) >= self.per_address:
                self._refuse(transport, address)
                return
            transport.pause_reading()
            deciding = self._deciding[handler] = _Deciding(address, transport, time.monotonic() + DECIDE_WITHIN_S)
            asyncio.get_running_loop().call_later(deciding.next_look_s, self._decide, handler)
            return
        self._take_place(handler, transport, address)

    def _refuse(self, transport: asyncio.Transport, address: str) -> None:
        # Closed from the next turn of the loop, once aiohttp has started the connection's handler:
        # closed in connection_made, on Python < 3.12 the handler starts on a lost connection and its
        # task fails (aiohttp's web_protocol.py RequestHandler.start, "assert manager is not None"),
        # logged with a traceback for every refusal: 17,514 lines, 13 MB in 11 s under a flood.
        asyncio.get_running_loop().call_soon(transport.abort)
        self._log_shed("refused", address)

    def _full_for(self, address: str) -> bool:
        return len(self._slots) >= self.max_connections or self._by_address[address] >= self.per_address

    def _take_place(self, handler: RequestHandler, transport: asyncio.Transport, address: str) -> None:
        if self._full_for(address):
            victim = self.shed_for(address)
            if victim is None:  # every slot is answering a request
                self._refuse(transport, address)
                return
            self._close(victim, "closed_for_room")
        timer = asyncio.get_running_loop().call_later(self.head_timeout_s, self._head_overdue, handler)
        self._slots[handler] = Slot(address, transport, time.monotonic(), timer)
        self._by_address[address] += 1

    def _decide(self, handler: RequestHandler) -> None:
        deciding = self._deciding.get(handler)
        if deciding is None:  # it closed meanwhile
            return
        if _whole_head_sent(deciding.transport) or not self._full_for(deciding.address) \
                or not self._waits_for_head(deciding.address):
            del self._deciding[handler]
            self._take_place(handler, deciding.transport, deciding.address)
            if handler in self._slots:
                deciding.transport.resume_reading()
        elif time.monotonic() >= deciding.until:
            del self._deciding[handler]
            self._refuse(deciding.transport, deciding.address)
        else:
            deciding.next_look_s = min(2 * deciding.next_look_s, deciding.until - time.monotonic())
            asyncio.get_running_loop().call_later(deciding.next_look_s, self._decide, handler)

    def shed_for(self, address: str) -> RequestHandler | None:
        """The connection to close for a new one from address: among its own address's when that
        address holds its share, else among all; never one being answered. First one that has not
        completed a request (a scraper completes its at once), then one of the address holding the
        most connections, then the oldest."""
        own = self._by_address[address] >= self.per_address
        candidates = [(slot.served, -self._by_address[slot.address], slot.since, handler)
                      for handler, slot in self._slots.items()
                      if not slot.handling and (not own or slot.address == address)]
        return min(candidates, key=lambda candidate: candidate[:3])[3] if candidates else None

    def _waits_for_head(self, address: str) -> bool:
        return any(slot.address == address and not slot.served and not slot.handling for slot in self._slots.values())

    def _head_overdue(self, handler: RequestHandler) -> None:
        slot = self._slots.get(handler)
        if slot is not None and not slot.handling:
            self._close(handler, "head_overdue")

    def _close(self, handler: RequestHandler, why: str) -> None:
        slot = self._slots[handler]
        self._release(handler)
        slot.transport.abort()  # at once: the slot is another's now
        self._log_shed(why, slot.address)

    def _release(self, handler: RequestHandler) -> None:
        self._deciding.pop(handler, None)
        slot = self._slots.pop(handler, None)
        if slot is None:
            return
        if slot.head_timer is not None:
            slot.head_timer.cancel()
        self._by_address[slot.address] -= 1
        if not self._by_address[slot.address]:
            del self._by_address[slot.address]

    def _log_shed(self, why: str, address: str) -> None:
        self._shed_unlogged[why] += 1
        now = time.monotonic()
        if now - self._shed_logged_at >= SHED_LOGGED_EVERY_S:
            log.warning("metrics_connections_shed", last_peer=address, **dict(self._shed_unlogged),
                        open=len(self._slots), max_connections=self.max_connections,
                        max_per_address=self.per_address, head_timeout_s=self.head_timeout_s,
                        logged_every_s=SHED_LOGGED_EVERY_S)
            self._shed_unlogged.clear()
            self._shed_logged_at = now
