"""gpud's health (GET /v1/health) as DRA sees it: device taints on the ResourceSlice (KEP-5055) and the
kubelet's resource health stream (KEP-4680). Pure functions of gpud's answer.

Taints follow NVIDIA's driver's keys (cmd/gpu-kubelet-plugin/device_health.go healthEventToTaint:
`<driver>/xid` with the XID as value, `<driver>/gpu-lost`, `<driver>/unmonitored`) so tolerations written
for it hold; gpud's other reasons (ECC, row remapping, thermal, fabric, the driver's recovery action, ...)
are `<driver>/<reason kind>` with the reason's code as value. The effect comes from what the reason asks
of an operator (gpud/health/tracker.py Reason.action): NoSchedule while the GPU needs a reset, a reboot
or inspection (NoExecute instead where the operator opted in), None for what does not (NVIDIA's driver
gives None to the application XIDs it ignores: 13, 31, 43, 45, 68, 109). A taint goes when gpud's reason
goes: a passing check, a reset, the driver's own recovery action clearing, an admin clear.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass

from gpud.kubernetes.health import ACTION_ORDER, TAINTING_ACTIONS

NO_SCHEDULE, NO_EXECUTE, NONE = "NoSchedule", "NoExecute", "None"
# resource.k8s.io/v1 DeviceTaint limits (k8s.io/api resource/v1 types.go DeviceTaintsMaxLength; the
# effect None is new in 1.35, pkg/apis/resource/validation validateDeviceTaint)
MAX_TAINTS = {34: 4}  # per device, by the API server's minor version; later releases: 16
MAX_TAINTS_LATER = 16
NONE_EFFECT_SINCE = 35
HEALTH_MESSAGE_LIMIT = 1024  # k8s.io/kubelet dra-health/v1alpha1 api.proto DeviceHealth.message
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class TaintPolicy:
    no_execute: bool = False  # an operator's opt-in: evict pods from a device that needs a reset or more
    server_minor: int = 34  # the API server's minor version: what it accepts


@dataclass(frozen=True)
class DeviceHealthState:
    healthy: bool | None  # None: unknown (gpud unreachable)
    message: str


def _time(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _label_value(text: str) -> str:
    value = _LABEL_VALUE_BAD.sub("-", str(text))[:63].strip("-_.")
    return value


def _taint(driver: str, reason: dict, policy: TaintPolicy) -> dict | None:
    kind = str(reason.get("kind") or "unknown")
    action = reason.get("action") or "none"
    if action in TAINTING_ACTIONS or kind == "lost":
        effect = NO_EXECUTE if policy.no_execute else NO_SCHEDULE
    elif policy.server_minor >= NONE_EFFECT_SINCE:
        effect = NONE
    else:
        return None  # a 1.34 API server has no effect that only informs
    key = f"{driver}/{'gpu-lost' if kind == 'lost' else _label_value(kind).lower() or 'unknown'}"
    taint = {"key": key, "effect": effect}
    value = "" if kind == "lost" else _label_value(reason.get("code") or "")
    if value:
        taint["value"] = value
    added = _time(reason.get("first_seen"))
    if added:
        taint["timeAdded"] = added
    return taint


def _rank(reason: dict) -> int:
    action = reason.get("action") or "none"
    return ACTION_ORDER.index(action) if action in ACTION_ORDER else len(ACTION_ORDER)


def device_taints(driver: str, reasons: list[dict], policy: TaintPolicy) -> list[dict]:
    """The taints for a device's reasons, worst first, one per key and effect (the API server refuses
    duplicates), at most as many as the API server takes."""
    taints, seen = [], set()
    for reason in sorted(reasons, key=_rank):
        taint = _taint(driver, reason, policy)
        if taint is None or (taint["key"], taint["effect"]) in seen:
            continue
        seen.add((taint["key"], taint["effect"]))
        taints.append(taint)
    return taints[:MAX_TAINTS.get(policy.server_minor, MAX_TAINTS_LATER)]


def unmonitored_taint(driver: str, policy: TaintPolicy) -> list[dict]:
    """gpud has not answered past the grace period: nothing vouches for the device (NVIDIA's
    `<driver>/unmonitored`, effect None); a 1.34 API server has no None effect, so nothing is added."""
    if policy.server_minor < NONE_EFFECT_SINCE:
        return []
    return [{"key": f"{driver}/unmonitored", "effect": NONE}]


def reasons_by_uuid(health: dict) -> dict[str, list[dict]]:
    """Each GPU's and MIG device's reasons by its UUID (a MIG device's include its GPU's: tracker.py)."""
    found: dict[str, list[dict]] = {}
    for gpu in health.get("gpus") or []:
        found[gpu["uuid"]] = list(gpu.get("reasons") or [])
        for mig in gpu.get("mig_devices") or []:
            found[mig["uuid"]] = list(mig.get("reasons") or [])
    return found


def states_by_uuid(health: dict) -> dict[str, DeviceHealthState]:
    """Healthy or not, and why, for the kubelet's health stream: unhealthy is what gpud calls unhealthy
    (degraded still runs work); the message names each reason and the action it asks for."""
    states = {}
    for gpu in health.get("gpus") or []:
        for device in [gpu, *(gpu.get("mig_devices") or [])]:
            reasons = device.get("reasons") or []
            said = "; ".join(f"{r.get('message') or r.get('code')} (action: {r.get('action') or 'none'})"
                             for r in sorted(reasons, key=_rank))
            message = f"{device.get('state')}: {said}" if said else str(device.get("state"))
            states[device["uuid"]] = DeviceHealthState(device.get("state") != "unhealthy",
                                                       message[:HEALTH_MESSAGE_LIMIT])
    return states
