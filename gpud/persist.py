"""Durable files: what gpud persists survives a crash at any instant, whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, document: Any, *, durable: bool = True) -> None:
    """Writes to a temporary file, fsyncs it, renames it over the old one and fsyncs the directory:
    a reader (or gpud after a crash) finds the old document or the new one, never a mix.

    durable=False skips both fsyncs: the rename alone keeps the file whole across a killed
    process, which is all a file needs that no power loss can reach (the simulator's state)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(document, file, indent=2)
            file.write("\n")
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
