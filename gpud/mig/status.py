"""The states of a MIG apply, of the GPUs it changes, and what requesting a MIG mode did. Strings in
every JSON answer and the watch stream (/v1/mig, NFD's nvidia.com/mig.config.state follows them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpud.model.named import Named


class ApplyState(Named):
    SUCCESS = "success"
    PENDING = "pending"  # chosen, not converged yet (or gpud has not begun converging at start)
    APPLYING = "applying"
    FAILED = "failed"
    RESET_REQUIRED = "reset-required"  # a MIG mode change waits for a GPU reset or a reboot


class GpuApplyState(Named):
    PENDING = "pending"
    APPLYING = "applying"
    DONE = "done"
    UNCHANGED = "unchanged"
    FAILED = "failed"
    RESET_REQUIRED = "reset-required"


class ModeOutcome(Named):
    """What requesting a MIG mode did (gpud.nvml.mig.set_mig_mode), or that the reset it waits for
    would be refused."""
    ACTIVE = "active"
    NEEDS_RESET = "needs-reset"
    NEEDS_REBOOT = "needs-reboot"
    BLOCKED = "blocked"


@dataclass
class GpuProgress:
    index: int
    uuid: str
    state: GpuApplyState = GpuApplyState.PENDING
    error: str | None = None
    mutations: int = 0


@dataclass
class ApplyStatus:
    layout: str | None = None
    state: ApplyState = ApplyState.SUCCESS
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    gpus: dict[str, GpuProgress] = field(default_factory=dict)

    def unapplied(self) -> list[str]:
        """Why the GPUs are not as the layout chose, when it failed or its MIG mode change waits for a reset
        or a reboot: /healthz and `gpud status` must not call that ok."""
        if self.state not in (ApplyState.FAILED, ApplyState.RESET_REQUIRED):
            return []
        return [f"MIG layout '{self.layout}' {self.state.value}: {self.error}"]

    def outcome(self) -> ApplyState:
        """The apply's state once every GPU was visited."""
        states = {p.state for p in self.gpus.values()}
        if GpuApplyState.FAILED in states:
            return ApplyState.FAILED
        return ApplyState.RESET_REQUIRED if GpuApplyState.RESET_REQUIRED in states else ApplyState.SUCCESS
