"""Reading the host's sysfs and procfs files without trusting what is at the name.

A sysfs attribute or procfs file is a regular file (stat says S_IFREG) whose content the kernel makes
at read time, at most a page for a sysfs attribute (Linux Documentation/filesystems/sysfs.rst). A
FIFO or a device put at such a name (a test tree, a bind mount, a container's sysfs) would block a
plain open() or read() forever, or feed it without end: every read here is non-blocking, of a
regular file only, and bounded.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

SYSFS_ATTRIBUTE_BYTES = 4096  # a page: the most a sysfs attribute's show() writes
PROC_LIST_BYTES = 4 << 20  # /proc/modules, /proc/stat, a process's cgroup, cmdline or environ
PROC_MAPS_BYTES = 64 << 20  # /proc/self/maps: a line per mapping, some 100 bytes each


class NotARegularFile(OSError):
    """A host file that is a FIFO, a device, a socket or a directory where a regular file belongs."""


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def kind_of(mode: int) -> str:
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


def read_host_file(path: Path | str, limit: int = SYSFS_ATTRIBUTE_BYTES) -> bytes:
    """At most `limit` bytes of a regular file, following the links sysfs is made of; OSError where it
    cannot be read, NotARegularFile where something else is at the name (refused before any read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(errno.EINVAL, f"{kind_of(mode)}, not a regular file", str(path))
        return read_up_to(fd, limit)
    finally:
        os.close(fd)


def read_up_to(fd: int, limit: int) -> bytes:
    """What an open file holds, up to limit bytes: read to its end or the limit, never past."""
    chunks, size = [], 0
    while size < limit and (chunk := os.read(fd, limit - size)):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def read_host_text(path: Path | str, limit: int = SYSFS_ATTRIBUTE_BYTES, *, encoding: str = "utf-8",
                   errors: str = "strict") -> str:
    """read_host_file, decoded."""
    return read_host_file(path, limit).decode(encoding, errors)
