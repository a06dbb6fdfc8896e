"""The one writer of the node's GPUs: a MIG apply, a start-up reconcile and a GPU reset (and, next,
a DRA claim's dynamic MIG devices) each claim the node before changing a GPU, and give it back when
done. A claim while another holds the node is refused at once, naming what runs: the caller is
answered now rather than queued behind minutes of NVML calls.

Its own module, below mig/ and the resetter: every package that changes GPUs takes it, so none of
them may own it.
"""

from __future__ import annotations

import time

from gpud.base.errors import ErrorKind, GpudError
from gpud.model.named import Named


class Operation(Named):
    APPLY = "apply"  # a MIG layout chosen through the API or mig.default_layout
    RECONCILE = "reconcile"  # the persisted MIG layout converged on at start
    RESET = "reset"  # a GPU reset asked through the API or by health.auto_reset
    DYNAMIC_MIG = "dynamic-mig"  # a DRA claim's MIG devices made or destroyed (gpud.mig.dynamic)


class OperationInProgress(GpudError):
    """Another operation holds the node: nothing was changed."""


class NodeOperations:
    def __init__(self) -> None:
        # What changes the GPUs now, None when nothing does: claimed and checked with no await
        # between, so two requests never both pass.
        self.running: dict | None = None

    @property
    def busy(self) -> bool:
        return self.running is not None

    def claim(self, operation: Operation, **details: object) -> None:
        """Holds the node for operation, or raises OperationInProgress (409) naming the one that runs."""
        if self.running is not None:
            running = self.running
            raise OperationInProgress(ErrorKind.CONFLICT, "apply-in-progress",
                                      f"{_describe(running)} is in progress; nothing was changed, try "
                                      "again once it is done", running=running)
        self.running = {"operation": operation.value, **details, "started_at": time.time()}

    def release(self) -> None:
        self.running = None


def _describe(running: dict) -> str:
    if running["operation"] == Operation.RESET.value:
        return f"a reset of GPUs {', '.join(map(str, running['gpus']))}"
    if running["operation"] == Operation.DYNAMIC_MIG.value:
        claim = running.get("claim")
        return f"a dynamic MIG change for DRA claim {claim}" if claim else "dynamic MIG convergence at start"
    return f"a MIG apply of '{running['layout']}'"
