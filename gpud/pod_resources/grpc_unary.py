"""One unary gRPC call over HTTP/2 on a Unix socket (gRPC's PROTOCOL-HTTP2.md), blocking, within one
deadline for the whole exchange: what the kubelet's pod-resources socket serves (grpc-go, plaintext HTTP/2
with prior knowledge). HTTP/2 itself is python-hyper's h2 (pure Python, as `gpud serve` needs).

The client announces a stream and connection window as large as the largest answer it takes, so the
server never waits for a WINDOW_UPDATE; h2 acknowledges the server's SETTINGS and PINGs and refuses frames
larger than its SETTINGS_MAX_FRAME_SIZE and header lists larger than its decoder's bound. The status is
read from the trailers, or from a Trailers-Only answer's headers. Everything that is not a well-formed
answer with grpc-status 0 is a GrpcCallError naming what went wrong.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from urllib.parse import unquote

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (ConnectionTerminated, DataReceived, ResponseReceived, StreamEnded, StreamReset,
                       TrailersReceived)
from h2.exceptions import H2Error
from h2.settings import SettingCodes, Settings

DEFAULT_WINDOW = 65535  # RFC 9113 6.9.2
STREAM = 1
CANCEL = 0x8  # RFC 9113 7, an RST_STREAM's error code
DEADLINE_EXCEEDED = "4"  # grpc doc/statuscodes.md
# grpc-timeout goes in whole milliseconds, rounded down: the server's deadline may pass that much before ours
DEADLINE_SLACK_S = 0.005


class GrpcCallError(Exception):
    """The call gave no answer: the socket, the deadline, the protocol, or a gRPC status other than OK."""


def call(path: Path, method: str, request: bytes, timeout_s: float, max_answer_bytes: int) -> bytes:
    """The answer's message bytes. `method`: "/package.Service/Method"."""
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        connection = _opened(method, request, timeout_s, max_answer_bytes)
        sock.sendall(connection.data_to_send())
        return _Answer(sock, connection, deadline, max_answer_bytes).read()
    except socket.timeout:
        raise GrpcCallError(f"no answer within {timeout_s:g} s") from None
    except H2Error as exc:
        raise GrpcCallError(f"HTTP/2 protocol error: {type(exc).__name__}: {exc}") from None
    except OSError as exc:
        raise GrpcCallError(f"{type(exc).__name__}: {exc.strerror or exc}") from None
    finally:
        sock.close()


def _opened(method: str, request: bytes, timeout_s: float, max_answer_bytes: int) -> H2Connection:
    window = min(max(max_answer_bytes + 1024, DEFAULT_WINDOW), (1 << 31) - 1)  # the message, its prefix, trailers
    connection = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    connection.local_settings = Settings(client=True, initial_values={SettingCodes.ENABLE_PUSH: 0,
                                                                      SettingCodes.INITIAL_WINDOW_SIZE: window})
    connection.initiate_connection()
    if window > DEFAULT_WINDOW:  # the connection's window too: only a WINDOW_UPDATE raises it (RFC 9113 6.9.2)
        connection.increment_flow_control_window(window - DEFAULT_WINDOW)
    timeout = f"{max(1, int(timeout_s * 1000))}m".encode()
    connection.send_headers(STREAM, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
                                     (b":authority", b"localhost"), (b"content-type", b"application/grpc"),
                                     (b"te", b"trailers"), (b"grpc-timeout", timeout)])
    connection.send_data(STREAM, b"\x00" + struct.pack(">I", len(request)) + request, end_stream=True)  # uncompressed
    return connection


class _Answer:
    def __init__(self, sock: socket.socket, connection: H2Connection, deadline: float, max_bytes: int):
        self.sock, self.connection, self.deadline, self.max_bytes = sock, connection, deadline, max_bytes
        self.headers: dict[bytes, bytes] | None = None
        self.trailers: dict[bytes, bytes] = {}
        self.body = bytearray()

    def read(self) -> bytes:
        ended = False
        while not ended:
            for event in self.connection.receive_data(self._received()):
                ended = self._take(event) or ended
            self._send()
        return self._message()

    def _take(self, event) -> bool:
        """Whether the call ended with this event."""
        if isinstance(event, ConnectionTerminated) and (event.last_stream_id or 0) < STREAM:
            raise GrpcCallError(f"the server went away (GOAWAY, error code {int(event.error_code)})")
        if getattr(event, "stream_id", STREAM) != STREAM:
            return False
        if isinstance(event, StreamReset):
            if event.error_code == CANCEL and self._past_deadline():
                # grpc-go's server (the kubelet's) resets the stream once the grpc-timeout sent runs out
                # (internal/transport/http2_server.go operateHeaders: closeStream with ErrCodeCancel)
                raise socket.timeout()
            raise GrpcCallError(f"the server reset the call (RST_STREAM, error code {int(event.error_code)})")
        if isinstance(event, ResponseReceived):
            self.headers = dict(event.headers)
        elif isinstance(event, TrailersReceived):
            self.trailers = dict(event.headers)
        elif isinstance(event, DataReceived):
            self.body += event.data
            if len(self.body) > self.max_bytes + 5:
                raise GrpcCallError(f"the answer is larger than {self.max_bytes} bytes")
        return isinstance(event, StreamEnded)

    def _past_deadline(self) -> bool:
        """Whether the server ended the call at the deadline gpud sent it: said as gpud's own timeout."""
        return time.monotonic() >= self.deadline - DEADLINE_SLACK_S

    def _received(self) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout()
        self.sock.settimeout(left)
        chunk = self.sock.recv(65536)
        if not chunk:
            raise GrpcCallError("the server closed the connection mid-answer")
        return chunk

    def _send(self) -> None:
        """h2's acknowledgements: a server that closed its side may have written the whole answer already,
        and what is left to read says whether it did."""
        try:
            self.sock.sendall(self.connection.data_to_send())
        except OSError:
            pass

    def _message(self) -> bytes:
        if self.headers is None:
            raise GrpcCallError("the call ended without headers")
        if self.headers.get(b":status") != b"200":
            raise GrpcCallError(f"HTTP status {self.headers.get(b':status', b'').decode(errors='replace')}, "
                                "not a gRPC answer")
        last = self.trailers or self.headers  # a Trailers-Only answer has its status in its headers
        status = last.get(b"grpc-status", b"").decode(errors="replace")
        if status != "0":
            if status == DEADLINE_EXCEEDED and self._past_deadline():  # grpc core's server answers so instead
                raise socket.timeout()
            message = unquote(last.get(b"grpc-message", b"").decode(errors="replace"))
            raise GrpcCallError(f"gRPC status {status}: {message}")
        if len(self.body) < 5 or self.body[0] != 0:
            raise GrpcCallError("the answer has no uncompressed message")
        length = struct.unpack(">I", self.body[1:5])[0]
        if len(self.body) != 5 + length:
            raise GrpcCallError(f"the answer's message is {len(self.body) - 5} bytes where its prefix says {length}")
        return bytes(self.body[5:])
