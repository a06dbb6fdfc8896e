"""gpud's HTTP/JSON API on a Unix socket. Handlers serve snapshots; they never call NVML themselves."""

from __future__ import annotations

import grp
import importlib.resources
import os
import socket
import stat
from pathlib import Path
from typing import Callable

import yaml
from aiohttp import web
from aiohttp import HttpVersion11
from aiohttp.web_urldispatcher import MatchInfoError, UrlMappingMatchInfo

from gpud.api.auth import ADMIN_POLICY, AdminPolicy
from gpud.api.connections import ConnectionLimits
from gpud.api.errors import (MAX_BODY_BYTES, REQUEST_ERROR_LOG, ApiError, ErrorTableRouter,
                              answer_malformed_requests_with_json, no_such_route)
from gpud.api.latency import RequestLatency
from gpud.api.responses import encoded_json_response, json_response
from gpud.api.views import RenderedInventory, node_view
from gpud.base.encoding import encode
from gpud.base.errors import NVML_UNAVAILABLE, ErrorKind, nvml_unavailable
from gpud.base.logs import get_logger
from gpud.base.safefs import InUse, hold_lock, secure_directory
from gpud.inventory import InventoryService
from gpud.model.inventory import Inventory
from gpud.nvml.session import NvmlSession, SessionState

log = get_logger("api")


def load_openapi() -> dict:
    """The API's OpenAPI document, kept as commented YAML beside this module."""
    return yaml.safe_load(importlib.resources.files("gpud.api").joinpath("openapi.yaml").read_text())


def query_parameters(openapi: dict) -> dict[tuple[str, str], frozenset[str]]:
    """The query parameters each route and method takes, as the OpenAPI document lists them."""
    known: dict[tuple[str, str], frozenset[str]] = {}
    for path, item in openapi["paths"].items():
        shared = [p for p in item.get("parameters", []) if p.get("in") == "query"]
        for method, operation in item.items():
            if method == "parameters":
                continue
            listed = shared + [p for p in operation.get("parameters", []) if p.get("in") == "query"]
            known[(path, method.upper())] = frozenset(p["name"] for p in listed)
    return known


def _bad_request(code: str, message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=encode({"error": {"code": code, "message": message}}).decode(),
                              content_type="application/json")


class ShallowRouter(ErrorTableRouter):
    """gpud's router (every route answers a GpudError by the table), except that a path deeper than
    every route goes to the catch-all at once, and a query parameter the route does not take is
    refused before its handler runs.

    A parameter gpud ignored could change what a request does without a word: `PUT
    /v1/mig?dry_run=true` applied the layout. The known ones are the OpenAPI document's, so the
    document and the routes cannot drift apart.

    aiohttp looks a path up under each of its prefixes in turn, a segment shorter each time: work
    quadratic in the number of segments (an unknown 8 KiB path of 4,000 segments cost 45 short ones).
    A {placeholder} never spans a '/', so no route but the catch-all (registered last) can match a
    path with more segments than the deepest route has.
    """

    _deepest = 0
    query_parameters: dict[tuple[str, str], frozenset[str]] = {}

    def freeze(self) -> None:
        super().freeze()
        *routes, _catch_all = self._resources
        self._deepest = max(resource.canonical.count("/") for resource in routes)

    async def resolve(self, request: web.Request) -> UrlMappingMatchInfo:
        if request.version > HttpVersion11:
            # llhttp refuses "HTTP/9.9" itself; aiohttp's Python parser (the package's pure-Python tree,
            # packaging/README.md "Interpreters") takes it as a request: refused the same, and closed.
            refusal = _bad_request("bad-request", "unsupported HTTP version: gpud speaks HTTP/1.0 and 1.1")
            refusal.force_close()
            return MatchInfoError(refusal)
        if request.rel_url.path_safe.count("/") > self._deepest:
            match_info, _allowed = await self._resources[-1].resolve(request)
            return match_info
        match_info = await super().resolve(request)
        if request.rel_url.query_string and match_info.route.resource is not self._resources[-1]:
            return self._refuse_unknown_parameters(request, match_info)
        return match_info

    def _refuse_unknown_parameters(self, request: web.Request,
                                   match_info: UrlMappingMatchInfo) -> UrlMappingMatchInfo:
        route = match_info.route.resource.canonical
        method = "GET" if request.method == "HEAD" else request.method
        known = self.query_parameters.get((route, method), frozenset())
        unknown = sorted(set(request.query) - known)
        if not unknown:
            return match_info
        takes = f"it takes {', '.join(sorted(known))}" if known else "it takes none"
        return MatchInfoError(_bad_request(
            "unknown-query-parameter",
            f"{request.method} {route} does not take the query parameter"
            f"{'s' if len(unknown) > 1 else ''} {', '.join(repr(name[:64]) for name in unknown[:8])}; {takes} "
            "(GET /v1/openapi.json lists each route's)"))


class SocketInUse(RuntimeError):
    """Another gpud already serves (or is starting on) this socket path."""


class Api:
    """The routes, and the rendered snapshot they answer from."""

    def __init__(self, session: NvmlSession, inventory: InventoryService, node_base: dict,
                 more_routes: tuple[Callable[[web.Application], None], ...] = (), admin_group: str = "gpud-admin",
                 problems: Callable[[], list[str]] = list):
        self.session = session
        self.problems = problems  # what is wrong with gpud's persisted state (a corrupt file): /healthz says so
        self.more_routes = more_routes
        self.admin_policy = AdminPolicy(admin_group)
        self.inventory = inventory
        self.node_base = node_base
        self.rendered: RenderedInventory | None = None
        self._node_body = encode(node_view(None, node_base))
        openapi = load_openapi()
        self._openapi = encode(openapi)
        self._query_parameters = query_parameters(openapi)
        self._runner: web.AppRunner | None = None
        inventory.subscribe(self._render)

    def _render(self, snapshot: Inventory) -> None:
        self.rendered = RenderedInventory(snapshot)
        self._node_body = encode(node_view(snapshot, self.node_base))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.__class__ = ShallowRouter  # aiohttp's Application takes no router of another class
        app.router.query_parameters = self._query_parameters
        app[ADMIN_POLICY] = self.admin_policy
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/v1/node", self.node)
        app.router.add_get("/v1/gpus", self.gpus)
        app.router.add_get("/v1/gpus/{id}", self.gpu)
        app.router.add_get("/v1/openapi.json", self.openapi)
        for register in self.more_routes:
            register(app)
        app.router.add_route("*", "/{path:.*}", no_such_route)  # last: only what nothing else matched
        return app

    async def start(self, sock: socket.socket, latency: RequestLatency, *, idle_timeout_s: float,
                    shutdown_timeout_s: float, max_connections: int, max_connections_per_peer: int,
                    admin_reserved_connections: int) -> None:
        """Serves the app on the listening socket; every request is counted in latency, every
        connection weighed against the caps (see connections.py)."""
        self._runner = web.AppRunner(self.app(), handle_signals=False, access_log=RequestLatency.logger(),
                                     access_log_class=latency.access_logger_class(),
                                     logger=REQUEST_ERROR_LOG,  # no request bytes, rate-limited
                                     keepalive_timeout=idle_timeout_s,
                                     # after an error, read the rest of an unwanted body for 1 s at most
                                     lingering_time=1.0,
                                     shutdown_timeout=shutdown_timeout_s)
        await self._runner.setup()
        answer_malformed_requests_with_json(self._runner.server)
        ConnectionLimits(self.admin_policy, max_connections, max_connections_per_peer,
                         admin_reserved_connections).attach(self._runner.server)
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        """Stops accepting, lets in-flight requests finish (for shutdown_timeout_s at most)."""
        if self._runner:
            await self._runner.cleanup()

    # -- read routes ------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        state = self.session.state
        if state is SessionState.READY and self.rendered is not None and not self.inventory.error:
            problems = self.problems()
            if problems:  # gpud serves, but not with everything it had persisted: ready, and loud about it
                return json_response({"status": "degraded", "reason": "; ".join(problems), "problems": problems})
            return encoded_json_response(b'{"status":"ok"}')
        if self.inventory.error:
            status, code, message = "unavailable", "inventory-failed", self.inventory.error
        elif state in (SessionState.READY, SessionState.STARTING):
            status, code, message = "starting", "starting", "gpud is starting: the first inventory is not read yet"
        else:
            status, code = "unavailable", NVML_UNAVAILABLE
            message = self.session.error or f"NVML is {state.value}"
        body = {"status": status, "reason": message, "error": {"code": code, "message": message}}
        return json_response(body, 503)

    async def node(self, request: web.Request) -> web.Response:
        if self.rendered is None:  # no inventory: NVML may still have said which driver it found
            return json_response(node_view(None, self.node_base, self.session.driver_version))
        return encoded_json_response(self._node_body)

    async def gpus(self, request: web.Request) -> web.Response:
        return encoded_json_response(self._require_inventory().gpus_body)

    async def gpu(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        body = self._require_inventory().gpu_body(ident)
        if body is None:
            raise ApiError(ErrorKind.NOT_FOUND, "gpu-not-found",
                           f"no GPU '{ident}' on this node (give an index, a GPU- UUID "
                           "or a PCI bus id)")
        return encoded_json_response(body)

    async def openapi(self, request: web.Request) -> web.Response:
        return encoded_json_response(self._openapi)

    def _require_inventory(self) -> RenderedInventory:
        if self.rendered is None:
            if self.session.error:
                raise nvml_unavailable(self.session.error)
            raise ApiError(ErrorKind.UNAVAILABLE, "starting", "gpud is starting: the first inventory is not read yet")
        return self.rendered


# -- the socket ------------------------------------------------------------------------------


class UnixSocketListener:
    """Binds the API socket, refusing to take over one that another gpud serves.

    A lock file beside the socket is held for gpud's whole life, so two daemons starting at the
    same moment cannot both decide the socket is stale. The socket's directory is made or checked
    with secure_directory: no other user can plant a socket, a lock or a symlink in it.
    """

    def __init__(self, path: Path, mode: int = 0o660, group: str | None = None,
                 inherited: socket.socket | None = None):
        self.path = path
        self.mode = mode
        self.group = group
        self.inherited = inherited  # from systemd: its path, mode and life are systemd's business
        self._lock_fd: int | None = None
        self._gid: int | None = None  # the socket's group, where root gives it one
        self.sock: socket.socket | None = None

    def claim(self) -> None:
        """Makes the socket's directory and takes the lock, before gpud touches anything else: a new
        directory is 0700, or 0750 root:group when the group's members may use the socket (they
        must traverse the directory to reach it); no one else can plant anything in it. An existing
        one keeps its owner and mode: under systemd it is the unit's RuntimeDirectory= (root:root
        0755), and systemd chowns the whole tree back to root, the socket and the MPS directories
        included, at the next ExecStart= or ExecReload= that finds its owner changed."""
        if self.inherited is not None:
            return
        self._gid = self._socket_gid()
        created = secure_directory(self.path.parent, 0o700 if self._gid is None else 0o750,
                                   None if self._gid is None else (0, self._gid), own_existing=False)
        if not created and self._gid is not None:
            self._warn_if_group_cannot_traverse(os.stat(self.path.parent))
        try:
            self._lock_fd = hold_lock(self.path.with_name(self.path.name + ".lock"), f"is running on {self.path}")
        except InUse as exc:
            raise SocketInUse(str(exc)) from None

    def open(self) -> socket.socket:
        """Binds the socket (after claim())."""
        if self.inherited is not None:
            log.info("socket_inherited", socket=str(self.inherited.getsockname()))
            return self.inherited
        if self.path.exists() or self.path.is_symlink():
            self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Never world-accessible, not even for an instant: bind(2) gives the new file the socket's own
        # mode less the umask (linux net/unix/af_unix.c unix_bind: SOCK_INODE(sock)->i_mode &
        # ~current_umask()), so the mode is set on the socket first. Not os.umask(): it is the whole
        # process's, and a thread creating a directory meanwhile (the simulator's sysfs) got one it
        # could not write (CI: "Permission denied" under /run/gpud with no CAP_DAC_OVERRIDE).
        os.fchmod(sock.fileno(), self.mode)
        sock.bind(str(self.path))
        if self._gid is not None:
            os.chown(self.path, 0, self._gid, follow_symlinks=False)
        os.chmod(self.path, self.mode)  # the bits the umask took (0660 under 0022 is 0640)
        sock.listen(128)
        sock.setblocking(False)
        self.sock = sock
        return sock

    def _warn_if_group_cannot_traverse(self, directory: os.stat_result) -> None:
        by_group = directory.st_gid == self._gid and directory.st_mode & stat.S_IXGRP
        if not (directory.st_mode & stat.S_IXOTH or by_group):
            log.warning("socket_directory_closed_to_group", directory=str(self.path.parent), group=self.group,
                        mode=f"{stat.S_IMODE(directory.st_mode):04o}",
                        why="the group's members cannot reach the socket through its directory, which gpud "
                            "did not make and leaves as it is")

    def _socket_gid(self) -> int | None:
        """The group the socket is given to: only root can give it, and only to a group that exists."""
        if os.geteuid() != 0 or not self.group:
            return None
        try:
            return grp.getgrnam(self.group).gr_gid
        except KeyError:
            log.warning("socket_group_missing", group=self.group, why="only root can use the socket")
            return None

    def _remove_stale(self) -> None:
        if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
            raise SocketInUse(f"{self.path} exists and is not a socket; remove it or choose another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            log.info("stale_socket_removed", path=str(self.path))
            self.path.unlink()
        else:
            raise SocketInUse(f"another process answers on {self.path}; not taking it over")
        finally:
            probe.close()

    def close(self) -> None:
        """Removes the socket path (ours: we hold the lock) and releases the lock."""
        if self.inherited is not None:
            return  # systemd keeps listening, and starts the next gpud on the next connection
        if self.sock is not None:
            self.path.unlink(missing_ok=True)
            self.sock.close()
            self.sock = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
