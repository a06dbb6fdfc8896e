"""A small synchronous client of gpud's socket, for the CLI and the integrations (standard library only,
and only the parts a command needs: it starts fast; gpud/base/http1.py says why not http.client)."""

from __future__ import annotations

import json
import os
import socket
import stat
import time

from gpud.base import bounded_json, http1
from gpud.base.places import SYSTEM_RUNTIME_DIR, user_runtime_dir

TYPE_CHECKING = False  # typing's import costs more than this module: the names are for annotations only
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Iterator, Mapping
    from typing import Any

    StrPath = str | os.PathLike[str]

SYSTEM_SOCKET = os.path.join(SYSTEM_RUNTIME_DIR, "gpud.sock")  # paths are str here: pathlib is not imported
SOCKET_ENV = "GPUD_SOCKET"
# gpud's largest answers (/metrics, /v1/health of a node with 56 MIG devices and its history) are a
# few MiB; one larger is not read, nor held whole.
MAX_ANSWER_BYTES = 64 << 20
MAX_STREAM_LINE_BYTES = 1 << 20  # one event of /v1/watch: a few KiB


class DaemonUnreachable(Exception):
    """No gpud answers on the socket: not running, refused, timed out, or gone mid-answer."""


class BadAnswer(DaemonUnreachable):
    """gpud's answer could not be taken: larger than the client reads, or JSON nested too deep."""


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


def find_socket(env: Mapping[str, str] = os.environ, system_socket: StrPath = SYSTEM_SOCKET,
                own_dir: StrPath | None = None) -> tuple[str, list[str]]:
    """The socket the CLI talks to, and each place looked at (for the message when nothing answers).

    $GPUD_SOCKET, else the system daemon's socket when there is one, else this user's own gpud in
    its runtime directory, and only if no other user could have put a socket there (/tmp/gpud-UID
    could be another user's). Nothing found: the system socket, the one a packaged gpud uses."""
    if env.get(SOCKET_ENV):
        return env[SOCKET_ENV], [f"${SOCKET_ENV}={env[SOCKET_ENV]}"]
    system_socket = os.fspath(system_socket)
    tried = [f"${SOCKET_ENV} (unset)", system_socket]
    if _is_socket(system_socket):
        return system_socket, tried
    own = os.path.join(own_dir, "gpud.sock") if own_dir else own_socket()
    if own != system_socket:
        try:
            problem = untrusted_because(os.stat(os.path.dirname(own)))
        except OSError:
            problem = "does not exist"
        tried.append(own if problem is None else f"{own} (skipped: {os.path.dirname(own)} {problem})")
        if problem is None and _is_socket(own):
            return own, tried
    return system_socket, tried


def own_socket() -> str:
    """Where `gpud serve` run by this user listens unless told otherwise."""
    return os.path.join(user_runtime_dir(), "gpud.sock")


def _is_socket(path: str) -> bool:
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


class _DeadlineSocket(socket.socket):
    """A socket whose every wait ends at one deadline: a peer that trickles its answer a byte at a
    time cannot stretch a per-read timeout into an endless exchange."""

    deadline: float | None = None

    def _until_deadline(self) -> None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the deadline passed")
            self.settimeout(left)

    def recv(self, *args, **kwargs):
        self._until_deadline()
        return super().recv(*args, **kwargs)

    def sendall(self, *args, **kwargs):
        self._until_deadline()
        return super().sendall(*args, **kwargs)


def _connect(path: str, timeout: float | None) -> _DeadlineSocket:
    """A connection to the socket at path, with its deadline (timeout from now) set.

    The directory is checked and then connected through by its descriptor, so the socket is the
    one in the directory that was checked, even if a path above it changes meanwhile."""
    parent, name = os.path.split(path)
    directory = os.open(parent or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    sock = _DeadlineSocket(socket.AF_UNIX, socket.SOCK_STREAM)
    if timeout is not None:
        sock.deadline = time.monotonic() + timeout
    try:
        os.stat(name, dir_fd=directory)  # no socket there: say that, not what the directory is like
        if problem := untrusted_because(os.fstat(directory)):
            raise DaemonUnreachable(f"not connecting to {path}: its directory {problem}, so the "
                                    "socket may not be gpud's")
        sock.settimeout(timeout)
        sock.connect(f"/proc/self/fd/{directory}/{name}")
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(directory)
    return sock


class Client:
    """timeout: for the whole of each exchange (connect, request, the whole answer), not each read."""

    def __init__(self, socket_path: StrPath | None = None, timeout: float = 30.0,
                 max_answer_bytes: int = MAX_ANSWER_BYTES):
        if socket_path is None:
            self.socket_path, self.tried = find_socket()
        else:
            self.socket_path, self.tried = os.fspath(socket_path), []
        self.timeout = timeout
        self.max_answer_bytes = max_answer_bytes

    def request(self, method: str, path: str, body: Any = None, ok_statuses: tuple = ()) -> tuple[int, Any]:
        status, raw = self._exchange(method, path, body)
        try:
            document = bounded_json.loads(raw, what=f"gpud's answer to {method} {path}") if raw else None
        except bounded_json.JsonTooDeep as exc:
            raise BadAnswer(str(exc)) from None
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
        payload = json.dumps(body).encode() if body is not None else None
        try:
            with _connect(self.socket_path, self.timeout) as conn:
                answer = http1.exchange(conn, method, path, payload)
                return answer.status, answer.body(self.max_answer_bytes)
        except http1.TooLarge as exc:
            raise BadAnswer(f"gpud's answer to {method} {path} is {exc}, over the {self.max_answer_bytes} "
                            "bytes this client reads") from None
        except OSError as exc:
            raise self._unreachable(exc) from None
        except http1.NotHttp as exc:
            raise DaemonUnreachable(f"gpud on {self.socket_path} went away before answering ({exc})") from None

    def stream(self, path: str, on_open: Callable[[], None] | None = None) -> Iterator[Any]:
        """The JSON lines of a streaming route, as they arrive (on_open is called once gpud has accepted
        the request). Returns when gpud ends the stream (it is stopping); DaemonUnreachable when the
        connection breaks off. The connection and the answer's head (or error) have the client's timeout,
        as any exchange; the stream itself none: events may be minutes apart."""
        try:
            conn = _connect(self.socket_path, self.timeout)
        except OSError as exc:
            raise self._unreachable(exc) from None
        with conn:
            try:
                answer = http1.exchange(conn, "GET", path)
                if answer.status >= 400:
                    raise ApiFailure(answer.status, _json_or_none(answer.body(self.max_answer_bytes)))
                conn.deadline = None
                conn.settimeout(None)
            except OSError as exc:
                raise self._unreachable(exc) from None
            except http1.TooLarge as exc:
                raise BadAnswer(f"gpud's error answer to GET {path} is {exc}, over the {self.max_answer_bytes} "
                                "bytes this client reads") from None
            except http1.NotHttp as exc:
                raise DaemonUnreachable(f"gpud on {self.socket_path} went away before answering ({exc})") from None
            if on_open is not None:
                on_open()
            try:
                for line in answer.lines(MAX_STREAM_LINE_BYTES):
                    if line.strip():
                        try:
                            yield bounded_json.loads(line, what=f"a line of gpud's stream {path}")
                        except bounded_json.JsonTooDeep as exc:
                            raise BadAnswer(str(exc)) from None
            except http1.TooLarge:
                raise BadAnswer(f"gpud's stream {path} sent a line over {MAX_STREAM_LINE_BYTES} bytes") from None
            except (OSError, http1.NotHttp) as exc:
                raise DaemonUnreachable(f"gpud on {self.socket_path} went away: the stream broke off "
                                        f"({exc.__class__.__name__})") from None

    def get(self, path: str, ok_statuses: tuple = ()) -> Any:
        return self.request("GET", path, ok_statuses=ok_statuses)[1]

    def _unreachable(self, exc: OSError) -> DaemonUnreachable:
        where = self.socket_path + (f" (looked at: {', '.join(self.tried)})" if self.tried else "")
        if isinstance(exc, FileNotFoundError):
            return DaemonUnreachable(f"gpud is not running: no socket at {where}; gpud serve run by you "
                                     f"listens at {own_socket()}")
        if isinstance(exc, PermissionError):
            return DaemonUnreachable(no_permission_text(self.socket_path))
        if isinstance(exc, ConnectionRefusedError):
            return DaemonUnreachable(f"gpud is not answering on {where}: connection refused")
        if isinstance(exc, TimeoutError):
            return DaemonUnreachable(f"gpud on {self.socket_path} did not answer whole within {self.timeout:g} s")
        return DaemonUnreachable(f"talking to gpud on {self.socket_path} failed: {exc}")


def no_permission_text(path: str) -> str:
    """Why connecting to path was refused, and what lets this user in, as this host has it: a group
    only where the socket's group may connect and is not root's (a source install has no gpud group)."""
    try:
        info = os.stat(path)
    except OSError:
        return f"no permission to reach {path}: a directory on its way is closed to you; run the command as root"
    import grp
    import pwd

    try:
        group = grp.getgrgid(info.st_gid).gr_name
    except KeyError:
        group = str(info.st_gid)
    said = f"no permission to connect to {path} (owner uid {info.st_uid}, group {group}, mode " \
           f"{stat.S_IMODE(info.st_mode):04o})"
    if info.st_gid == 0 or not info.st_mode & stat.S_IWGRP:
        return f"{said}: run the command as root"
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = f"#{os.geteuid()}"
    return (f"{said}: run the command as root, or as a member of group {group} (as root: "
            f"usermod -aG {group} {user}; then log in again)")


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
        return bounded_json.loads(raw, what="gpud's error answer")
    except ValueError:
        return None
