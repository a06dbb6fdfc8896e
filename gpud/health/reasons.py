"""Why a device is not healthy: its reasons, the changes the watch stream carries, and the reasons as
health.json keeps them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpud.health.states import ACTION_RANK, HEALTH_RANK, Action, Health

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
