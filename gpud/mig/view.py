"""What /v1/mig shows of the MIG layout (desired and actual per GPU, the apply's state, the history),
and the gauges /metrics collects from it: in sync, and the apply's state."""

from __future__ import annotations

from typing import Iterator

from gpud.base.samples import Family
from gpud.mig.desired import GpuDesired
from gpud.mig.status import ApplyState, ApplyStatus
from gpud.mig.sync import actual_of, in_sync
from gpud.model.dcgm_labels import HOSTNAME
from gpud.model.inventory import Inventory


def mig_view(inventory: Inventory | None, desired: dict[str, GpuDesired], status: ApplyStatus, *,
             origin: str | None, started: bool, problem: str | None, history: list[dict],
             dynamic: frozenset[str] = frozenset()) -> dict:
    """`started`: gpud has converged (or begun converging) the GPUs at start-up; until then the state is pending.
    `dynamic`: the dynamic MIG GPUs (dra.dynamic_mig_gpus), which layouts leave to DRA claims."""
    gpus = []
    for gpu in inventory.gpus if inventory else ():
        wanted = desired.get(gpu.uuid)
        progress = status.gpus.get(gpu.uuid)
        gpus.append({"index": gpu.index, "uuid": gpu.uuid,
                     "desired": wanted.as_dict() if wanted else None, "actual": actual_of(gpu),
                     "in_sync": wanted is None or in_sync(gpu, wanted),
                     "state": progress.state.value if progress else None,
                     "error": progress.error if progress else None, "dynamic": gpu.uuid in dynamic})
    all_in_sync = bool(gpus) and all(g["in_sync"] for g in gpus)
    state = status.state
    if (state == ApplyState.SUCCESS and not all_in_sync and desired) or not started:
        state = ApplyState.PENDING
    return {"layout": status.layout, "layout_origin": origin, "state": state.value, "in_sync": all_in_sync,
            "error": status.error or problem,
            "started_at": status.started_at, "finished_at": status.finished_at, "gpus": gpus,
            "history": history}


def mig_families(view: dict, desired: dict[str, GpuDesired]) -> Iterator[Family]:
    """What /metrics collects of MIG: whether the GPUs are in sync, and the apply's state."""
    yield from in_sync_family(view, desired)
    yield from apply_state_family(view)


def in_sync_family(view: dict, desired: dict[str, GpuDesired]) -> Iterator[Family]:
    """Whether the GPUs have the desired layout, for /metrics (no desired layout: nothing is out of sync)."""
    family = Family("gpud_mig_in_sync", "1 when every GPU has the desired MIG layout.", "gauge")
    family.add({"hostname": HOSTNAME}, 1 if view["in_sync"] or not desired else 0)
    yield family


def apply_state_family(view: dict) -> Iterator[Family]:
    """The apply's state as /v1/mig says it, one series per state, 1 for the state it is in (a state set,
    as kube-state-metrics writes kube_pod_status_phase): a change is a value, not a series that vanishes."""
    family = Family("gpud_mig_apply_state", "1 for the MIG apply's state (/v1/mig's state), 0 for the others.",
                    "gauge")
    for state in ApplyState:
        family.add({"hostname": HOSTNAME, "state": state.value}, 1 if view["state"] == state else 0)
    yield family
