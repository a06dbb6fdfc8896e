"""Connection caps: no local user can hold so many connections that gpud stops answering others.

Each connection is weighed once, when it is accepted, by its peer's credentials (SO_PEERCRED,
SO_PEERGROUPS). A peer that may change the node (an admin) may use every one of max_connections;
any other peer only those left after admin_reserved_connections, and at most
max_connections_per_peer of them per uid. A connection beyond its share is not dropped unanswered:
/healthz is still served on it, any other request gets a JSON 429 (its peer's cap) or 503 (gpud is
full), and the connection is closed after that answer, or after EXCESS_GRACE_S if it sends nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gpud.api.auth import AdminPolicy, socket_peer_credentials
from gpud.api.errors import error_response
from gpud.logs import get_logger

log = get_logger("api")
EXCESS_GRACE_S = 1.0  # how long a connection beyond its share has to send its one request
RETRY_AFTER_S = 1
REFUSALS_LOGGED_EVERY_S = 10.0  # a peer that keeps knocking gets one log line per this many seconds


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
        """Weighs every connection server accepts and answers those beyond their share."""
        follow_connections(server, self._admit, self._release)
        handle = server.request_handler

        async def request_handler(request: web.BaseRequest) -> web.StreamResponse:
            refusal = self._excess.get(request.protocol)
            if refusal is None:
                return await handle(request)
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
