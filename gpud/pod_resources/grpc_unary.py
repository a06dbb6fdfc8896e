"""One unary gRPC call over HTTP/2 on a Unix socket (gRPC's PROTOCOL-HTTP2.md; RFC 9113), blocking, within
a deadline: what the kubelet's pod-resources socket serves (grpc-go, plaintext HTTP/2 with prior knowledge).

The client announces a stream window as large as the largest answer it takes, so the server never waits
for a WINDOW_UPDATE; it acknowledges the server's SETTINGS and PINGs; it reads the status from the
trailers (or a Trailers-Only answer). Everything that is not a well-formed answer with grpc-status 0 is
a GrpcCallError naming what went wrong.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from urllib.parse import unquote

from gpud.pod_resources.hpack import Decoder, HpackError, encode_literals

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 5, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x4
DEFAULT_WINDOW = 65535  # RFC 9113 6.9.2
MAX_FRAME = (1 << 24) - 1  # the largest SETTINGS_MAX_FRAME_SIZE a server may have been allowed
STREAM = 1


class GrpcCallError(Exception):
    """The call gave no answer: the socket, the deadline, the protocol, or a gRPC status other than OK."""


def call(path: Path, method: str, request: bytes, timeout_s: float, max_answer_bytes: int) -> bytes:
    """The answer's message bytes. `method`: "/package.Service/Method"."""
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        sock.sendall(_opening(method, request, timeout_s, max_answer_bytes))
        return _Answer(sock, deadline, max_answer_bytes).read()
    except socket.timeout:
        raise GrpcCallError(f"no answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise GrpcCallError(f"{type(exc).__name__}: {exc.strerror or exc}") from None
    finally:
        sock.close()


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _opening(method: str, request: bytes, timeout_s: float, max_answer_bytes: int) -> bytes:
    window = min(max(max_answer_bytes + 1024, DEFAULT_WINDOW), (1 << 31) - 1)  # the message, its prefix, trailers
    settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, window)
    headers = encode_literals([(":method", "POST"), (":scheme", "http"), (":path", method),
                               (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers"),
                               ("grpc-timeout", f"{max(1, int(timeout_s * 1000))}m")])
    message = b"\x00" + struct.pack(">I", len(request)) + request  # uncompressed, length-prefixed
    more = window - DEFAULT_WINDOW  # the connection's window too: only a WINDOW_UPDATE raises it (RFC 9113 6.9.2)
    return (PREFACE + _frame(SETTINGS, 0, 0, settings)
            + (_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", more)) if more else b"")
            + _frame(HEADERS, END_HEADERS, STREAM, headers) + _frame(DATA, END_STREAM, STREAM, message))


class _Answer:
    def __init__(self, sock: socket.socket, deadline: float, max_bytes: int):
        self.sock, self.deadline, self.max_bytes = sock, deadline, max_bytes
        self.buffer = bytearray()
        self.decoder = Decoder()
        self.header_blocks: list[list[tuple[str, str]]] = []
        self.body = bytearray()

    def read(self) -> bytes:
        block, ended = bytearray(), False
        while not ended or block:
            kind, flags, stream, payload = self._next_frame()
            if kind == SETTINGS and not flags & ACK:
                self._send(_frame(SETTINGS, ACK, 0, b""))
            elif kind == PING and not flags & ACK:
                self._send(_frame(PING, ACK, 0, payload))
            elif kind == GOAWAY:
                last, code = struct.unpack(">II", payload[:8]) if len(payload) >= 8 else (0, 0)
                if (last & 0x7FFFFFFF) < STREAM:  # our stream was not taken: it will not be answered
                    raise GrpcCallError(f"the server went away (GOAWAY, error code {code})")
            elif kind == PUSH_PROMISE:
                raise GrpcCallError("the server promised a push, which this client disabled")
            elif stream != STREAM:
                continue  # WINDOW_UPDATE and the like, of the connection or of no stream of ours
            elif kind == RST_STREAM:
                code = struct.unpack(">I", payload[:4])[0] if len(payload) >= 4 else -1
                raise GrpcCallError(f"the server reset the call (RST_STREAM, error code {code})")
            elif kind in (HEADERS, CONTINUATION):
                block += _unpadded(kind, flags, payload)
                if flags & END_HEADERS:
                    self._headers(bytes(block))
                    block = bytearray()
                ended = ended or (kind == HEADERS and bool(flags & END_STREAM))  # its CONTINUATIONs follow
            elif kind == DATA:
                self.body += _unpadded(kind, flags, payload)
                if len(self.body) > self.max_bytes + 5:
                    raise GrpcCallError(f"the answer is larger than {self.max_bytes} bytes")
                ended = bool(flags & END_STREAM)
        return self._message()

    def _send(self, frame: bytes) -> None:
        """An acknowledgement: a server that closed its side may have written the whole answer already,
        and what is left to read says whether it did."""
        try:
            self.sock.sendall(frame)
        except OSError:
            pass

    def _headers(self, block: bytes) -> None:
        try:
            self.header_blocks.append(self.decoder.decode(block))
        except HpackError as exc:
            raise GrpcCallError(f"undecodable headers: {exc}") from None

    def _message(self) -> bytes:
        if not self.header_blocks:
            raise GrpcCallError("the call ended without headers")
        first, last = dict(self.header_blocks[0]), dict(self.header_blocks[-1])
        if first.get(":status") != "200":
            raise GrpcCallError(f"HTTP status {first.get(':status')}, not a gRPC answer")
        status = last.get("grpc-status")
        if status != "0":
            raise GrpcCallError(f"gRPC status {status}: {unquote(last.get('grpc-message', ''))}")
        if len(self.body) < 5 or self.body[0] != 0:
            raise GrpcCallError("the answer has no uncompressed message")
        length = struct.unpack(">I", self.body[1:5])[0]
        if len(self.body) != 5 + length:
            raise GrpcCallError(f"the answer's message is {len(self.body) - 5} bytes where its prefix says {length}")
        return bytes(self.body[5:])

    def _next_frame(self) -> tuple[int, int, int, bytes]:
        head = self._exactly(9)
        length = int.from_bytes(head[:3], "big")
        if length > MAX_FRAME or length > self.max_bytes + 1024:
            raise GrpcCallError(f"a frame of {length} bytes")
        stream = struct.unpack(">I", head[5:9])[0] & 0x7FFFFFFF
        return head[3], head[4], stream, self._exactly(length)

    def _exactly(self, count: int) -> bytes:
        while len(self.buffer) < count:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout()
            self.sock.settimeout(left)
            chunk = self.sock.recv(max(65536, count - len(self.buffer)))
            if not chunk:
                raise GrpcCallError("the server closed the connection mid-answer")
            self.buffer += chunk
        taken = bytes(self.buffer[:count])
        del self.buffer[:count]
        return taken


def _unpadded(kind: int, flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS frame's content without its padding (and a HEADERS frame's priority fields)."""
    if flags & PADDED and kind in (DATA, HEADERS):
        if not payload or payload[0] >= len(payload):
            raise GrpcCallError("a frame's padding is longer than the frame")
        payload = payload[1:len(payload) - payload[0]]
    if kind == HEADERS and flags & PRIORITY:
        payload = payload[5:]
    return payload
