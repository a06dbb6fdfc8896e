"""XIDs from two sources, NVML's events and the kernel log, counted once: an XID both report is one
XID. Each counted XID goes to the tracker and into the counts /metrics shows as dcgm-exporter does."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from gpud.base.logs import get_logger
from gpud.health.catalog import XidCatalog
from gpud.health.reasons import Change
from gpud.model.named import Named
from gpud.health.tracker import HealthTracker

log = get_logger("health")
# dcgm-exporter's window for DCGM_EXP_XID_ERRORS_COUNT (its --xid-count-window-size default, 5 min).
XID_WINDOW_MS = 300_000
# The XIDs kept for that window: an XID storm (NVIDIA/NVSentinel#1710: 168,924 XID 45 in two days on a
# fleet) costs bounded memory; past this many in 5 minutes the window count stops growing.
XID_WINDOW_MAX = 10_000
# An XID from NVML and one from the kernel log of the same GPU and number this close in time are one XID.
SAME_XID_WINDOW_S = 10.0
# How long a report waits for its twin from the other source: a kernel-log line read late (a busy
# node) still finds NVML's report of the same XID.
KEEP_SOURCES_S = 120.0


class XidSource(Named):
    NVML = "nvml"
    KERNEL_LOG = "kernel-log"
    BOTH = "both"  # reported by each, counted once


class XidCounter:
    def __init__(self, catalog: XidCatalog, tracker: HealthTracker, publish: Callable[[list[Change], str], None],
                 counted: Callable[[], None]):
        self.catalog = catalog
        self._tracker = tracker
        self._publish = publish  # the tracker's changes an XID caused, with their cause
        self._counted = counted  # told after every XID counted: the counts changed, whether the state did or not
        self.recent: deque[tuple[str, int, float]] = deque(maxlen=XID_WINDOW_MAX)  # (GPU, XID, monotonic)
        self.last_xid: dict[str, tuple[int, float]] = {}  # GPU UUID -> (XID, when): dcgm-exporter's gauge
        self.counts: dict[tuple[str, int], int] = {}
        self.by_source: dict[str, int] = {source: 0 for source in XidSource}
        # (GPU UUID, XID) -> [(when, source, counted)] of the last SAME_XID_WINDOW_S: one XID, two sources
        self._recent_sources: dict[tuple[str, int], list[list]] = {}

    def count(self, gpu: str, xid: int, at: float, source: XidSource, gi_id: int | None, ci_id: int | None,
              detail: str | None) -> None:
        """An XID from one source; the same XID from the other source within SAME_XID_WINDOW_S is the
        one already counted."""
        recent = self._recent_sources.setdefault((gpu, xid), [])
        now = time.time()
        recent[:] = [entry for entry in recent if now - entry[0] <= KEEP_SOURCES_S]
        twin = next((entry for entry in recent if entry[1] != source and entry[2]
                     and abs(entry[0] - at) <= SAME_XID_WINDOW_S), None)
        if twin is not None:
            twin[2] = False  # matched: a third report of the same number is a new XID
            self.by_source[twin[1]] -= 1
            self.by_source[XidSource.BOTH] += 1
            log.info("xid_also_reported", gpu=gpu, xid=xid, source=source, first_source=twin[1])
            return
        recent.append([at, source, True])
        self.by_source[source] += 1
        self._record(gpu, xid, gi_id, ci_id, source, detail)

    def _record(self, gpu: str, xid: int, gi_id: int | None, ci_id: int | None, source: XidSource,
                detail: str | None) -> None:
        info = self.catalog.info(xid)
        self.last_xid[gpu] = (xid, time.time())
        self.recent.append((gpu, xid, time.monotonic()))
        self.counts[(gpu, xid)] = self.counts.get((gpu, xid), 0) + 1
        (log.warning if info.affects_health else log.info)(
            "xid", gpu=gpu, xid=xid, name=info.name, gi_id=gi_id, ci_id=ci_id, severity=info.severity,
            action=info.action, affects_health=info.affects_health, source=source, detail=detail)
        self._publish(self._tracker.record_xid(gpu, info, gi_id, ci_id), f"XID {xid} ({source})")
        self._counted()

    def in_window(self) -> dict[tuple[str, int], int]:
        """XIDs of the last XID_WINDOW_MS by (GPU UUID, XID)."""
        since = time.monotonic() - XID_WINDOW_MS / 1000
        while self.recent and self.recent[0][2] < since:
            self.recent.popleft()
        counts: dict[tuple[str, int], int] = {}
        for uuid, xid, _ in self.recent:
            counts[(uuid, xid)] = counts.get((uuid, xid), 0) + 1
        return counts
