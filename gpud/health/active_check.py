"""`gpud check` (POST /v1/check): DCGM's diagnostic run on demand, its verdict folded into health.

DCGM's diagnostic loads the GPUs and fails when work runs on them, and it would slow that work down:
it never runs while a GPU has compute processes unless forced. One run at a time; the last run's
document is kept in the state directory for `gpud check --last`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from pathlib import Path
from typing import Any

from gpud.base.errors import ErrorKind, GpudError, nvml_unavailable
from gpud.base.logs import get_logger
from gpud.base.persist import read_json, write_json_atomic
from gpud.health.diag import DiagRun, find_dcgmi, run_diag
from gpud.health.diag_verdicts import diag_problems
from gpud.health.service import HealthService
from gpud.nvml.reset import compute_pids

log = get_logger("health")
KIND = "diag"  # the health reasons a run leaves, one per GPU it found wrong


class ActiveCheck:
    def __init__(self, health: HealthService, store_path: Path):
        self.health = health
        self.store = DiagStore(store_path)
        self._running = asyncio.Lock()

    async def run(self, level: int, force: bool, indices: Collection[int] | None = None) -> dict:
        """The run's document, on the GPUs of `indices` (None: every GPU); GpudError when it cannot start
        (a conflict: busy GPUs or a run in progress; unavailable without NVML). A run that failed to
        complete is a document too, with its error."""
        if self._running.locked():
            raise GpudError(ErrorKind.CONFLICT, "check-in-progress",
                            "a check is running already: wait for it (gpud check --last "
                            "shows it when it is done)")
        async with self._running:
            inventory = self.health.inventory.current
            if inventory is None:
                raise nvml_unavailable(self.health.session.error or "no inventory yet")
            gpus = [gpu for gpu in inventory.gpus if not gpu.lost and (indices is None or gpu.index in indices)]
            busy = {}
            for gpu in gpus:
                pids = await self.health.session.call(compute_pids, gpu.index)
                if pids:
                    busy[gpu.index] = list(pids)
            if busy and not force:
                said = "; ".join(f"GPU {index}: PIDs {', '.join(map(str, pids))}" for index, pids in busy.items())
                raise GpudError(ErrorKind.CONFLICT, "gpus-busy",
                                f"compute processes run on the GPUs ({said}): DCGM's diagnostic "
                                "would fail them and slow them down. Run it when they are done, "
                                "or with force (gpud check --force)", busy=busy)
            dcgmi = find_dcgmi(self.health.settings.dcgmi)
            log.info("check_started", level=level, gpus=[gpu.index for gpu in gpus], dcgmi=dcgmi, forced=bool(busy))
            run = await run_diag(dcgmi, level, [gpu.index for gpu in gpus], timeout_s=self.health.settings.check_timeout_s)
            await asyncio.to_thread(self.store.save, run)
            (log.info if run.outcome == "pass" else log.warning)("check_done", level=level, outcome=run.outcome,
                                                                 error=run.error, exit_code=run.exit_code)
            self.health.fold_check(KIND, {gpu.uuid: problem for index, problem in diag_problems(run).items()
                                          for gpu in gpus if gpu.index == index})
            return run.as_dict()

    def last(self) -> dict | None:
        return self.store.last()


class DiagStore:
    """The last run's document, one JSON file written atomically."""

    def __init__(self, path: Path):
        self.path = path

    def save(self, run: DiagRun) -> None:
        write_json_atomic(self.path, run.as_dict())

    def last(self) -> dict | None:
        document, corrupt = read_json(self.path, _checked_document)
        if corrupt is not None:  # read_json logged it and kept it aside as <name>.corrupt
            return None
        return document


def _checked_document(document: Any) -> dict:
    if not isinstance(document, dict):
        raise TypeError(f"a JSON {type(document).__name__}, not a check's document")
    missing = sorted({"level", "command", "outcome", "tests", "exit_code", "started_at", "finished_at",
                      "error", "output"} - set(document))
    if missing:
        raise KeyError(f"the check's document lacks {', '.join(missing)}")
    return document
