"""The k8s agent's rules, each on its own: how gpud's health reads as the GPUHealthy condition and the
taint, which label values it acts on, which taint it may remove, and its backoff."""

from __future__ import annotations

import statistics

import pytest

from gpud.kubernetes import TAINT_EFFECT, TAINT_KEY, TAINT_VALUE
from gpud.kubernetes.agent import Agent, Backoff, label_value_problem
from gpud.kubernetes.health import MESSAGE_LIMIT, verdict


def gpu(index: int, state: str = "healthy", reasons=(), mig=()) -> dict:
    return {"index": index, "uuid": f"GPU-{index}", "state": state, "reasons": list(reasons), "mig_devices": list(mig)}


def reason(message: str, action: str) -> dict:
    return {"kind": "xid", "code": "79", "message": message, "severity": "unhealthy", "action": action}


def test_every_gpu_healthy_is_true():
    seen = verdict({"status": "healthy", "gpus": [gpu(0), gpu(1)]})
    assert (seen.status, seen.reason, seen.taint) == ("True", "AllGPUsHealthy", False)
    assert seen.message == "all 2 GPUs are healthy"


def test_the_worst_action_names_the_reason_and_the_message_names_gpus_xids_and_actions():
    seen = verdict({"status": "unhealthy", "gpus": [
        gpu(0), gpu(1, "degraded", [reason("XID 13: Graphics Engine Exception", "restart-app")]),
        gpu(2, "unhealthy", [reason("XID 79: GPU has fallen off the bus", "reboot")])]})
    assert (seen.status, seen.reason, seen.taint) == ("False", "GPUNeedsReboot", True)
    assert seen.message.startswith("1 of 3 GPUs healthy; ")
    assert "GPU 1 (GPU-1) degraded: XID 13: Graphics Engine Exception (restart-app)" in seen.message
    assert "GPU 2 (GPU-2) unhealthy: XID 79: GPU has fallen off the bus (reboot)" in seen.message


@pytest.mark.parametrize("action, reason_name, taint", [
    ("inspect-hardware", "GPUNeedsHardwareInspection", True), ("reboot", "GPUNeedsReboot", True),
    ("reset-gpu", "GPUNeedsReset", True), ("restart-app", "GPUDegraded", False), ("none", "GPUDegraded", False)])
def test_only_what_a_workload_cannot_recover_from_taints(action, reason_name, taint):
    seen = verdict({"gpus": [gpu(0, "unhealthy", [reason("x", action)])]})
    assert (seen.reason, seen.taint) == (reason_name, taint)


def test_an_unhealthy_mig_device_counts_and_is_named():
    device = {"uuid": "MIG-abc", "state": "unhealthy", "reasons": [reason("XID 94: contained ECC error", "reset-gpu")]}
    seen = verdict({"gpus": [gpu(0, mig=[device]), gpu(1)]})
    assert seen.status == "False" and seen.reason == "GPUNeedsReset"
    assert "GPU 0 (GPU-0) MIG device MIG-abc unhealthy" in seen.message and seen.message.startswith("1 of 2")


def test_no_gpus_is_false_and_a_long_message_is_cut():
    assert verdict({"status": "no-gpus", "gpus": []}).status == "False"
    many = verdict({"gpus": [gpu(i, "unhealthy", [reason("XID 79: GPU has fallen off the bus " * 3, "reboot")])
                             for i in range(64)]})
    assert len(many.message) == MESSAGE_LIMIT and many.message.endswith("…")


def test_the_transition_time_moves_only_with_the_status():
    was = {"type": "GPUHealthy", "status": "False", "reason": "GPUNeedsReboot", "message": "m",
           "lastTransitionTime": "2026-01-01T00:00:00Z"}
    again = verdict({"gpus": [gpu(0, "unhealthy", [reason("other", "reset-gpu")])]})
    assert again.condition("2026-11-26T00:00:00Z", was)["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    recovered = verdict({"gpus": [gpu(0)]})
    assert recovered.condition("2026-11-26T00:00:00Z", was)["lastTransitionTime"] == "2026-11-26T00:00:00Z"
    assert recovered.differs_from(was) and not recovered.differs_from(recovered.condition("t", None))


@pytest.mark.parametrize("value, problem", [
    ("all-1g.5gb", None), ("a", None), ("A_b.c-9", None), ("x" * 63, None),
    ("x" * 64, "is 64 characters long"), ("../etc/passwd", "is not a label value"), ("-a", "is not a label value"),
    ("a b", "is not a label value"), ("", None), ("é", "is not a label value")])
def test_label_values_the_agent_acts_on(value, problem):
    found = label_value_problem(value)
    assert (found is None) == (problem is None) and (problem is None or found.startswith(problem))


OURS = {"key": TAINT_KEY, "value": TAINT_VALUE, "effect": TAINT_EFFECT}
THEIRS_SAME_KEY = {"key": TAINT_KEY, "value": "by-hand", "effect": TAINT_EFFECT}
OTHER = {"key": "maintenance", "effect": "NoExecute"}


@pytest.mark.parametrize("taints, wanted, change", [
    ([], True, [OURS]), ([OTHER], True, [OTHER, OURS]), ([OURS], True, None), ([THEIRS_SAME_KEY], True, None),
    ([OTHER, OURS], False, [OTHER]), ([THEIRS_SAME_KEY], False, None), ([OTHER], False, None),
    ([{**OURS, "effect": "NoExecute"}], True, [{**OURS, "effect": "NoExecute"}, OURS])])
def test_the_agent_adds_its_taint_once_and_removes_only_its_own(taints, wanted, change):
    assert Agent._taint_change({"spec": {"taints": taints}}, wanted) == change


def test_the_backoff_doubles_to_its_cap_with_jitter_and_resets():
    backoff = Backoff(1.0, 8.0)
    waits = [backoff.next() for _ in range(6)]
    for wait, step in zip(waits, (1, 2, 4, 8, 8, 8)):
        assert step / 2 <= wait <= step
    spread = [Backoff(1.0, 8.0).next() for _ in range(200)]
    assert statistics.pstdev(spread) > 0.05  # agents that failed together do not retry together
    backoff.reset()
    assert backoff.next() <= 1.0
