"""A small synchronous client of gpud's socket, for the CLI (standard library only: starts fast)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any

from gpud.config import SYSTEM_RUNTIME_DIR, user_runtime_dir


class DaemonUnreachable(Exception):
    pass


class ApiFailure(Exception):
    def __init__(self, status: int, document: Any):
        error = document.get("error", {}) if isinstance(document, dict) else {}
        self.status, self.code = status, error.get("code", f"http-{status}")
        super().__init__(error.get("message") or f"HTTP {status}")


def default_socket() -> Path:
    """$GPUD_SOCKET, else this user's gpud if one runs (in a directory only the user or root
    controls: /tmp/gpud-UID could be another user's), else the system daemon's socket."""
    if os.environ.get("GPUD_SOCKET"):
        return Path(os.environ["GPUD_SOCKET"])
    own = user_runtime_dir() / "gpud.sock"
    try:
        trusted = untrusted_because(os.stat(own.parent)) is None and own.exists()
    except OSError:
        trusted = False
    return own if trusted else SYSTEM_RUNTIME_DIR / "gpud.sock"


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
    def __init__(self, path: Path, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        # The directory is checked and then connected through by its descriptor, so the socket
        # is the one in the directory that was checked, even if a path above it changes meanwhile.
        directory = os.open(self._path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
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
        self.socket_path = socket_path or default_socket()
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
        """For the routes that answer with text (YAML) rather than JSON."""
        status, raw = self._exchange(method, path, None)
        if status >= 400:
            raise ApiFailure(status, json.loads(raw))
        return status, raw.decode()

    def _exchange(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        conn = _UnixConnection(self.socket_path, self.timeout)
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except FileNotFoundError:
            raise DaemonUnreachable(f"gpud is not running: no socket at {self.socket_path}") from None
        except PermissionError:
            raise DaemonUnreachable(f"no permission to connect to {self.socket_path} "
                                    "(join the gpud group, or use sudo)") from None
        except (ConnectionRefusedError, ConnectionResetError):
            raise DaemonUnreachable(f"gpud is not answering on {self.socket_path}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise DaemonUnreachable(f"talking to gpud on {self.socket_path} failed: {exc}") from None
        finally:
            conn.close()
        return response.status, raw

    def stream(self, path: str):
        """The JSON lines of a streaming route, as they arrive."""
        conn = _UnixConnection(self.socket_path, None)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            if response.status >= 400:
                raise ApiFailure(response.status, json.loads(response.read() or b"{}"))
            for line in response:
                if line.strip():
                    yield json.loads(line)
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonUnreachable(f"gpud is not running: no socket at {self.socket_path}") from None
        finally:
            conn.close()

    def get(self, path: str, ok_statuses: tuple = ()) -> Any:
        return self.request("GET", path, ok_statuses=ok_statuses)[1]
