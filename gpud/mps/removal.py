"""Ending the MPS control daemons gpud leaves running (KillMode=process): `gpud mps quit-all`, which the
packages' preremove runs as root when gpud itself is removed, and an operator runs after a gpud of
their own (the README's root gpud). A pipe directory whose daemon is gone already is passed over.

A pipe directory is mps.user's (gpud gives it to that user), so whatever is in it may have been put
there by that user: a symlink in place of the control socket, or one where the MPS client writes.
Each pipe directory is walked with safefs's checks first (real directories owned by root or gpud,
the pipe directory itself by root or mps.user, none writable by anyone else), and the MPS client
then runs as the pipe directory's owner: it can reach nothing that owner could not already."""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from gpud.base.safefs import UnsafePath, secure_directory
from gpud.mps.control import MpsControl, MpsDirectories, MpsError


NO_DAEMON = "Cannot find MPS control daemon process"  # nvidia-cuda-mps-control, quit with no daemon running


@dataclass(frozen=True)
class QuitOutcome:
    name: str  # the daemon's directory under the pipe root
    refused: str | None  # why it was not told to quit; None once it quit, or when none ran
    was_running: bool = True  # False: its daemon had gone already, only the directory (and socket) stayed


async def quit_all(pipe_root: Path, log_root: Path, binary: str, user: str | None) -> list[QuitOutcome]:
    """Tells the control daemon behind each <pipe_root>/<name>/pipe/control to quit and waits for it,
    where the checks above pass; `user` is mps.user (None: root's daemons only)."""
    try:
        names = sorted(entry.name for entry in os.scandir(pipe_root) if entry.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []
    owner = _owner(user)
    outcomes = []
    for name in names:
        pipe = pipe_root / name / "pipe"
        try:
            if not stat.S_ISDIR(os.lstat(pipe).st_mode):  # checked before secure_directory, which would make it
                raise UnsafePath(f"{pipe} is not a directory")
            secure_directory(pipe, 0o755, owner, own_existing=False)
            if not stat.S_ISSOCK(os.lstat(pipe / "control").st_mode):
                raise UnsafePath(f"{pipe / 'control'} is not a socket")
        except FileNotFoundError:
            continue  # no daemon was ever started there, or it is gone
        except UnsafePath as exc:
            outcomes.append(QuitOutcome(name, str(exc)))
            continue
        as_user = user if owner is not None and os.lstat(pipe).st_uid == owner[0] != 0 else None
        control = MpsControl(binary, MpsDirectories(pipe=pipe, log=log_root / name), (), user=as_user)
        try:
            await control.quit()
        except MpsError as exc:
            # The control binary's own answer where no daemon listens on the directory's socket: asked
            # every time rather than judged beforehand, so that no running daemon is ever passed over.
            gone = NO_DAEMON in str(exc)
            outcomes.append(QuitOutcome(name, None if gone else str(exc), was_running=not gone))
            continue
        outcomes.append(QuitOutcome(name, None))
    return outcomes


def _owner(user: str | None) -> tuple[int, int] | None:
    if not user:
        return None
    try:
        entry = pwd.getpwnam(user)
    except KeyError:  # `gpud mps quit-all` says so: only pipe directories owned by root are acted on
        return None
    return entry.pw_uid, entry.pw_gid
