"""Why a device is not healthy: its reasons, the changes the watch stream carries, and the reasons as
health.json keeps them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from gpud.health.states import ACTION_RANK, HEALTH_RANK, Action, Clears, Health

Key = tuple[str, str]  # (kind, code)


@dataclass(frozen=True)
class Reason:
    kind: str  # "xid" | "ecc" | "temperature" | "remapped-rows" | "lost" | "mps" | ...
    code: str  # "79", "dbe", "pending", ...
    message: str
    severity: str  # Health.DEGRADED | Health.UNHEALTHY
    action: str  # an Action
    first_seen: float
    last_seen: float
    count: int
    clears: str  # a Clears


@dataclass(frozen=True)
class Change:
    """One device's state transition, for the watch stream and the log."""

    device: str  # UUID (GPU- or MIG-), or a subject's name ("node", "ib:mlx5_0/1")
    gpu_index: int | None  # None for a subject
    previous: str
    state: str
    reasons: tuple[Reason, ...]  # the device's effective reasons now
    driver_action: str | None = None  # a GPU's recovery action as the driver says it now; None: not said


@dataclass
class TrackedDevice:
    """A GPU, MIG device or subject as the tracker keeps it: its own reasons, not its GPU's."""

    gpu_index: int | None  # None for a subject
    parent: str | None = None  # the GPU's UUID, for a MIG device
    gi_id: int | None = None
    ci_id: int | None = None
    reasons: dict[Key, Reason] = field(default_factory=dict)
    passes: dict[Key, int] = field(default_factory=dict)  # consecutive passing checks of a check's reason

    def add(self, reason: Reason) -> None:
        """Adds the reason, or refreshes the one already there (keeping when it was first seen)."""
        key = (reason.kind, reason.code)
        known = self.reasons.get(key)
        self.reasons[key] = replace(reason, first_seen=known.first_seen, count=known.count + 1) if known else reason
        self.passes.pop(key, None)  # passes must be consecutive

    def count_pass(self, key: Key, clear_after_passes: int) -> None:
        """A check of the reason passed: clear_after_passes of them in a row take it away."""
        reason = self.reasons.get(key)
        if reason is None or reason.clears != Clears.CHECK:
            return
        self.passes[key] = self.passes.get(key, 0) + 1
        if self.passes[key] >= clear_after_passes:
            self.drop(lambda candidate: (candidate.kind, candidate.code) == key)

    def drop(self, matches: Callable[[Reason], bool]) -> None:
        for key in [key for key, reason in self.reasons.items() if matches(reason)]:
            del self.reasons[key]
            self.passes.pop(key, None)


def parse_reasons(document: dict[str, list[dict]]) -> dict[str, dict[Key, Reason]]:
    """What HealthTracker.export() wrote. TypeError or ValueError for a document of another shape."""
    parsed = {}
    for uuid, reasons in document.items():
        if not isinstance(uuid, str) or not isinstance(reasons, list):
            raise TypeError(f"device {uuid!r}: a list of reasons expected")
        parsed[uuid] = {(reason.kind, reason.code): reason for reason in map(_reason_from, reasons)}
    return parsed


def _reason_from(fields: dict) -> Reason:
    reason = Reason(**fields)  # TypeError for missing or unknown fields
    if reason.severity not in (Health.DEGRADED, Health.UNHEALTHY) or not isinstance(reason.count, int):
        raise ValueError(f"not a persisted reason: {fields!r}")
    return reason


def suggested_action(reasons: list[dict]) -> str:
    """gpud's suggested action for a device: the strongest its reasons ask for."""
    return max((reason["action"] for reason in reasons), key=ACTION_RANK.index, default=Action.NONE)


def worst(states: Iterable[str]) -> str:
    return max(states, key=HEALTH_RANK.__getitem__, default=Health.HEALTHY)
