"""gpud's HTTP/JSON API on a Unix socket. Handlers serve snapshots; they never call NVML themselves."""

from __future__ import annotations

import errno
import fcntl
import grp
import importlib.resources
import os
import socket
import stat
from pathlib import Path
from typing import Any, Callable

import yaml
from aiohttp import web

from gpud.api.auth import ADMIN_POLICY, AdminPolicy, admin_only
from gpud.api.errors import MAX_BODY_BYTES, ApiError, error_response, json_errors, no_such_route, read_json_object
from gpud.api.views import RenderedInventory, encode, node_view
from gpud.inventory import Inventory, InventoryService
from gpud.logs import get_logger
from gpud.nvml.session import NvmlSession, NvmlUnavailable, SessionState, describe_error
from gpud.nvml.sim import SimError

log = get_logger("api")
JSON = "application/json"


def load_openapi() -> dict:
    """The API's OpenAPI document, kept as commented YAML beside this module."""
    return yaml.safe_load(importlib.resources.files("gpud.api").joinpath("openapi.yaml").read_text())


class SocketInUse(RuntimeError):
    """Another gpud already serves (or is starting on) this socket path."""


class Api:
    """The routes, and the rendered snapshot they answer from."""

    def __init__(self, session: NvmlSession, inventory: InventoryService, node_base: dict, body_timeout_s: float,
                 more_routes: tuple[Callable[[web.Application], None], ...] = (), admin_group: str = "gpud-admin"):
        self.session = session
        self.more_routes = more_routes
        self.admin_policy = AdminPolicy(admin_group)
        self.inventory = inventory
        self.node_base = node_base
        self.body_timeout_s = body_timeout_s
        self.rendered: RenderedInventory | None = None
        self._node_body = encode(node_view(None, node_base))
        self._openapi = encode(load_openapi())
        inventory.subscribe(self._render)

    def _render(self, snapshot: Inventory) -> None:
        self.rendered = RenderedInventory(snapshot)
        self._node_body = encode(node_view(snapshot, self.node_base))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app[ADMIN_POLICY] = self.admin_policy
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/v1/node", self.node)
        app.router.add_get("/v1/gpus", self.gpus)
        app.router.add_get("/v1/gpus/{id}", self.gpu)
        app.router.add_get("/v1/openapi.json", self.openapi)
        self._register_sim_routes(app)
        for register in self.more_routes:
            register(app)
        app.router.add_route("*", "/{path:.*}", no_such_route)  # last: only what nothing else matched
        return app

    # -- read routes ------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        state = self.session.state
        if state is SessionState.READY and self.rendered is not None and not self.inventory.error:
            return web.Response(body=b'{"status":"ok"}', content_type=JSON)
        if self.inventory.error:
            status, code, message = "unavailable", "inventory-failed", self.inventory.error
        elif state in (SessionState.READY, SessionState.STARTING):
            status, code, message = "starting", "starting", "gpud is starting: the first inventory is not read yet"
        else:
            status, code = "unavailable", "nvml-unavailable"
            message = self.session.error or f"NVML is {state.value}"
        body = {"status": status, "reason": message, "error": {"code": code, "message": message}}
        return web.Response(status=503, body=encode(body), content_type=JSON)

    async def node(self, request: web.Request) -> web.Response:
        if self.rendered is None:  # no inventory: NVML may still have said which driver it found
            return web.Response(body=encode(node_view(None, self.node_base, self.session.driver_version)),
                                content_type=JSON)
        return web.Response(body=self._node_body, content_type=JSON)

    @json_errors
    async def gpus(self, request: web.Request) -> web.Response:
        return web.Response(body=self._require_inventory().gpus_body, content_type=JSON)

    @json_errors
    async def gpu(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        body = self._require_inventory().gpu_body(ident)
        if body is None:
            raise ApiError(404, "gpu-not-found", f"no GPU '{ident}' on this node (give an index, a GPU- UUID "
                                                 "or a PCI bus id)")
        return web.Response(body=body, content_type=JSON)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type=JSON)

    def _require_inventory(self) -> RenderedInventory:
        if self.rendered is None:
            raise ApiError(503, "nvml-unavailable" if self.session.error else "starting",
                           self.session.error or "gpud is starting: the first inventory is not read yet")
        return self.rendered

    # -- simulator faults ----------------------------------------------------------------------

    def _register_sim_routes(self, app: web.Application) -> None:
        """Fault injection exists only on a simulated node; elsewhere /v1/sim/* says why it is absent."""
        if not self.session.simulated:
            app.router.add_route("*", "/v1/sim/{what:.*}", self.not_simulated)
            return
        for name, handler in (("xid", self.sim_xid), ("gpu-lost", self.sim_gpu_lost),
                              ("gpu-recover", self.sim_gpu_recover), ("processes", self.sim_processes),
                              ("holders", self.sim_holders), ("ecc", self.sim_ecc)):
            app.router.add_post(f"/v1/sim/{name}", handler)

    async def not_simulated(self, request: web.Request) -> web.Response:
        return error_response(404, "not-simulated", "fault injection exists only on a simulated node (--simulate)")

    @admin_only
    @json_errors
    async def sim_xid(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "xid": (int,),
                                                                     "gi_id": (int, type(None)),
                                                                     "ci_id": (int, type(None))})
        if not 0 < body["xid"] < 1 << 16:
            raise ApiError(400, "invalid-field", f"field 'xid' must be between 1 and 65535, got {body['xid']}")
        await self._sim_call("sim_inject_xid", body["gpu"], body["xid"], body.get("gi_id"), body.get("ci_id"))
        log.warning("sim_xid_injected", gpu=body["gpu"], xid=body["xid"], gi_id=body.get("gi_id"),
                    ci_id=body.get("ci_id"))
        return _accepted({"injected": "xid", **body})

    @admin_only
    @json_errors
    async def sim_gpu_lost(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "how": (str, type(None))})
        how = {"how": body["how"]} if body.get("how") is not None else {}  # else the simulator's default
        await self._sim_call("sim_set_gpu_lost", body["gpu"], **how)
        log.warning("sim_gpu_lost", gpu=body["gpu"], how=body.get("how"))
        await self.inventory.refresh("simulated GPU loss")
        return _accepted({"injected": "gpu-lost", **body})

    @admin_only
    @json_errors
    async def sim_gpu_recover(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str)})
        await self._sim_call("sim_recover_gpu", body["gpu"])
        log.warning("sim_gpu_recovered", gpu=body["gpu"])
        await self.inventory.refresh("simulated GPU recovery")
        return _accepted({"injected": "gpu-recovered", **body})

    @admin_only
    @json_errors
    async def sim_holders(self, request: web.Request) -> web.Response:
        """Another host process holds the GPU's device node (a monitoring agent, a CUDA app), or
        every such process lets go (release)."""
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "process": (str, type(None)),
                                                                     "pid": (int, type(None)),
                                                                     "release": (bool, type(None))})
        _check_holder(body)
        if body.get("release"):
            await self._sim_call("sim_release_holders", body["gpu"])
            log.info("sim_holders_released", gpu=body["gpu"])
            injected = "holders-released"
        else:
            await self._sim_call("sim_add_holder", body["gpu"], body["process"], body["pid"])
            log.info("sim_holder_added", gpu=body["gpu"], process=body["process"], pid=body["pid"])
            injected = "holder"
        holders = await self._sim_call("sim_holders", body["gpu"])
        return _accepted({"injected": injected, **body,
                          "holders": [{"pid": pid, "process": process} for pid, process in holders]})

    @admin_only
    @json_errors
    async def sim_processes(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "pids": (list,)})
        pids = body["pids"]
        if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 1 << 22 for p in pids):
            raise ApiError(400, "invalid-field", "field 'pids' must be a list of process ids (positive integers)")
        await self._sim_call("sim_set_processes", body["gpu"], pids)
        log.info("sim_processes_set", gpu=body["gpu"], pids=pids)
        await self.inventory.refresh("simulated processes")
        return _accepted({"injected": "processes", **body})

    @admin_only
    @json_errors
    async def sim_ecc(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "double_bit": (bool,)})
        await self._sim_call("sim_inject_ecc", body["gpu"], body["double_bit"])
        log.warning("sim_ecc_injected", gpu=body["gpu"], double_bit=body["double_bit"])
        return _accepted({"injected": "ecc", **body})

    async def _sim_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self.session.call(lambda nvml: getattr(nvml, method)(*args, **kwargs))
        except SimError as exc:
            raise ApiError(422, "invalid-target", str(exc)) from None
        except NvmlUnavailable as exc:
            raise ApiError(503, "nvml-unavailable", str(exc)) from None
        except self.session.nvml.NVMLError as exc:
            raise ApiError(409, "nvml-error", describe_error(exc)) from None


def _check_holder(body: dict) -> None:
    process, pid = body.get("process"), body.get("pid")
    if body.get("release"):
        if process is not None or pid is not None:
            raise ApiError(400, "invalid-body", "give either release: true, or process and pid")
        return
    if process is None or pid is None:
        raise ApiError(400, "missing-field", "a holder needs 'process' and 'pid' (or give release: true)")
    if not 0 < pid < 1 << 22:
        raise ApiError(400, "invalid-field", f"field 'pid' must be a process id (a positive integer), got {pid}")
    if not process.strip() or not process.isprintable() or len(process) > 64:
        raise ApiError(400, "invalid-field", "field 'process' must be a program name (1 to 64 printable characters)")


def _accepted(document: dict) -> web.Response:
    return web.Response(body=encode(document), content_type=JSON)


# -- the socket ------------------------------------------------------------------------------


class UnixSocketListener:
    """Binds the API socket, refusing to take over one that another gpud serves.

    A lock file beside the socket is held for gpud's whole life, so two daemons starting at the
    same moment cannot both decide the socket is stale.
    """

    def __init__(self, path: Path, mode: int = 0o660, group: str | None = None,
                 inherited: socket.socket | None = None):
        self.path = path
        self.mode = mode
        self.group = group
        self.inherited = inherited  # from systemd: its path, mode and life are systemd's business
        self._lock_fd: int | None = None
        self.sock: socket.socket | None = None

    def open(self) -> socket.socket:
        if self.inherited is not None:
            log.info("socket_inherited", socket=str(self.inherited.getsockname()))
            return self.inherited
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        self._lock()
        if self.path.exists() or self.path.is_symlink():
            self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o777 & ~self.mode)  # never world-accessible, not even for an instant
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        self._give_to_group()
        sock.listen(128)
        sock.setblocking(False)
        self.sock = sock
        return sock

    def _give_to_group(self) -> None:
        if os.geteuid() != 0 or not self.group:
            return
        try:
            os.chown(self.path, 0, grp.getgrnam(self.group).gr_gid)
        except KeyError:
            log.warning("socket_group_missing", group=self.group, why="only root can use the socket")

    def _lock(self) -> None:
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SocketInUse(f"another gpud is running on {self.path} (it holds {lock_path})") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

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
