"""Durable files: what gpud persists survives a crash at any instant, whole or not at all."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from gpud.base.errors import ErrorKind, GpudError
from gpud.base.logs import get_logger

log = get_logger("persist")
T = TypeVar("T")


def write_json_atomic(path: Path, document: Any, *, durable: bool = True) -> None:
    """The document as indented JSON, written as write_text_atomic writes."""
    write_text_atomic(path, json.dumps(document, indent=2) + "\n", durable=durable)


def write_text_atomic(path: Path, text: str, *, durable: bool = True, mode: int | None = None) -> None:
    """Writes to a hidden temporary file beside path, fsyncs it, renames it over the old one and
    fsyncs the directory: a reader (or gpud after a crash) finds the old file or the new one, never a
    mix. mode: the file's permissions, set before the rename (default: mkstemp's 0600).

    durable=False skips both fsyncs: the rename alone keeps the file whole across a killed
    process, which is all a file needs that no power loss can reach (the simulator's state)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            if mode is not None:
                os.fchmod(file.fileno(), mode)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    if not durable:
        return
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # makes the rename itself durable
    finally:
        os.close(directory)


@dataclass(frozen=True)
class CorruptFile:
    """A persisted file gpud could not read back: moved aside for the operator, started empty without it."""

    path: Path
    kept_as: Path | None  # None when even moving it aside failed
    error: str

    def message(self) -> str:
        kept = f"kept as {self.kept_as}" if self.kept_as else "could not be moved aside"
        return f"{self.path} is corrupt ({self.error}); {kept}; gpud started without it"


def read_json(path: Path, parse: Callable[[Any], T]) -> tuple[T | None, CorruptFile | None]:
    """The document in path, as parse makes it: (None, None) when there is no file. A file that is not
    JSON, or that parse refuses (ValueError, TypeError, KeyError, AttributeError), is never read as
    empty in silence: it is logged, renamed to <name>.corrupt and returned as a CorruptFile, for the
    caller to report (/healthz) while it starts without it."""
    try:
        # never through a symlink: the state directory is gpud's alone (safefs), so one found there
        # is a plant, reported (ELOOP) rather than read
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as file:
            text = file.read()
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, _set_aside(path, f"unreadable: {exc.strerror or exc}", move=False)
    try:
        return parse(json.loads(text)), None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return None, _set_aside(path, f"{type(exc).__name__}: {exc}", move=True)


def _set_aside(path: Path, error: str, move: bool) -> CorruptFile:
    kept_as = path.with_name(path.name + ".corrupt") if move else None
    if kept_as is not None:
        try:
            os.replace(path, kept_as)
        except OSError:
            kept_as = None
    corrupt = CorruptFile(path, kept_as, error)
    log.error("state_file_corrupt", path=str(path), kept_as=str(kept_as) if kept_as else None, error=error,
              consequence="gpud starts without what this file held")
    return corrupt


def write_failed(path: Path, exc: OSError, what: str) -> GpudError:
    """The refusal to answer when `what` could not be saved: disk-full when the disk is full, else failed."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    reason = "the disk is full" if full else (exc.strerror or str(exc))
    return GpudError(ErrorKind.DISK_FULL if full else ErrorKind.FAILED, "state-not-saved",
                     f"could not save {what} to {path}: {reason}; nothing was changed", path=str(path))
