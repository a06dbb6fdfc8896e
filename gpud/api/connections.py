"""Connection caps: no local user can hold so many connections that gpud stops answering others.

Each connection is weighed once, when it is accepted, by its peer's credentials (SO_PEERCRED,
SO_PEERGROUPS). A peer that may change the node (an admin) may use every one of max_connections;
any other peer only those left after admin_reserved_connections, and at most
max_connections_per_peer of them per uid. A connection beyond its share is not dropped unanswered:
/healthz is still served on it, any other request gets a JSON 429 (its peer's cap) or 503 (gpud is
full), and the connection is closed after that answer, or after EXCESS_GRACE_S if it sends nothing.

Requests are admitted fairly (FairTurns): one request per uid that is not an admin runs at a time,
the others of that uid wait for their turn, so a reader flooding gpud from 64 connections queues
behind itself while admins and other readers are served between its requests.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Hashable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gpud.api.auth import AdminPolicy, socket_peer_credentials
from gpud.api.errors import error_response
from gpud.base.logs import get_logger

log = get_logger("api")
EXCESS_GRACE_S = 1.0  # how long a connection beyond its share has to send its one request
RETRY_AFTER_S = 1
REFUSALS_LOGGED_EVERY_S = 10.0  # a peer that keeps knocking gets one log line per this many seconds
# A request that holds its peer's turn this long is waiting on something (a watch stream, a slow
# body, an apply): the turn goes to the peer's next request. The CPU a handler uses it uses at once.
TURN_S = 0.25


@dataclass(frozen=True)
class Refusal:
    """What a connection beyond its share is answered, for anything but /healthz."""

    status: int
    code: str
    message: str

    def response(self) -> web.Response:
        response = error_response(self.status, self.code, self.message)
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        response.force_close()
        return response


@dataclass(frozen=True)
class Admitted:
    uid: int | None  # None: a peer whose credentials could not be read
    admin: bool


class ConnectionLimits:
    def __init__(self, policy: AdminPolicy, max_connections: int, per_peer: int, admin_reserved: int):
        self.policy = policy
        self.max_connections = max_connections
        self.per_peer = per_peer
        self.admin_reserved = admin_reserved
        self._admitted: dict[RequestHandler, Admitted] = {}
        self._by_uid: Counter[int | None] = Counter()
        self._others = 0  # admitted connections of peers that are not admins
        self._excess: dict[RequestHandler, Refusal] = {}
        self._refusals_unlogged: Counter[int | None] = Counter()
        self._refusal_logged_at: dict[int | None, float] = {}

    def attach(self, server: web.Server) -> None:
        """Weighs every connection server accepts and answers those beyond their share; the requests
        of each non-admin uid take turns (FairTurns)."""
        follow_connections(server, self._admit, self._release)
        handle = server.request_handler
        turns = FairTurns()

        async def request_handler(request: web.BaseRequest) -> web.StreamResponse:
            refusal = self._excess.get(request.protocol)
            if refusal is None:
                admitted = self._admitted.get(request.protocol)
                if admitted is None or admitted.admin:
                    return await handle(request)
                return await turns.take(admitted.uid, handle, request)
            if request.path != "/healthz":
                return refusal.response()
            response = await handle(request)
            response.force_close()
            return response

        server.request_handler = request_handler

    def _admit(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        try:
            sock = transport.get_extra_info("socket")
            peer = socket_peer_credentials(sock) if sock is not None else None
        except OSError:  # the peer is gone already, or the descriptor table is full: weigh it as unknown
            peer = None
        admin = peer is not None and self.policy.allows(peer)
        uid = peer.uid if peer is not None else None
        total = len(self._admitted)
        if admin:
            refusal = None if total < self.max_connections else self._full()
        elif self._by_uid[uid] >= self.per_peer:
            refusal = Refusal(429, "too-many-connections",
                              f"uid {uid} already holds {self._by_uid[uid]} connections to gpud, its cap "
                              f"(api.max_connections_per_peer); close one, or reuse a connection")
        elif self._others >= self.max_connections - self.admin_reserved:
            refusal = self._full()
        else:
            refusal = None
        if refusal is not None:
            self._excess[handler] = refusal
            asyncio.get_running_loop().call_later(EXCESS_GRACE_S, transport.close)
            self._log_refusal(uid, refusal)
            return
        self._admitted[handler] = Admitted(uid, admin)
        if not admin:
            self._by_uid[uid] += 1
            self._others += 1

    def _log_refusal(self, uid: int | None, refusal: Refusal) -> None:
        self._refusals_unlogged[uid] += 1
        now = time.monotonic()
        if now - self._refusal_logged_at.get(uid, -REFUSALS_LOGGED_EVERY_S) >= REFUSALS_LOGGED_EVERY_S:
            log.warning("connections_refused", uid=uid, status=refusal.status, code=refusal.code,
                        refused=self._refusals_unlogged.pop(uid), logged_every_s=REFUSALS_LOGGED_EVERY_S)
            self._refusal_logged_at[uid] = now

    def _full(self) -> Refusal:
        return Refusal(503, "too-many-connections",
                       f"gpud holds {len(self._admitted)} connections, all it serves for this peer "
                       f"(api.max_connections); retry shortly")

    def _release(self, handler: RequestHandler) -> None:
        self._excess.pop(handler, None)
        admitted = self._admitted.pop(handler, None)
        if admitted is None or admitted.admin:
            return
        self._by_uid[admitted.uid] -= 1
        if not self._by_uid[admitted.uid]:
            del self._by_uid[admitted.uid]
        self._others -= 1


def follow_connections(server: web.Server, admit: Callable[[RequestHandler, asyncio.Transport], None],
                       release: Callable[[RequestHandler], None]) -> None:
    """Has server tell admit of each connection it accepts and release of each that closes, after
    its own bookkeeping."""
    made, lost = server.connection_made, server.connection_lost

    def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
        made(handler, transport)
        admit(handler, transport)

    def connection_lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
        lost(handler, exc)
        release(handler)

    server.connection_made, server.connection_lost = connection_made, connection_lost


class FairTurns:
    """One request at a time per peer (a uid, an address), at most one per turn of the event loop;
    the peer's other requests wait in line. A peer that floods gpud with requests thus gets one
    handler's worth of each turn of the loop, and whatever other peers sent is served beside it (the
    loop runs ready callbacks in order). A request that keeps its turn over TURN_S passes it on
    without ending."""

    def __init__(self, turn_s: float = TURN_S):
        self.turn_s = turn_s
        self._waiting: dict[Hashable, deque[asyncio.Future]] = {}  # peer -> its requests in line; present: one runs

    async def take(self, peer: Hashable, handle: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                   request: web.BaseRequest) -> web.StreamResponse:
        line = self._waiting.get(peer)
        if line is None:
            self._waiting[peer] = deque()
        else:
            turn = asyncio.get_running_loop().create_future()
            line.append(turn)
            try:
                await turn
            except asyncio.CancelledError:  # its connection closed while it waited (_pass skips it in line)
                if not turn.cancelled():  # the turn had been given to it: pass it on
                    self._pass(peer)
                raise
        passed = [False]

        def pass_once() -> None:
            if not passed[0]:
                passed[0] = True
                self._pass(peer)

        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.turn_s, pass_once)
        try:
            return await handle(request)
        finally:
            timer.cancel()
            # Passed from the next turn of the loop, not now: a handler that never awaits ends within
            # one step, and the peer's next request, woken at once, would run in the same turn of the
            # loop, and the next: a flood of 64 connections would be served 64 at a time again.
            loop.call_soon(pass_once)

    def _pass(self, peer: Hashable) -> None:
        line = self._waiting[peer]
        while line:
            turn = line.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        del self._waiting[peer]
