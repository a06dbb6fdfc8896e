"""Directories and lock files that a hostile local user cannot redirect, as tmux and ssh-agent do it.

gpud often runs as root and creates, chowns and locks paths under directories an operator named.
A path is walked from "/" one component at a time with O_NOFOLLOW, so a symlink planted on the
way is refused rather than followed, and ownership changes go through the opened descriptor, so
they land on the directory that was checked."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import secrets
import stat
from pathlib import Path

from gpud.base.hostfile import read_up_to
from gpud.base.lifecycle import Component, Tasks

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path gpud will not use: someone else owns it or can change it, or it is a planted symlink."""


class InUse(OSError):
    """Another gpud holds the lock."""


def secure_directory(path: Path, mode: int, owner: tuple[int, int] | None = None, *,
                     own_existing: bool = True) -> bool:
    """Makes `path` a directory that only gpud (or root) controls, as open_secure_directory does;
    returns whether it created the last directory. With own_existing=False an existing last
    directory keeps its owner and mode: one that systemd manages (RuntimeDirectory=) is put back,
    recursively, by systemd whenever its owner differs from the unit's."""
    fd, created = _open_secure_directory(path, mode, owner, create=True, own_existing=own_existing)
    os.close(fd)
    return created


def open_secure_directory(path: Path, mode: int, owner: tuple[int, int] | None = None, *,
                          create: bool = True) -> int:
    """Makes `path` a directory that only gpud (or root) controls, creating what is missing with
    `mode`, and returns its open descriptor (the caller closes it), so what is done in it next is
    done in the directory checked. Every directory on the way must be owned by root or gpud's user
    and be writable by no one else, except sticky directories such as /tmp, where no one can rename
    another's entries. The last directory must be writable by its owner only; `owner` (uid, gid),
    where given, is given to it through its descriptor (an existing one is already owned by that
    uid, or by us). A symlink on the way is followed only when root or gpud's user made it in a
    directory no one else can write (the operator's /var/run -> /run), never one that another user
    could plant. create=False: nothing is made, a missing directory is FileNotFoundError."""
    return _open_secure_directory(path, mode, owner, create=create, own_existing=True)[0]


def _open_secure_directory(path: Path, mode: int, owner: tuple[int, int] | None, *, create: bool,
                           own_existing: bool) -> tuple[int, bool]:
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
            created = False
            if create:
                try:
                    os.mkdir(name, mode if last else 0o755, dir_fd=fd)
                    created = True
                except FileExistsError:
                    pass
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
    except BaseException:
        os.close(fd)
        raise
    return fd, created


def check_trusted_file(path: Path, what: str) -> None:
    """Raises UnsafePath, naming `what` (a kubeconfig, the CA it names, ...), the file or directory at
    fault, its owner and mode, unless the file is a regular file root or gpud's user owns and no one
    else can write, in a directory that is the same, on a way of directories open_secure_directory
    trusts. A symlink is followed only where root or gpud's user made it in a directory no one else
    can write. A file another user controls is one they can make gpud read what they like: an API
    server of their choosing, or a credential plugin gpud would run as itself."""
    path = Path.cwd() / path
    for symlinks in range(41):
        try:
            fd = open_secure_directory(path.parent, 0o755, create=False)
        except UnsafePath as exc:
            raise UnsafePath(f"{what} {path}: {exc}") from None
        try:
            info = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISLNK(info.st_mode):
                break
            try:
                path = path.parent / _trusted_symlink_target(fd, path.parent, path.name, symlinks)
            except UnsafePath as exc:
                raise UnsafePath(f"{what}: {exc}") from None
        finally:
            os.close(fd)
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafePath(f"{what} {path} is not a regular file (mode {stat.filemode(info.st_mode)})")
    if info.st_uid not in (0, os.geteuid()):
        raise UnsafePath(f"{what} {path} is owned by {_user(info.st_uid)} (mode {mode:04o}), not by root or "
                         f"gpud's user (uid {os.geteuid()}): gpud does not use it; give it to root "
                         f"(chown root: {path}) or name another file")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePath(f"{what} {path} is writable by users other than its owner {_user(info.st_uid)} "
                         f"(mode {mode:04o}): gpud does not use it; chmod go-w {path}")


def _trusted_symlink_target(parent_fd: int, parent: Path, name: str, symlinks_so_far: int) -> str:
    info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if not stat.S_ISLNK(info.st_mode):
        raise UnsafePath(f"{parent / name} is not a directory")
    if symlinks_so_far > 40:
        raise UnsafePath(f"{parent / name}: too many levels of symlinks")
    parent_info = os.fstat(parent_fd)
    if info.st_uid not in (0, os.geteuid()) or parent_info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePath(f"{parent / name} is a symlink that another user could have made or changed "
                         f"(it is owned by {_user(info.st_uid)}, in a directory of mode "
                         f"{stat.S_IMODE(parent_info.st_mode):04o}): gpud does not follow it; remove it, "
                         "or name the real directory in gpud's config")
    return os.readlink(name, dir_fd=parent_fd)


def _check_directory(info: os.stat_result, where: Path, last: bool, owner_uid: int | None) -> None:
    trusted = {0, os.geteuid()} | ({owner_uid} if last and owner_uid is not None else set())
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid not in trusted:
        raise UnsafePath(f"{where} is owned by {_user(info.st_uid)} (mode {mode:04o}), not by root or gpud's user "
                         f"(uid {os.geteuid()}): gpud does not use it; give it to root (chown root: {where}) "
                         "or name another directory in gpud's config")
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if last and writable_by_others:
        raise UnsafePath(f"{where} is writable by users other than its owner {_user(info.st_uid)} (mode {mode:04o}): "
                         f"gpud does not use it; make it writable by its owner only (chmod go-w {where})")
    if not last and info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise UnsafePath(f"{where} is writable by everyone and not sticky (mode {mode:04o}, owner "
                         f"{_user(info.st_uid)}): gpud does not use what is under it; chmod o-w {where}")


def _user(uid: int) -> str:
    """"uid 1001 (alice)", for messages that name who owns something."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


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


class StateDirectory(Component):
    """gpud's private directory (0700 when new), locked for gpud's whole life so two gpuds never write the
    same files: started before any component reads or writes its state there."""

    name = "state-directory"

    def __init__(self, path: Path):
        self.path = path
        self._lock: int | None = None

    async def start(self, tasks: Tasks) -> None:
        secure_directory(self.path, 0o700)
        try:
            self._lock = hold_lock(self.path / "gpud.lock", f"uses the state directory {self.path}")
        except InUse as exc:
            raise InUse(f"{exc}: give this gpud a state directory of its own with --state-dir DIR (state_dir "
                        "in its config)") from None

    async def stop(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


_ABSENT = "absent"  # KeptFile: gpud removed the file and keeps it away


class KeptFile:
    """A file gpud keeps at `path` for others to read (the CDI spec, NFD's feature file), in a
    directory that only root or gpud's user controls: the directory is checked as
    open_secure_directory checks it on every write, removal and comparison, and everything is done
    through its descriptor. A write goes to a fresh hidden temporary file (O_EXCL, O_NOFOLLOW) that
    is renamed over the old one, so a reader sees the old file or the new one and a link at the name
    is replaced, never followed. changed() compares the file with what gpud last wrote (or removed),
    so a change made behind gpud's back is noticed and can be undone."""

    def __init__(self, path: Path, mode: int, *, directory_mode: int = 0o755, create_directory: bool = True):
        self.path = path
        self._mode = mode
        self._directory_mode = directory_mode
        self._create_directory = create_directory
        # what gpud left there: (identity, content) as written, _ABSENT once removed, None before either
        self._kept: tuple[tuple, bytes] | str | None = None

    def _open_directory(self) -> int:
        return open_secure_directory(self.path.parent, self._directory_mode, create=self._create_directory)

    def write(self, data: bytes) -> None:
        directory = self._open_directory()
        try:
            temporary = f".{self.path.name}.{secrets.token_hex(6)}.tmp"
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         self._mode, dir_fd=directory)
            try:
                try:
                    os.fchmod(fd, self._mode)  # the umask may have taken bits
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                    os.rename(temporary, self.path.name, src_dir_fd=directory, dst_dir_fd=directory)
                except BaseException:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(temporary, dir_fd=directory)
                    raise
                written = os.fstat(fd)  # after the rename, which changes its ctime
            finally:
                os.close(fd)
            os.fsync(directory)  # makes the rename itself durable
            self._kept = (_identity(written), data)
        finally:
            os.close(directory)

    def remove(self) -> bool:
        """Removes the file (a link at its name: the link); False when there was none."""
        directory = self._open_directory()
        try:
            try:
                os.unlink(self.path.name, dir_fd=directory)
                removed = True
            except FileNotFoundError:
                removed = False
            self._kept = _ABSENT
            return removed
        finally:
            os.close(directory)

    def read_head(self, size: int) -> bytes | None:
        """The first `size` bytes of the file, never through a link; None when there is no regular file."""
        directory = self._open_directory()
        try:
            return _read_regular(directory, self.path.name, size)
        finally:
            os.close(directory)

    def changed(self) -> str | None:
        """How the file differs from what gpud last wrote or removed, in words; None when it does not
        (or gpud has done neither yet). Costs a walk to the directory, a stat and, when the stat is as
        gpud left it, one read of the file (timestamps are coarse: an edit in the same tick keeps them)."""
        if self._kept is None:
            return None
        directory = self._open_directory()
        try:
            try:
                info = os.stat(self.path.name, dir_fd=directory, follow_symlinks=False)
            except FileNotFoundError:
                return None if self._kept == _ABSENT else "it was removed"
            if stat.S_ISLNK(info.st_mode):
                target = os.readlink(self.path.name, dir_fd=directory)
                return f"it was replaced by a symlink to {target} ({_owner_and_mode(info)})"
            if self._kept == _ABSENT:
                return f"a file appeared where gpud keeps none ({_owner_and_mode(info)})"
            identity, data = self._kept
            if not stat.S_ISREG(info.st_mode):
                return f"it was replaced by something that is not a regular file ({_owner_and_mode(info)})"
            now = _identity(info)
            if now[:2] != identity[:2]:
                return f"it was replaced by another file ({_owner_and_mode(info)})"
            if now[2:4] != identity[2:4]:
                return f"its owner changed ({_owner_and_mode(info)})"
            if now[4] != identity[4]:
                return f"its mode changed from {stat.S_IMODE(identity[4]):04o} to {stat.S_IMODE(now[4]):04o}"
            if now != identity or _read_regular(directory, self.path.name, len(data) + 1) != data:
                return f"its content was changed ({_owner_and_mode(info)})"
            return None
        finally:
            os.close(directory)


def _owner_and_mode(info: os.stat_result) -> str:
    return f"owner {_user(info.st_uid)}, mode {stat.S_IMODE(info.st_mode):04o}"


def _identity(info: os.stat_result) -> tuple:
    """What any change to a file changes: which file it is, its owner, mode, size and times."""
    return (info.st_dev, info.st_ino, info.st_uid, info.st_gid, info.st_mode, info.st_size, info.st_mtime_ns,
            info.st_ctime_ns)


def _read_regular(directory: int, name: str, size: int) -> bytes | None:
    try:  # O_NONBLOCK: a FIFO at the name does not hang gpud
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return read_up_to(fd, size)
    finally:
        os.close(fd)
