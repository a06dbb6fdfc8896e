"""metrics.listen: a read-only TCP listener for Prometheus, which cannot scrape a Unix socket.

It is an aiohttp app of its own. It serves GET (and HEAD) /metrics, from the socket API's one
MetricsRoute, and nothing else: no other route is registered on it, so no route of the socket API
can be reached through it; any other path is a 404, and any other method on /metrics a 405.
TCP carries no peer credentials, so nothing here is authenticated: whoever reaches the address
reads the metrics. Hence the advice to bind it to loopback or a private interface.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gpud.api.connections import follow_connections
from gpud.api.errors import REQUEST_ERROR_LOG, answer_malformed_requests_with_json, error_response
from gpud.api.latency import RequestLatency
from gpud.api.metrics import MetricsRoute
from gpud.config import listen_address
from gpud.logs import get_logger

log = get_logger("metrics")
# A Prometheus server keeps one connection open per target; a few servers (an HA pair) and a
# curl leave room under these. Beyond either cap a new connection is closed at once.
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_ADDRESS = 8
REFUSALS_LOGGED_EVERY_S = 10.0
NO_BODY_BYTES = 1024  # no route here reads a body


class MetricsListenError(Exception):
    """The configured address cannot be listened on: its syntax, its name, or the bind failed."""

    def __init__(self, address: str, reason: str):
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address, self.reason = address, reason


class MetricsListener:
    def __init__(self, route: MetricsRoute, latency: RequestLatency, *, idle_timeout_s: float,
                 shutdown_timeout_s: float):
        self.route = route
        self.latency = latency  # scrapes over TCP are API requests too: counted and timed with the others
        self.idle_timeout_s = idle_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.address: str | None = None  # where it listens now; None: it does not
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=NO_BODY_BYTES)
        app.router.add_get("/metrics", self.route.get)  # HEAD too (aiohttp's allow_head)
        app.router.add_route("*", "/{path:.*}", _nothing_else)
        return app

    async def start(self, address: str | None) -> None:
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
                               keepalive_timeout=self.idle_timeout_s,  # also closes a silent new connection
                               lingering_time=1.0, shutdown_timeout=self.shutdown_timeout_s)
        await runner.setup()
        answer_malformed_requests_with_json(runner.server)
        AddressCaps(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS).attach(runner.server)
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
            await self.start(address)
        except MetricsListenError:
            try:
                await self.start(previous)
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


class AddressCaps:
    """Connections open at once, in all and per peer IP address. TCP peers have no credentials to
    weigh (connections.py weighs the socket's), so a host holding many connections cannot crowd
    out Prometheus; a connection beyond a cap is closed as soon as it is accepted."""

    def __init__(self, max_connections: int, per_address: int):
        self.max_connections, self.per_address = max_connections, per_address
        self._admitted: dict[RequestHandler, str] = {}  # connection -> its peer's address
        self._by_address: Counter[str] = Counter()
        self._refused_unlogged = 0
        self._refusal_logged_at = -REFUSALS_LOGGED_EVERY_S

    def attach(self, server: web.Server) -> None:
        follow_connections(server, self._admit, self._release)

    def _admit(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if peer else "unknown"
        if len(self._admitted) >= self.max_connections or self._by_address[address] >= self.per_address:
            transport.close()
            self._log_refusal(address)
            return
        self._admitted[handler] = address
        self._by_address[address] += 1

    def _release(self, handler: RequestHandler) -> None:
        address = self._admitted.pop(handler, None)
        if address is None:
            return
        self._by_address[address] -= 1
        if not self._by_address[address]:
            del self._by_address[address]

    def _log_refusal(self, address: str) -> None:
        self._refused_unlogged += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= REFUSALS_LOGGED_EVERY_S:
            log.warning("metrics_connections_refused", last_peer=address, refused=self._refused_unlogged,
                        open=len(self._admitted), max_connections=self.max_connections,
                        max_per_address=self.per_address, logged_every_s=REFUSALS_LOGGED_EVERY_S)
            self._refused_unlogged, self._refusal_logged_at = 0, now
