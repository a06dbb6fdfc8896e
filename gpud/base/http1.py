"""The HTTP/1.1 a client of gpud's socket needs: one request on a fresh connection, and its answer read
with every part bounded (the head, a chunk's size line, the body, a line of a stream).

Why not http.client: importing it takes longer than starting the interpreter (it parses headers with
the email package), and every `gpud` command and Slurm's health check before each job paid for it;
h11 takes longer still. The answers read are aiohttp's (gpud's server): a status line, headers, then a
body of Content-Length bytes, chunked (a streaming response), or up to the close (RFC 9112 section 6.3).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing's import costs what this module saves; the names are for annotations only
if TYPE_CHECKING:
    import socket
    from collections.abc import Iterator

MAX_HEAD_BYTES = 64 << 10  # aiohttp's own limit on a head it reads (8190 bytes a line, 32,768 headers)
MAX_CHUNK_LINE_BYTES = 1024
RECV_BYTES = 1 << 16
HEX_DIGITS = b"0123456789abcdefABCDEF"


class NotHttp(Exception):
    """What came back is not an HTTP/1.x answer, or ended before its body did."""


class TooLarge(Exception):
    """An answer or a line of a stream over what the caller reads."""


class Answer:
    """An answer's status and headers (names lower-case); its body is read by `body` or `lines`."""

    def __init__(self, conn: socket.socket, status: int, headers: dict[str, str], rest: bytes):
        self.status, self.headers = status, headers
        self._conn, self._buffer = conn, bytearray(rest)

    def body(self, limit: int) -> bytes:
        """The whole body; TooLarge past limit bytes (a Content-Length over it is refused unread)."""
        length = self.headers.get("content-length")
        if length is not None and _is_decimal(length.strip()) and int(length) > limit:
            raise TooLarge(f"{int(length)} bytes")
        parts, size = [], 0
        for piece in self._pieces():
            size += len(piece)
            if size > limit:
                raise TooLarge(f"over {limit} bytes")
            parts.append(piece)
        return b"".join(parts)

    def lines(self, limit: int) -> Iterator[bytes]:
        """The body's lines as they arrive, each with its newline; TooLarge for a line over limit bytes."""
        pending = bytearray()
        for piece in self._pieces():
            pending += piece
            while (end := pending.find(b"\n")) >= 0:
                if end + 1 > limit:
                    raise TooLarge(f"a line over {limit} bytes")
                yield bytes(pending[:end + 1])
                del pending[:end + 1]
            if len(pending) > limit:
                raise TooLarge(f"a line over {limit} bytes")
        if pending:
            yield bytes(pending)

    def _pieces(self) -> Iterator[bytes]:
        if self.status in (204, 304) or 100 <= self.status < 200:
            return
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            yield from self._chunks()
        elif (length := self.headers.get("content-length")) is not None:
            if not _is_decimal(length.strip()):
                raise NotHttp(f"a Content-Length of {length[:40]!r}")
            left = int(length)
            while left:
                piece = self._take(left)
                if not piece:
                    raise NotHttp(f"the connection closed {left} bytes before the body's end")
                left -= len(piece)
                yield piece
        else:
            while piece := self._take(RECV_BYTES):
                yield piece

    def _chunks(self) -> Iterator[bytes]:
        while True:
            size_line = self._line(MAX_CHUNK_LINE_BYTES, "a chunk's size line")
            size_text = size_line.split(b";", 1)[0].strip()
            # hex digits only (RFC 9112 section 7.1): int(..., 16) also takes a sign, "0x" and "_"
            if not size_text or size_text.translate(None, HEX_DIGITS):
                raise NotHttp(f"a chunk size of {size_text[:40]!r}")
            left = int(size_text, 16)
            if left == 0:  # the trailer section: read and dropped, bounded as a head is
                trailers = 0
                while (line := self._line(MAX_HEAD_BYTES, "a trailer line")).strip():
                    trailers += len(line)
                    if trailers > MAX_HEAD_BYTES:
                        raise NotHttp(f"a trailer section over {MAX_HEAD_BYTES} bytes")
                return
            while left:
                piece = self._take(left)
                if not piece:
                    raise NotHttp("the connection closed inside a chunk")
                left -= len(piece)
                yield piece
            if self._line(MAX_CHUNK_LINE_BYTES, "a chunk's end").strip():
                raise NotHttp("a chunk longer than its size")

    def _take(self, most: int) -> bytes:
        """Up to `most` bytes: buffered ones first, else one read (b"" at the close)."""
        if not self._buffer and not self._fill():
            return b""
        piece = bytes(self._buffer[:most])
        del self._buffer[:most]
        return piece

    def _line(self, limit: int, what: str) -> bytes:
        while (end := self._buffer.find(b"\n", 0, limit)) < 0:
            if len(self._buffer) >= limit:
                raise NotHttp(f"{what} over {limit} bytes")
            if not self._fill():
                raise NotHttp(f"the connection closed inside {what}")
        line = bytes(self._buffer[:end + 1])
        del self._buffer[:end + 1]
        return line

    def _fill(self) -> bool:
        data = self._conn.recv(RECV_BYTES)
        self._buffer += data
        return bool(data)


def exchange(conn: socket.socket, method: str, path: str, body: bytes | None = None,
             content_type: str = "application/json") -> Answer:
    """Sends one request (the connection is closed after the answer: one request a connection) and
    reads the answer's head."""
    head = [f"{method} {path} HTTP/1.1", "Host: localhost", "Connection: close"]
    if body is not None:
        head += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    conn.sendall("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + (body or b""))
    received = bytearray()
    while (end := received.find(b"\r\n\r\n")) < 0:
        if len(received) > MAX_HEAD_BYTES:
            raise NotHttp(f"an answer's head over {MAX_HEAD_BYTES} bytes")
        data = conn.recv(RECV_BYTES)
        if not data:
            raise NotHttp("the connection closed before a whole answer's head" if received
                          else "the connection closed without an answer")
        received += data
    status_line, *header_lines = bytes(received[:end]).decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    status_text = rest[:3]
    if not version.startswith("HTTP/1.") or not _is_decimal(status_text) or rest[3:4] not in ("", " "):
        raise NotHttp(f"a status line of {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise NotHttp(f"a header line of {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return Answer(conn, int(status_text), headers, bytes(received[end + 4:]))


def _is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes the superscripts of the latin-1 the head is decoded as
    ("\u00b2"), which int() refuses."""
    return text.isascii() and text.isdigit()
