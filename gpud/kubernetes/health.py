"""gpud's health (GET /v1/health) as Kubernetes sees it: the Node condition GPUHealthy and whether the
node should carry the taint nvidia.com/gpu.unhealthy. Pure functions: the agent calls them on each
health change."""

from __future__ import annotations

from dataclasses import dataclass

from gpud.kubernetes import CONDITION_TYPE

# What a GPU's reason asks of an operator (gpud/health/tracker.py Reason.action), worst first.
ACTION_ORDER = ("inspect-hardware", "reboot", "reset-gpu", "restart-app", "none")
# The actions a workload cannot recover from on its own: new pods should go elsewhere meanwhile.
TAINTING_ACTIONS = frozenset({"inspect-hardware", "reboot", "reset-gpu"})
CONDITION_REASONS = {"inspect-hardware": "GPUNeedsHardwareInspection", "reboot": "GPUNeedsReboot",
                     "reset-gpu": "GPUNeedsReset", "restart-app": "GPUDegraded", "none": "GPUDegraded"}
MESSAGE_LIMIT = 1024  # a condition message is read in `kubectl describe node`: the first GPUs tell enough


@dataclass(frozen=True)
class Verdict:
    status: str  # "True" | "False" | "Unknown", as a condition's status is written
    reason: str  # CamelCase, as condition reasons are
    message: str
    taint: bool  # the node should carry nvidia.com/gpu.unhealthy while this holds

    def condition(self, now: str, previous: dict | None) -> dict:
        """The condition to write; lastTransitionTime moves only when the status does (API conventions:
        'the last time the condition transitioned from one status to another')."""
        transition = previous.get("lastTransitionTime") if previous and previous.get("status") == self.status else None
        return {"type": CONDITION_TYPE, "status": self.status, "reason": self.reason, "message": self.message,
                "lastHeartbeatTime": now, "lastTransitionTime": transition or now}

    def differs_from(self, condition: dict | None) -> bool:
        return condition is None or (condition.get("status"), condition.get("reason"), condition.get("message")) != \
            (self.status, self.reason, self.message)


def _worst(actions: list[str]) -> str:
    return min(actions, key=lambda a: ACTION_ORDER.index(a) if a in ACTION_ORDER else len(ACTION_ORDER))


def _device_line(where: str, device: dict) -> tuple[str, list[str]]:
    reasons = device.get("reasons") or []
    actions = [r.get("action", "none") for r in reasons]
    said = "; ".join(f"{r.get('message') or r.get('code')} ({r.get('action', 'none')})" for r in reasons)
    return f"{where} {device.get('state')}: {said or 'no reason given'}", actions


def verdict(health: dict) -> Verdict:
    """The condition for a /v1/health document."""
    gpus = health.get("gpus") or []
    lines, actions = [], []
    for gpu in gpus:
        where = f"GPU {gpu.get('index')} ({gpu.get('uuid')})"
        sick = [m for m in gpu.get("mig_devices") or [] if m.get("state") != "healthy"]
        if gpu.get("state") != "healthy":
            line, found = _device_line(where, gpu)
            lines.append(line + (f" (and {len(sick)} of its MIG devices)" if sick else ""))
            actions += found
            continue  # its MIG devices share its reasons: named once
        for mig in sick:
            line, found = _device_line(f"{where} MIG device {mig.get('uuid')}", mig)
            lines.append(line)
            actions += found
    if not gpus:
        return Verdict("False", "NoGPUs", f"gpud reports no GPUs (health: {health.get('status')})", taint=False)
    if not lines:
        return Verdict("True", "AllGPUsHealthy", f"all {len(gpus)} GPUs are healthy", taint=False)
    worst = _worst(actions or ["none"])
    healthy = sum(g.get("state") == "healthy" and all(m.get("state") == "healthy" for m in g.get("mig_devices") or [])
                  for g in gpus)
    message = f"{healthy} of {len(gpus)} GPUs healthy; " + "; ".join(lines)
    if len(message) > MESSAGE_LIMIT:
        message = message[:MESSAGE_LIMIT - 1] + "…"
    return Verdict("False", CONDITION_REASONS.get(worst, "GPUDegraded"), message, taint=worst in TAINTING_ACTIONS)


def unknown(why: str) -> Verdict:
    """gpud has not answered for a while: nothing vouches for the GPUs either way."""
    return Verdict("Unknown", "GpudUnreachable", why[:MESSAGE_LIMIT], taint=False)
