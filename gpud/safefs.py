"""Directories and lock files that a hostile local user cannot redirect, as tmux and ssh-agent do it.

gpud often runs as root and creates, chowns and locks paths under directories an operator named.
A path is walked from "/" one component at a time with O_NOFOLLOW, so a symlink planted on the
way is refused rather than followed, and ownership changes go through the opened descriptor, so
they land on the directory that was checked."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path gpud will not use: someone else owns it or can change it, or it is a planted symlink."""


class InUse(OSError):
    """Another gpud holds the lock."""


def secure_directory(path: Path, mode: int, owner: tuple[int, int] | None = None, *,
                     own_existing: bool = True) -> bool:
    """Makes `path` a directory that only gpud (or root) controls, creating what is missing with
    `mode`; returns whether it created the last directory. Every directory on the way must be owned
    by root or gpud's user and be writable by no one else, except sticky directories such as /tmp,
    where no one can rename another's entries. The last directory must be writable by its owner
    only; `owner` (uid, gid), where given, is given to it through its descriptor (an existing one is
    already owned by that uid, or by us). With own_existing=False an existing last directory keeps
    its owner and mode: one that systemd manages (RuntimeDirectory=) is put back, recursively, by
    systemd whenever its owner differs from the unit's.
    A symlink on the way is followed only when root or gpud's user made it in a directory no one
    else can write (the operator's /var/run -> /run), never one that another user could plant."""
    names = list((Path.cwd() / path).parts[1:])  # ".." kept: it is resolved on the way, not by spelling
    where, fd, symlinks = Path("/"), os.open("/", _DIRECTORY_FLAGS), 0
    created = False
    try:
        while names:
            name = names.pop(0)
            last = not names
            if name == ".." and not last:
                child = os.open("..", _DIRECTORY_FLAGS, dir_fd=fd)
                os.close(fd)
                where, fd = where.parent, child
                continue
            try:
                os.mkdir(name, mode if last else 0o755, dir_fd=fd)
                created = True
            except FileExistsError:
                created = False
            try:
                child = os.open(name, _DIRECTORY_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                symlinks += 1
                target = _trusted_symlink_target(fd, where, name, symlinks)
                names = list((where / target).parts[1:]) + names
                os.close(fd)
                where, fd = Path("/"), os.open("/", _DIRECTORY_FLAGS)
                continue
            os.close(fd)
            where, fd = where / name, child
            if created:  # the umask may have taken bits the mode (0755 on the way) asked for
                os.fchmod(fd, mode if last else 0o755)
            _check_directory(os.fstat(fd), where, last, owner[0] if owner else None)
        if owner is not None and (created or own_existing):
            os.fchown(fd, *owner)
        return created
    finally:
        os.close(fd)


def _trusted_symlink_target(parent_fd: int, parent: Path, name: str, symlinks_so_far: int) -> str:
    info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if not stat.S_ISLNK(info.st_mode):
        raise UnsafePath(f"{parent / name} is not a directory")
    if symlinks_so_far > 40:
        raise UnsafePath(f"{parent / name}: too many levels of symlinks")
    parent_info = os.fstat(parent_fd)
    if info.st_uid not in (0, os.geteuid()) or parent_info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePath(f"{parent / name} is a symlink that another user could have made or changed "
                         f"(it is owned by uid {info.st_uid}, in a directory of mode "
                         f"{stat.S_IMODE(parent_info.st_mode):04o}): gpud does not follow it")
    return os.readlink(name, dir_fd=parent_fd)


def _check_directory(info: os.stat_result, where: Path, last: bool, owner_uid: int | None) -> None:
    trusted = {0, os.geteuid()} | ({owner_uid} if last and owner_uid is not None else set())
    if info.st_uid not in trusted:
        raise UnsafePath(f"{where} is owned by uid {info.st_uid}, not by root or gpud's user (uid {os.geteuid()}): "
                         "gpud does not use it")
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if last and writable_by_others:
        raise UnsafePath(f"{where} is writable by users other than its owner (mode {stat.S_IMODE(info.st_mode):04o}): "
                         "gpud does not use it")
    if not last and info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise UnsafePath(f"{where} is writable by everyone and not sticky (mode {stat.S_IMODE(info.st_mode):04o}): "
                         "gpud does not use what is under it")


def hold_lock(path: Path, holder: str) -> int:
    """Takes the exclusive lock `path` for gpud's whole life and returns its descriptor. The file is
    never reached through a symlink and must be gpud's own. `holder` says what the lock guards, for
    the refusal: "another gpud {holder} (it holds {path})"."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symlink: gpud does not follow it") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise UnsafePath(f"{path} is not a regular file owned by gpud's user (uid {os.geteuid()}): "
                             "gpud does not use it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InUse(f"another gpud {holder} (it holds {path})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def claim_directory(path: Path, what: str) -> int:
    """Makes `path` gpud's private directory (0700 when new) and locks it for gpud's whole life, so
    two gpuds never write the same files; returns the lock's descriptor."""
    secure_directory(path, 0o700)
    return hold_lock(path / "gpud.lock", f"uses {what} {path}")
