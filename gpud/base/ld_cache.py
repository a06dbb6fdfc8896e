"""glibc's linker cache (/etc/ld.so.cache), read and written in the layout of glibc's
sysdeps/generic/dl-cache.h: the new format (the only one since glibc 2.32; before, it followed the old
table), whose 64-bit entries of this machine are the ones read here.

Written by gpud for a simulated node's driver tree, since making it with `ldconfig -r ROOT` needs root
(ldconfig chroots into ROOT)."""

from __future__ import annotations

import functools
import os
import platform
import struct
import sys
from pathlib import Path

_OLD_MAGIC, _NEW_MAGIC = b"ld.so-1.7.0", b"glibc-ld.so.cache1.1"
# magic+version, nlibs, len_strings, flags (endianness), 3 padding bytes, extension_offset, 3 unused:
# 48 bytes in all
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")
_NEW_ENTRY = struct.Struct("<iIIIQ")  # flags, key, value, osversion (unused), hwcap
# FLAG_ELF_LIBC6 | FLAG_X8664_LIB64, FLAG_ELF_LIBC6 | FLAG_AARCH64_LIB64: what ldconfig records for
# every 64-bit library of these machines (sysdeps/unix/sysv/linux/{x86_64,aarch64}/readelflib.c)
_LIB64_FLAGS = {"x86_64": 0x0303, "aarch64": 0x0a03}
_ENDIAN_FLAGS = {"little": 2, "big": 3}  # cache_file_new_flags_endian_little, _big
_DIGITS = "0123456789"


def read_ld_cache(path: Path) -> list[tuple[str, str]]:
    """(soname, path) of each 64-bit library of this machine in an ld.so.cache; [] if unreadable."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    start = 0
    if data.startswith(_OLD_MAGIC):  # the old table first: 16-byte header, 12-byte entries, then aligned
        (old_count,) = struct.unpack_from("<I", data, 12)
        start = (16 + old_count * 12 + 7) & ~7
    if data[start:start + len(_NEW_MAGIC)] != _NEW_MAGIC:
        return []
    wanted = _LIB64_FLAGS.get(platform.machine())
    entries = []
    try:
        _, count, _, _, _ = _NEW_HEADER.unpack_from(data, start)
        for index in range(count):
            flags, key, value, _, _ = _NEW_ENTRY.unpack_from(data, start + _NEW_HEADER.size + index * _NEW_ENTRY.size)
            if flags == wanted:  # string offsets count from the new header
                entries.append((_string(data, start + key), _string(data, start + value)))
    except (struct.error, ValueError):  # cut short or corrupt: ld.so ignores such a cache too
        return []
    return entries


def write_ld_cache(path: Path, libraries: list[tuple[str, str]]) -> None:
    """Writes a new-format cache of 64-bit libraries of this machine, (soname, path) each, in the order
    ldconfig writes them (cache.c compare: sonames by _dl_cache_libcmp, descending), which ld.so's
    binary search relies on."""
    flags = _LIB64_FLAGS[platform.machine()]
    ordered = sorted(libraries, key=functools.cmp_to_key(lambda first, second: _libcmp(second[0], first[0])))
    strings = bytearray()
    offsets = {}
    strings_start = _NEW_HEADER.size + len(ordered) * _NEW_ENTRY.size
    for text in dict.fromkeys(text for entry in ordered for text in entry):
        offsets[text] = strings_start + len(strings)
        strings += text.encode() + b"\0"
    header = _NEW_HEADER.pack(_NEW_MAGIC, len(ordered), len(strings), _ENDIAN_FLAGS[sys.byteorder], 0)
    entries = b"".join(_NEW_ENTRY.pack(flags, offsets[soname], offsets[target], 0, 0) for soname, target in ordered)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(header + entries + strings)
    os.replace(partial, path)


def _libcmp(first: str, second: str) -> int:
    """glibc's _dl_cache_libcmp (elf/dl-cache.c): runs of digits compare as numbers, and sort after
    anything else."""
    i = j = 0
    while i < len(first):
        if first[i] in _DIGITS:
            if j >= len(second) or second[j] not in _DIGITS:
                return 1
            start_i, start_j = i, j
            while i < len(first) and first[i] in _DIGITS:
                i += 1
            while j < len(second) and second[j] in _DIGITS:
                j += 1
            difference = int(first[start_i:i]) - int(second[start_j:j])
            if difference:
                return difference
        elif j < len(second) and second[j] in _DIGITS:
            return -1
        elif j >= len(second) or first[i] != second[j]:
            return ord(first[i]) - (ord(second[j]) if j < len(second) else 0)
        else:
            i += 1
            j += 1
    return 0 - (ord(second[j]) if j < len(second) else 0)


def _string(data: bytes, offset: int) -> str:
    return data[offset:data.index(b"\0", offset)].decode("utf-8", "replace")
