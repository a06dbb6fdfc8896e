"""The last MIG applies, newest first, as /v1/mig lists them: kept in mig-history.json across restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile, read_json, write_json_atomic
from gpud.mig.status import ApplyStatus

log = get_logger("mig")
HISTORY_KEPT = 20  # the last applies /v1/mig lists (newest first), kept across restarts


class ApplyHistory:
    def __init__(self, path: Path):
        self._path = path
        self.corrupt_files: list[CorruptFile] = []
        self.entries: list[dict] = []  # replaced, never changed in place: a write in progress keeps its list
        # Serialises the history's own writes (it changes no GPU): an older list never lands after a newer one.
        self._written = asyncio.Lock()

    def load(self) -> None:
        """Reads back the applies before this start (a corrupt file is set aside and reported)."""
        entries, corrupt = read_json(self._path, _history_from)
        self.corrupt_files = [corrupt] if corrupt else []
        self.entries = entries or []

    def add(self, status: ApplyStatus) -> None:
        gpus = [{"index": p.index, "uuid": p.uuid, "state": p.state.value, "error": p.error}
                for p in status.gpus.values()]
        entry = {"layout": status.layout, "state": status.state.value, "error": status.error,
                 "started_at": status.started_at, "finished_at": status.finished_at, "gpus": gpus}
        self.entries = [entry, *self.entries][:HISTORY_KEPT]

    async def save(self) -> None:
        """Writes the history off the event loop (the write ends with two fsyncs), one write at a time,
        each of the list as it is then."""
        async with self._written:
            try:
                await asyncio.to_thread(write_json_atomic, self._path, self.entries)
            except OSError as exc:
                log.error("mig_history_not_saved", path=str(self._path), error=str(exc),
                          consequence="a gpud restart would show the MIG apply history without this apply")


def _history_from(document: list) -> list[dict]:
    if not isinstance(document, list) or not all(isinstance(entry, dict) and isinstance(entry.get("state"), str)
                                                 for entry in document):
        raise ValueError("the MIG apply history must be a list of applies, each with its state")
    return document[:HISTORY_KEPT]
