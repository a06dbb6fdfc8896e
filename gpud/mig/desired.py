"""The desired MIG layout as persisted in mig-desired.json: what gpud converges the GPUs to at start.

A file that cannot be read is set aside for the operator and said loudly (/v1/mig, /healthz, the
STATUS line); gpud then applies no layout of its own (not even mig.default_layout) until one is
chosen through the API. A layout is saved together with the one it replaces, so an apply its
pre_apply hook refuses goes back to that one, also across a restart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from gpud.base.logs import get_logger
from gpud.base.persist import read_json, write_failed, write_json_atomic

log = get_logger("mig")


@dataclass(frozen=True)
class GpuDesired:
    mig_enabled: bool
    devices: dict[str, int]

    def as_dict(self) -> dict:
        return {"mig_enabled": self.mig_enabled, "devices": dict(sorted(self.devices.items()))}


@dataclass(frozen=True)
class Desired:
    layout: str | None = None
    source: str | None = None  # "api" | "default_layout"; None: no layout was ever chosen
    force: bool = False
    gpus: dict[str, GpuDesired] | None = None  # GPU UUID -> what the layout wants of it
    # Where the layout is defined: the layouts file's path, "builtin", or "request" (a file sent with
    # PUT /v1/mig). gpus holds all that converging needs, so a layout no file has converges too.
    origin: str | None = None

    def document(self) -> dict:
        return {"layout": self.layout, "source": self.source, "origin": self.origin, "force": self.force,
                "requested_at": time.time(), "gpus": {uuid: d.as_dict() for uuid, d in (self.gpus or {}).items()}}


NOTHING = Desired()


def _parse(document: object) -> Desired:
    if not isinstance(document, dict):
        raise TypeError(f"a JSON object was expected, got {type(document).__name__}")
    gpus = {str(uuid): GpuDesired(bool(d["mig_enabled"]), {str(k): int(v) for k, v in d["devices"].items()})
            for uuid, d in document["gpus"].items()}
    origin = document.get("origin")  # absent from files written before gpud recorded it
    return Desired(document.get("layout"), document.get("source"), bool(document.get("force", False)), gpus,
                   origin if isinstance(origin, str) else None)


def _previous(document: dict) -> dict | None:
    """The document a saved layout replaced, checked now: taking it back must not fail on it later."""
    previous = document.get("previous")
    if previous is not None:
        _parse(previous)
    return previous


class DesiredStore:
    """mig-desired.json and the layout chosen now: load, save (refusing loudly when the disk will not
    take it) and take back. The MIG apply, and the restore after any GPU reset, converge on `chosen`."""

    def __init__(self, path: Path):
        self.path = path
        self.chosen: Desired = NOTHING
        self.problem: str | None = None  # what went wrong reading the file, until a layout is chosen again
        self._previous: dict | None = None  # the document a saved layout replaced (None: there was none)

    def load(self) -> Desired:
        parsed, corrupt = read_json(self.path, lambda document: (_parse(document), _previous(document)))
        if corrupt is not None:
            self.problem = (f"{corrupt.message()}: no MIG layout is applied, mig.default_layout included, "
                            "until one is chosen with PUT /v1/mig")
        if parsed is not None:
            self.chosen, self._previous = parsed
        return self.chosen

    def save(self, desired: Desired) -> None:
        """Saves desired, the layout chosen now, with the one it replaces. Raises GpudError (disk-full when
        the disk is full) having changed nothing."""
        previous = self.chosen.document() if self.chosen.gpus is not None else None
        try:
            write_json_atomic(self.path, {**desired.document(), "previous": previous})
        except OSError as exc:
            log.error("mig_desired_not_saved", path=str(self.path), error=str(exc))
            raise write_failed(self.path, exc, "the desired MIG layout") from None
        self._previous = previous
        self.problem = None
        self.chosen = desired

    def take_back(self) -> Desired:
        """The saved layout is withdrawn (its pre_apply hook refused it): the one it replaced is the
        desired layout again, on disk too, so the next start does not resume the refused one."""
        previous = self._previous
        try:
            if previous is None:
                self.path.unlink(missing_ok=True)
            else:
                write_json_atomic(self.path, {**previous, "previous": None})
        except OSError as exc:
            self.problem = (f"the refused layout could not be withdrawn from {self.path} "
                            f"({exc.strerror or exc}): remove the file before gpud starts again")
            log.error("mig_desired_not_taken_back", path=str(self.path), error=str(exc))
        self._previous = None
        self.chosen = _parse(previous) if previous is not None else NOTHING
        return self.chosen
