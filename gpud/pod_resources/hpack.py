"""HPACK (RFC 7541), as much as a gRPC client needs: header blocks decoded whole (static and dynamic
table, Huffman-coded strings, size updates), and request headers encoded as literals that touch no table.

The Huffman code is canonical (RFC 7541 Appendix B: codes of one length are consecutive, in symbol order,
each length's first code following the last of the shorter length), so the code lengths alone define it.
"""

from __future__ import annotations


class HpackError(ValueError):
    """A header block that does not decode (RFC 7541 calls this a decoding error: COMPRESSION_ERROR)."""


# RFC 7541 Appendix A
STATIC_TABLE = ((":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"),
                (":path", "/index.html"), (":scheme", "http"), (":scheme", "https"), (":status", "200"),
                (":status", "204"), (":status", "206"), (":status", "304"), (":status", "400"),
                (":status", "404"), (":status", "500"), ("accept-charset", ""), ("accept-encoding", "gzip, deflate"),
                *((name, "") for name in (
                    "accept-language", "accept-ranges", "accept", "access-control-allow-origin", "age", "allow",
                    "authorization", "cache-control", "content-disposition", "content-encoding", "content-language",
                    "content-length", "content-location", "content-range", "content-type", "cookie", "date", "etag",
                    "expect", "expires", "from", "host", "if-match", "if-modified-since", "if-none-match",
                    "if-range", "if-unmodified-since", "last-modified", "link", "location", "max-forwards",
                    "proxy-authenticate", "proxy-authorization", "range", "referer", "refresh", "retry-after",
                    "server", "set-cookie", "strict-transport-security", "transfer-encoding", "user-agent", "vary",
                    "via", "www-authenticate")))

# RFC 7541 Appendix B: the code length in bits of symbols 0-255, each as chr(ord("0") + length); EOS (256) is 30
_LENGTHS = ("=GLLLLLLLHNLLNLLLLLLLLNLLLLLLLLL6::<=68;::8;8666555666666678?6<:=67777777777777777777777878=C=>6?5656566657"
            "7666567655677777?;>=LDFDDFFFGFGGGGGHGHHFGHGGGGEFGFGGHFEDFFGGEGFFHEFGGEEFEGFGGDFFFGFFGJJDCFGFIJJJKKJHICEJKKJ"
            "KHEEJJLKKKDHDEFEEGFFIIHHJGJKJJKKKKKLKKKKKJ")
EOS = 256


def _codes() -> dict[tuple[int, int], int]:
    """(length, code) -> symbol, from the canonical code's lengths."""
    lengths = [ord(c) - ord("0") for c in _LENGTHS] + [30]
    table, code, previous = {}, -1, 0
    for symbol in sorted(range(EOS + 1), key=lambda s: (lengths[s], s)):
        code = (code + 1) << (lengths[symbol] - previous)
        previous = lengths[symbol]
        table[(previous, code)] = symbol
    return table


_HUFFMAN = _codes()


def huffman_decode(data: bytes) -> bytes:
    out, code, length = bytearray(), 0, 0
    for byte in data:
        for shift in range(7, -1, -1):
            code, length = (code << 1) | ((byte >> shift) & 1), length + 1
            symbol = _HUFFMAN.get((length, code))
            if symbol is not None:
                if symbol == EOS:  # 5.2: a decoder MUST treat an EOS in the string as an error
                    raise HpackError("EOS in a Huffman-coded string")
                out.append(symbol)
                code, length = 0, 0
            elif length > 30:
                raise HpackError("no Huffman code matches")
    if length > 7 or code != (1 << length) - 1:  # 5.2: padding is fewer than 8 bits, the EOS's first (ones)
        raise HpackError("Huffman padding is not a prefix of EOS")
    return bytes(out)


class Decoder:
    """One connection's decoding context: its dynamic table lives across the header blocks."""

    def __init__(self, max_table_size: int = 4096):
        self.max_table_size = max_table_size  # SETTINGS_HEADER_TABLE_SIZE we announced (the default)
        self.table_size = max_table_size
        self.dynamic: list[tuple[str, str]] = []  # newest first

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        fields, at = [], 0
        while at < len(block):
            first = block[at]
            if first & 0x80:  # 6.1 indexed
                index, at = _integer(block, at, 7)
                fields.append(self._entry(index))
            elif first & 0x40:  # 6.2.1 with incremental indexing
                name_value, at = self._literal(block, at, 6)
                fields.append(name_value)
                self._add(*name_value)
            elif first & 0x20:  # 6.3 dynamic table size update
                size, at = _integer(block, at, 5)
                if size > self.max_table_size:
                    raise HpackError(f"table size {size} above the {self.max_table_size} allowed")
                self.table_size = size
                self._evict()
            else:  # 6.2.2 without indexing, 6.2.3 never indexed
                name_value, at = self._literal(block, at, 4)
                fields.append(name_value)
        return fields

    def _literal(self, block: bytes, at: int, prefix: int) -> tuple[tuple[str, str], int]:
        index, at = _integer(block, at, prefix)
        if index:
            name = self._entry(index)[0]
        else:
            name, at = _string(block, at)
        value, at = _string(block, at)
        return (name, value), at

    def _entry(self, index: int) -> tuple[str, str]:
        if 1 <= index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        if len(STATIC_TABLE) < index <= len(STATIC_TABLE) + len(self.dynamic):
            return self.dynamic[index - len(STATIC_TABLE) - 1]
        raise HpackError(f"no table entry {index}")

    def _add(self, name: str, value: str) -> None:
        self.dynamic.insert(0, (name, value))
        self._evict()  # 4.4: an entry larger than the table empties it

    def _evict(self) -> None:
        while self.dynamic and sum(_size(entry) for entry in self.dynamic) > self.table_size:
            self.dynamic.pop()


def _size(entry: tuple[str, str]) -> int:
    return len(entry[0].encode()) + len(entry[1].encode()) + 32  # 4.1


def _integer(block: bytes, at: int, prefix: int) -> tuple[int, int]:
    """5.1: an integer on `prefix` bits of the byte at `at`, continued in 7-bit groups."""
    if at >= len(block):
        raise HpackError("header block ends inside an integer")
    mask = (1 << prefix) - 1
    value, at = block[at] & mask, at + 1
    if value < mask:
        return value, at
    shift = 0
    while True:
        if at >= len(block) or shift > 28:
            raise HpackError("header block ends inside an integer, or it is too large")
        byte, at = block[at], at + 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _string(block: bytes, at: int) -> tuple[str, int]:
    """5.2: a string literal, Huffman-coded or not."""
    if at >= len(block):
        raise HpackError("header block ends before a string")
    huffman = bool(block[at] & 0x80)
    length, at = _integer(block, at, 7)
    if at + length > len(block):
        raise HpackError("header block ends inside a string")
    raw = block[at:at + length]
    try:
        return (huffman_decode(raw) if huffman else raw).decode("utf-8"), at + length
    except UnicodeDecodeError as exc:
        raise HpackError(f"a header is not UTF-8: {exc}") from None


def encode_literals(fields: list[tuple[str, str]]) -> bytes:
    """6.2.2 literals without indexing, new names, plain strings: no table of either side changes."""
    out = bytearray()
    for name, value in fields:
        out.append(0)
        for text in (name.encode(), value.encode()):
            out += _encode_integer(len(text), 7)
            out += text
    return bytes(out)


def _encode_integer(value: int, prefix: int) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes([value])
    out, value = bytearray([mask]), value - mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
