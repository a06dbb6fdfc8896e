"""What health keeps across restarts. health.json: each device's reasons, the XID counts and the last
XID of each GPU, the boot they were saved in, the boots in which a GPU needed a reboot and the resets
drawn from the reset budget, automatic or remediations' (so the hourly limit holds across restarts);
saved on every change, so a GPU unhealthy before a restart is unhealthy after it, for the same
reasons, and what was cleared stays so. And the NVLink links seen up on each GPU, where only those
count when down."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Awaitable, Callable, NamedTuple

from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile, read_json, write_json_atomic
from gpud.health.reasons import Key, Reason, parse_reasons

log = get_logger("health")
# How long health changes gather before they are saved: an XID storm costs one write, not one per
# XID, and a crash loses at most this much.
SAVE_DELAY_S = 0.2


class Persisted(NamedTuple):
    reasons: dict[str, dict[Key, Reason]]
    xid_counts: dict[tuple[str, int], int]
    last_xid: dict[str, tuple[int, float]]
    boot_id: str
    reboot_needs: dict[str, dict[str, float]]
    auto_resets: list[float]


def health_document(*, reasons: dict[str, list[dict]], xid_counts: dict[tuple[str, int], int],
                    last_xid: dict[str, tuple[int, float]], boot_id: str, reboot_needs: dict[str, dict[str, float]],
                    auto_resets: list[float]) -> dict:
    """health.json; reasons as HealthTracker.export() gives them."""
    return {"reasons": reasons,
            "xid_counts": [[uuid, xid, count] for (uuid, xid), count in sorted(xid_counts.items())],
            "last_xid": {uuid: [xid, when] for uuid, (xid, when) in last_xid.items()},
            "boot_id": boot_id, "reboot_needs": reboot_needs, "auto_resets": auto_resets}


def persisted_from(document: dict) -> Persisted:
    """The health file as health_document() wrote it; TypeError, ValueError or KeyError otherwise. The
    keys after last_xid are absent in files of older gpud versions."""
    return Persisted(parse_reasons(document["reasons"]),
                     {(str(uuid), int(xid)): int(count) for uuid, xid, count in document["xid_counts"]},
                     {str(uuid): (int(xid), float(when)) for uuid, (xid, when) in document["last_xid"].items()},
                     str(document.get("boot_id", "")),
                     {str(uuid): {str(boot): float(when) for boot, when in boots.items()}
                      for uuid, boots in document.get("reboot_needs", {}).items()},
                     [float(when) for when in document.get("auto_resets", [])])


def links_from(document: dict) -> dict[str, frozenset[int]]:
    return {str(uuid): frozenset(int(link) for link in links) for uuid, links in document.items()}


def save_links(path: Path | None, links: dict[str, frozenset[int]]) -> None:
    if path is None:
        return
    try:
        write_json_atomic(path, {uuid: sorted(up) for uuid, up in links.items()})
    except OSError as exc:
        log.warning("nvlinks_not_saved", path=str(path), error=str(exc))


def load(path: Path | None, parse: Callable[[Any], Any], corrupt_files: list[CorruptFile]) -> Any:
    """The file parsed; None without a path or a file. A file that cannot be read back is added to
    corrupt_files (and set aside by read_json)."""
    if path is None:
        return None
    document, corrupt = read_json(path, parse)
    if corrupt:
        corrupt_files.append(corrupt)
    return document


class HealthSaver:
    """Saves health.json shortly after a change, off the event loop: one write for the changes of
    SAVE_DELAY_S. `before` runs first, in the same pass (the kernel log's cursor: first the records
    read, then what they counted, so a crash between the two saves re-counts no XID at the restart)."""

    def __init__(self, path: Path | None, document: Callable[[], dict], before: Callable[[], Awaitable[None]]):
        self.path = path
        self._document = document
        self._before = before
        self._task: asyncio.Task | None = None
        self._unsaved = False

    def soon(self) -> None:
        if self.path is None:
            return
        self._unsaved = True
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._save_while_unsaved())

    async def flush(self) -> None:
        """Waits for the save under way, if any."""
        if self._task:
            await self._task

    async def _save_while_unsaved(self) -> None:
        while self._unsaved:
            await asyncio.sleep(SAVE_DELAY_S)
            self._unsaved = False
            await self._before()
            try:
                await asyncio.to_thread(write_json_atomic, self.path, self._document())
            except OSError as exc:
                log.error("health_not_saved", path=str(self.path), error=str(exc),
                          consequence="a restart would forget the health changes since the last save")
