"""A small synchronous client of gpud's socket, for the CLI (standard library only: starts fast)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpud.config import SYSTEM_RUNTIME_DIR, user_runtime_dir

if TYPE_CHECKING:
    import asyncio

SYSTEM_SOCKET = SYSTEM_RUNTIME_DIR / "gpud.sock"
SOCKET_ENV = "GPUD_SOCKET"


class DaemonUnreachable(Exception):
    """No gpud answers on the socket: not running, refused, timed out, or gone mid-answer."""


class ApiFailure(Exception):
    """gpud answered with an error status; `error` is its error object (code, message and details)."""

    def __init__(self, status: int, document: Any):
        error = document.get("error") if isinstance(document, dict) else None
        self.status = status
        self.error: dict = dict(error) if isinstance(error, dict) else {}
        self.error.setdefault("code", f"http-{status}")
        self.error.setdefault("message", f"HTTP {status}")
        self.code = self.error["code"]
        super().__init__(self.error["message"])


def find_socket(env: Mapping[str, str] = os.environ, system_socket: Path = SYSTEM_SOCKET,
                own_dir: Path | None = None) -> tuple[Path, list[str]]:
    """The socket the CLI talks to, and each place looked at (for the message when nothing answers).

    $GPUD_SOCKET, else the system daemon's socket when there is one, else this user's own gpud in
    its runtime directory, and only if no other user could have put a socket there (/tmp/gpud-UID
    could be another user's). Nothing found: the system socket, the one a packaged gpud uses."""
    if env.get(SOCKET_ENV):
        return Path(env[SOCKET_ENV]), [f"${SOCKET_ENV}={env[SOCKET_ENV]}"]
    tried = [f"${SOCKET_ENV} (unset)", str(system_socket)]
    if _is_socket(system_socket):
        return system_socket, tried
    own = own_dir / "gpud.sock" if own_dir else own_socket()
    if own != system_socket:
        try:
            problem = untrusted_because(os.stat(own.parent))
        except OSError:
            problem = "does not exist"
        tried.append(str(own) if problem is None else f"{own} (skipped: {own.parent} {problem})")
        if problem is None and _is_socket(own):
            return own, tried
    return system_socket, tried


def own_socket() -> Path:
    """Where `gpud serve` run by this user listens unless told otherwise."""
    return user_runtime_dir() / "gpud.sock"


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def untrusted_because(directory: os.stat_result) -> str | None:
    """Why a socket in this directory may be another user's (a fake gpud that reads what the CLI
    sends and answers what it likes), or None: the directory is root's or this user's, and no
    one else can write in it."""
    if directory.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {directory.st_uid}, neither root nor you"
    if directory.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(directory.st_mode):04o})"
    return None


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float | None):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        # The directory is checked and then connected through by its descriptor, so the socket
        # is the one in the directory that was checked, even if a path above it changes meanwhile.
        directory = os.open(self._path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.stat(self._path.name, dir_fd=directory)  # no socket there: say that, not what the directory is like
            if problem := untrusted_because(os.fstat(directory)):
                raise DaemonUnreachable(f"not connecting to {self._path}: its directory {problem}, so the "
                                        "socket may not be gpud's")
            sock.settimeout(self.timeout)
            sock.connect(f"/proc/self/fd/{directory}/{self._path.name}")
        except BaseException:
            sock.close()
            raise
        finally:
            os.close(directory)
        self.sock = sock


class Client:
    def __init__(self, socket_path: Path | None = None, timeout: float = 30.0):
        if socket_path is None:
            self.socket_path, self.tried = find_socket()
        else:
            self.socket_path, self.tried = Path(socket_path), []
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None, ok_statuses: tuple = ()) -> tuple[int, Any]:
        status, raw = self._exchange(method, path, body)
        try:
            document = json.loads(raw) if raw else None
        except ValueError:
            document = {"error": {"message": raw.decode(errors="replace")[:200]}}
        if status >= 400 and status not in ok_statuses:
            raise ApiFailure(status, document)
        return status, document

    def request_text(self, method: str, path: str) -> tuple[int, str]:
        """For the routes that answer with text (YAML, Prometheus) rather than JSON."""
        status, raw = self._exchange(method, path, None)
        if status >= 400:
            raise ApiFailure(status, _json_or_none(raw))
        return status, raw.decode()

    def _exchange(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        conn = _UnixConnection(self.socket_path, self.timeout)
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        except OSError as exc:
            raise self._unreachable(exc) from None
        except http.client.HTTPException as exc:
            raise DaemonUnreachable(f"gpud on {self.socket_path} went away before answering ({exc!r})") from None
        finally:
            conn.close()

    def stream(self, path: str, on_open: Callable[[], None] | None = None) -> Iterator[Any]:
        """The JSON lines of a streaming route, as they arrive (on_open is called once gpud has accepted
        the request). Returns when gpud ends the stream (it is stopping); DaemonUnreachable when the
        connection breaks off."""
        conn = _UnixConnection(self.socket_path, None)
        try:
            try:
                conn.request("GET", path)
                response = conn.getresponse()
            except OSError as exc:
                raise self._unreachable(exc) from None
            if response.status >= 400:
                raise ApiFailure(response.status, _json_or_none(response.read()))
            if on_open is not None:
                on_open()
            try:
                for line in response:
                    if line.strip():
                        yield json.loads(line)
            except (OSError, http.client.HTTPException) as exc:
                raise DaemonUnreachable(f"gpud on {self.socket_path} went away: the stream broke off "
                                        f"({exc.__class__.__name__})") from None
        finally:
            conn.close()

    def get(self, path: str, ok_statuses: tuple = ()) -> Any:
        return self.request("GET", path, ok_statuses=ok_statuses)[1]

    def _unreachable(self, exc: OSError) -> DaemonUnreachable:
        where = str(self.socket_path) + (f" (looked at: {', '.join(self.tried)})" if self.tried else "")
        if isinstance(exc, FileNotFoundError):
            return DaemonUnreachable(f"gpud is not running: no socket at {where}; gpud serve run by you "
                                     f"listens at {own_socket()}")
        if isinstance(exc, PermissionError):
            return DaemonUnreachable(f"no permission to connect to {self.socket_path} (join the gpud group, "
                                     "or use sudo)")
        if isinstance(exc, ConnectionRefusedError):
            return DaemonUnreachable(f"gpud is not answering on {where}: connection refused")
        if isinstance(exc, TimeoutError):
            return DaemonUnreachable(f"gpud on {self.socket_path} did not answer within {self.timeout:g} s")
        return DaemonUnreachable(f"talking to gpud on {self.socket_path} failed: {exc}")


def follow_stream(client: Client, path: str, loop: asyncio.AbstractEventLoop, on_event: Callable[[Any], None],
                  on_disconnect: Callable[[str, float], None], backoff_s: tuple[float, float] = (0.2, 5.0)) -> None:
    """Reads a streaming route for ever, in a thread of its own: it stays blocked in a read, so it is a
    daemon thread, not the loop's executor. Each line goes to on_event and each break-off to
    on_disconnect(reason, retry_in_s), both called in the loop; reconnects with a backoff. Returns
    when the loop is closed (its owner is stopping)."""
    first, most = backoff_s
    backoff = first
    try:
        while True:
            try:
                for event in client.stream(path):
                    backoff = first
                    loop.call_soon_threadsafe(on_event, event)
                reason = "gpud ended the stream (stopping)"
            except (DaemonUnreachable, ApiFailure, ValueError) as exc:
                reason = str(exc)
            loop.call_soon_threadsafe(on_disconnect, reason, backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, most)
    except RuntimeError:  # the loop is closed
        return


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None
