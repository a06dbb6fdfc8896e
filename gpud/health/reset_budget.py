"""The node's budget of GPU resets gpud makes without an operator's own reset request:
health.auto_reset_max_per_hour in any hour, drawn by health.auto_reset and by a remediation
(POST /v1/gpus/{id}/remediate) alike. The times are persisted with health (health.json's
`auto_resets`, the key older versions wrote), so the budget holds across restarts: a gpud restarting
in a loop cannot reset in a loop."""

from __future__ import annotations

import time
from typing import Callable

HOUR_S = 3600.0


class ResetBudget:
    def __init__(self, max_per_hour: int, spent: Callable[[], None], clock: Callable[[], float] = time.time):
        self.max_per_hour = max_per_hour
        self._spent = spent  # told when a reset is drawn (to save the times)
        self._clock = clock
        self.times: list[float] = []  # when each reset of the last hour was drawn (Unix time)

    def _recent(self) -> list[float]:
        now = self._clock()
        self.times = [when for when in self.times if now - when < HOUR_S]
        return self.times

    def used(self) -> int:
        """Resets drawn in the last hour."""
        return len(self._recent())

    def next_free_in_s(self) -> float | None:
        """Seconds until a reset may be drawn again; None while one may be drawn now."""
        recent = sorted(self._recent())
        if len(recent) < self.max_per_hour:
            return None
        # the oldest draw that must leave the hour for one to be free (more than max when the limit went down)
        return max(0.0, recent[len(recent) - self.max_per_hour] + HOUR_S - self._clock())

    def draw(self) -> bool:
        """One reset drawn, and saved; False, nothing drawn, when the budget is spent."""
        if self.next_free_in_s() is not None:
            return False
        self.times.append(self._clock())
        self._spent()
        return True

    def view(self) -> dict:
        """GET /v1/remediation's reset_budget."""
        free_in = self.next_free_in_s()
        return {"max_per_hour": self.max_per_hour, "used": self.used(),
                "next_free_in_s": None if free_in is None else round(free_in, 1)}
