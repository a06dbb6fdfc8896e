"""`gpud slurm health` with gpud's remediation policy on (gpud/slurm/health.py Remediation): the pure parts
(the node's emptiness, the reasons' marks, the decision), then against a real Slurm cluster
(tests/slurm_cluster.py) and a simulated gpud whose gpud.yaml turns remediation on: a node gpud drained for
an XID that asks for a reset is reset, checked and resumed once its jobs are gone, through gpud's POST
/v1/gpus/{id}/remediate; a GPU something outside Slurm holds, a spent reset budget or a GPU that needs a
reboot leave it drained saying why; an operator's drain is never touched."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import GpudProcess, until
from slurm_cluster import SlurmCluster, need_slurm
from test_slurm_health import (answering_gpud, cluster, fresh, idle, run_health, send,  # noqa: F401 (fixtures)
                               xid)

from gpud.slurm.health import (BUDGET_SPENT, CHECK_FAILED, LEAVE, NOTHING, REBOOT_NEEDED, RESET_BLOCKED,
                               RESET_FAILED, UPDATE, Problem, SlurmNode, decide, drain_reason, mark_of, problems)

RESET_XID = 95  # gpud/health/xids.yaml: uncontained memory error, action reset-gpu
REBOOT_XID = 79  # fallen off the bus, action reboot
# longer than slurm.conf(5) sched_interval (60 s by default), the main scheduler's pass over pending jobs
SCHEDULED_WITHIN_S = 90

# -- the pure parts -----------------------------------------------------------------------------


@pytest.mark.parametrize("state, empty", [
    ("IDLE+DRAIN", True),
    ("IDLE+DRAIN+NOT_RESPONDING", True),
    ("MIXED+DRAIN", False),  # draining: jobs run on
    ("ALLOCATED+DRAIN", False),
    ("IDLE+COMPLETING+DRAIN", False),  # a job's epilog still runs
    ("IDLE", False),
    ("DOWN+DRAIN", False),
    ("IDLE+DRAIN+REBOOT_REQUESTED", True),
])
def test_a_node_is_empty_when_drained_with_no_job_left(state, empty):
    assert SlurmNode("vm", state, "gpud: x").empty is empty


def test_the_problems_carry_what_their_reasons_ask():
    view = {"node": {"state": "healthy", "reasons": []}, "subjects": [],
            "gpus": [{"index": 2, "state": "unhealthy", "mig_devices": [],
                      "reasons": [{"kind": "xid", "code": "95", "severity": "unhealthy", "action": "reset-gpu"},
                                  {"kind": "recovery-action", "code": "gpu-reset", "severity": "unhealthy",
                                   "action": "reset-gpu"},
                                  {"kind": "temperature", "code": "slowdown", "severity": "degraded",
                                   "action": "none"}]}]}
    assert [p.actions for p in problems(view)] == [("reset-gpu",)]


def test_a_gpus_remedy_is_gpuds_and_its_mig_devices_carry_it_and_no_other_value_passes():
    sick = {"state": "unhealthy", "reasons": [{"kind": "xid", "code": "48", "severity": "unhealthy",
                                               "action": "reboot"}]}
    view = {"node": {"state": "healthy", "reasons": []}, "subjects": [],
            "gpus": [{"index": 0, **sick, "remedy": "reset-gpu",  # the driver says a reset mends this XID 48
                      "mig_devices": [{"profile": "1g.5gb", **sick}]},
                     {"index": 1, **sick, "remedy": "reboot; rm -rf /", "mig_devices": []}]}
    assert [(p.subject, p.remedy) for p in problems(view)] == \
        [("GPU 0", "reset-gpu"), ("GPU 0 MIG 1g.5gb", "reset-gpu"), ("GPU 1", None)]


SICK = [Problem("GPU 2", 2, "unhealthy", "XID 95 (reset-gpu)", ("reset-gpu",), "reset-gpu")]


@pytest.mark.parametrize("mark", [RESET_BLOCKED, BUDGET_SPENT, CHECK_FAILED, REBOOT_NEEDED])
def test_a_marked_reason_is_gpuds_own_for_the_same_problems(mark):
    marked = drain_reason(SICK, mark)
    assert marked.startswith(f"gpud: {mark}: GPU 2 XID 95 (reset-gpu)") and len(marked) <= 200
    assert mark_of(marked, SICK) == mark
    # the same problems: not rewritten on every run; other problems: the reason follows them
    assert decide(SlurmNode("vm", "IDLE+DRAIN", marked), SICK).action == NOTHING
    other = [Problem("GPU 5", 5, "unhealthy", "XID 79 (reboot)", ("reboot",))]
    assert mark_of(marked, other) is None
    assert decide(SlurmNode("vm", "IDLE+DRAIN", marked), other).action == UPDATE


def test_a_long_marked_reason_is_cut_and_still_recognised():
    many = [Problem(f"GPU {i}", i, "unhealthy", f"XID {i}{i}{i} (reset-gpu)", ("reset-gpu",)) for i in range(8)]
    marked = drain_reason(many, CHECK_FAILED)
    assert len(marked) == 200 and marked.endswith("...") and mark_of(marked, many) == CHECK_FAILED


@pytest.mark.parametrize("state", ["IDLE+DRAIN+REBOOT_REQUESTED", "DOWN+DRAIN+REBOOT_ISSUED"])
def test_a_node_asked_to_reboot_is_left_to_slurm(state):
    reason = drain_reason(SICK, REBOOT_NEEDED) + " : reboot issued"  # node_mgr.c set_node_reboot_reason appends
    assert decide(SlurmNode("vm", state, reason), SICK).action == LEAVE
    assert decide(SlurmNode("vm", state, reason), []).action == LEAVE


# -- against a real Slurm cluster and a simulated gpud with remediation on -----------------------


def start_gpud(prefix: str, remediation: dict, health: dict | None = None,
               sim_driver: str | None = None) -> tuple[GpudProcess, Path]:
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    (work / "gpud.yaml").write_text(json.dumps({"remediation": remediation, "health": health or {},
                                                **({"sim_driver": sim_driver} if sim_driver else {})}))
    process = GpudProcess(work, "--config", str(work / "gpud.yaml"), "--simulate", "dgx-a100",
                          "--sim-state", str(work / "sim.json"))
    process.wait_healthy()
    return process, work


@pytest.fixture(scope="module")
def gpud():
    # the budget at its most: these tests reset more than the default 2 an hour
    process, work = start_gpud("gsr", {"enabled": True}, {"auto_reset_max_per_hour": 60})
    yield process
    process.stop()
    shutil.rmtree(work, ignore_errors=True)


def results(gpud) -> dict:
    return gpud.client.get("/v1/remediation")["results"]


def drained(cluster) -> bool:
    return "DRAIN" in cluster.node_state()


def test_a_gpu_asking_a_reset_is_reset_checked_and_the_node_resumed(fresh):
    cluster, gpud = fresh
    before = results(gpud)["passed"]
    xid(gpud, 2, RESET_XID)
    first = run_health(cluster, gpud.socket)
    assert first.returncode == 0 and "decision: drain" in first.stdout, first
    assert cluster.node_reason() == "gpud: GPU 2 XID 95 (reset-gpu)"
    second = run_health(cluster, gpud.socket)
    assert second.returncode == 0, second
    lines = second.stdout.splitlines()
    assert any(line.startswith("remediation: GPU 2: reset if gpud's health asks for one") for line in lines), lines
    assert any(line.startswith("remediation: GPU 2: reset GPU") for line in lines), lines
    assert any(line.startswith("remediation: GPU 2: check") and line.endswith("passed") for line in lines), lines
    assert "decision: resume: every GPU passed its check after its reset" in second.stdout
    assert idle(cluster)
    assert results(gpud)["passed"] == before + 1
    assert gpud.client.get("/v1/health")["gpus"][2]["state"] == "healthy"


def test_a_node_still_running_a_job_waits_then_is_remediated_and_takes_the_next_job(fresh):
    cluster, gpud = fresh
    job = subprocess.run(["sbatch", "--parsable", "--gres=gpu:1", "-o", "/dev/null", "--wrap", "sleep 600"],
                         capture_output=True, text=True, env=cluster.env, timeout=30)
    assert job.returncode == 0, job
    job_id = job.stdout.strip().split(";")[0]
    # a job not started on its submission waits for Slurm's periodic passes (slurm.conf(5) sched_interval,
    # bf_interval): CI once saw none start it within 20 s
    try:
        until(lambda: cluster.node_state().split("+")[0] in ("MIXED", "ALLOCATED"), SCHEDULED_WITHIN_S,
              "the job running")
    except AssertionError as exc:
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True,
                                env=cluster.env, timeout=30)
        raise AssertionError(f"{exc}; node {cluster.node_state()}; job {queued.stdout.strip()}; {cluster.logs()}") \
            from None
    xid(gpud, 0, RESET_XID)
    assert run_health(cluster, gpud.socket).returncode == 0
    draining = run_health(cluster, gpud.socket)
    assert "remediation" not in draining.stdout and "decision: nothing" in draining.stdout, draining
    assert "+DRAIN" in cluster.node_state() and cluster.node_state().split("+")[0] != "IDLE"
    subprocess.run(["scancel", job_id], env=cluster.env, timeout=30, check=True)
    until(lambda: cluster.node_state().replace("+NOT_RESPONDING", "") == "IDLE+DRAIN", 30, "the job gone")
    resumed = run_health(cluster, gpud.socket)
    assert "decision: resume" in resumed.stdout, resumed
    assert idle(cluster)
    after = subprocess.run(["srun", "--gres=gpu:1", "true"], capture_output=True, text=True, env=cluster.env,
                           timeout=60)
    assert after.returncode == 0, after


def test_a_gpu_held_outside_slurm_leaves_the_node_drained_until_it_is_let_go(fresh):
    cluster, gpud = fresh
    gpud.client.request("POST", "/v1/sim/holders", {"gpu": 3, "process": "nv-hostengine", "pid": 4242})
    xid(gpud, 3, RESET_XID)
    assert run_health(cluster, gpud.socket).returncode == 0
    blocked = run_health(cluster, gpud.socket)
    assert blocked.returncode == 0, blocked
    assert "remediation: GPU 3: blocked: HTTP 409 reset-blocked" in blocked.stdout, blocked
    assert "blocker: GPU 3:" in blocked.stdout and "nv-hostengine" in blocked.stdout
    assert cluster.node_reason() == f"gpud: {RESET_BLOCKED}: GPU 3 XID 95 (reset-gpu)"
    again = run_health(cluster, gpud.socket)  # tried again: a holder may let go by itself
    assert "blocked" in again.stdout and "decision: nothing" in again.stdout, again
    gpud.client.request("POST", "/v1/sim/holders", {"gpu": 3, "release": True})
    resumed = run_health(cluster, gpud.socket)
    assert "decision: resume" in resumed.stdout, resumed
    assert idle(cluster)


def test_a_gpu_that_needs_a_reboot_is_left_drained_saying_so(fresh):
    cluster, gpud = fresh
    xid(gpud, 4, REBOOT_XID)
    assert run_health(cluster, gpud.socket).returncode == 0
    before = results(gpud)
    second = run_health(cluster, gpud.socket)
    assert second.returncode == 0 and "decision: update-reason: a GPU needs a reboot" in second.stdout, second
    assert cluster.node_reason() == f"gpud: {REBOOT_NEEDED}: GPU 4 XID 79 (reboot)"
    third = run_health(cluster, gpud.socket)
    assert "decision: nothing: a GPU needs a reboot; the reason says so already" in third.stdout, third
    assert drained(cluster) and results(gpud) == before  # nothing asked of gpud


def test_an_operator_drain_is_never_remediated(fresh):
    cluster, gpud = fresh
    cluster.scontrol("update", f"nodename={cluster.node}", "state=drain", "reason=maintenance")
    xid(gpud, 2, RESET_XID)
    before = results(gpud)
    for _ in range(2):
        run = run_health(cluster, gpud.socket)
        assert run.returncode == 0 and "decision: leave" in run.stdout and "remediation" not in run.stdout, run
    assert (cluster.node_state().replace("+NOT_RESPONDING", ""), cluster.node_reason()) == ("IDLE+DRAIN", "maintenance")
    assert results(gpud) == before and gpud.client.get("/v1/health")["gpus"][2]["state"] == "unhealthy"


def test_dry_run_says_what_it_would_do_and_does_nothing(fresh):
    cluster, gpud = fresh
    xid(gpud, 2, RESET_XID)
    assert run_health(cluster, gpud.socket).returncode == 0
    before = results(gpud)
    dry = run_health(cluster, gpud.socket, "--dry-run")
    assert dry.returncode == 0, dry
    assert 'dry run: would POST /v1/gpus/2/remediate {"requester": "slurm"}' in dry.stdout, dry
    assert "decision: nothing: dry run" in dry.stdout
    assert results(gpud) == before and cluster.node_reason() == "gpud: GPU 2 XID 95 (reset-gpu)"


def test_remediation_off_changes_nothing(cluster):
    until(lambda: idle(cluster), 20, "node idle")
    process, work = start_gpud("gso", {"enabled": False})
    try:
        xid(process, 2, RESET_XID)
        assert run_health(cluster, process.socket).returncode == 0
        off = run_health(cluster, process.socket)
        assert "remediation: off (gpud.yaml remediation.enabled is false)" in off.stdout, off
        assert "decision: nothing: still unhealthy; already drained by gpud" in off.stdout
        assert cluster.node_reason() == "gpud: GPU 2 XID 95 (reset-gpu)"
    finally:
        process.stop()
        shutil.rmtree(work, ignore_errors=True)
        cluster.scontrol("update", f"nodename={cluster.node}", "state=resume")


def test_an_xid_48_the_driver_answers_with_a_reset_is_reset_and_the_node_resumed(cluster):
    """XID 48: a reboot in NVIDIA's catalog, but a driver of R565 or later that says a GPU reset mends it is
    followed, as gpud's remediate route follows it; both reasons stand until the reset."""
    until(lambda: idle(cluster), 20, "node idle")
    process, work = start_gpud("gs48", {"enabled": True}, sim_driver="580.65.06")
    try:
        xid(process, 2, 48)
        until(lambda: process.client.get("/v1/health")["gpus"][2].get("driver_action") == "gpu-reset", 20,
              "the driver's recovery action read")
        assert "decision: drain" in run_health(cluster, process.socket).stdout
        second = run_health(cluster, process.socket)
        assert "decision: resume: every GPU passed its check after its reset" in second.stdout, second.stdout
        assert idle(cluster)
    finally:
        process.stop()
        shutil.rmtree(work, ignore_errors=True)
        if drained(cluster):
            cluster.scontrol("update", f"nodename={cluster.node}", "state=resume")


# -- gpud answering the remediation routes oddly (a stand-in for gpud gone wrong) -----------------

SICK_VIEW = {"status": "unhealthy", "node": {"state": "healthy", "reasons": []}, "subjects": [],
             "gpus": [{"index": 1, "uuid": "GPU-1", "state": "unhealthy", "mig_devices": [], "remedy": "reset-gpu",
                       "reasons": [{"kind": "xid", "code": "95", "severity": "unhealthy", "action": "reset-gpu"}]}]}
POLICY = {"policy": {"enabled": True, "dry_run": False, "slurm_reboot": False},
          "reset_budget": {"max_per_hour": 2, "used": 0, "next_free_in_s": None}, "results": {}}


def scripted_gpud(remediate: tuple[int, dict | bytes], policy=POLICY):
    """gpud's health (GPU 1 asking a reset, before and after), its policy (None: a gpud from before
    remediation, which answers 404), and remediate's answer."""
    def answer(handler):
        if handler.path == "/v1/health":
            send(handler, 200, json.dumps(SICK_VIEW).encode())
        elif handler.path == "/v1/remediation" and policy is not None:
            send(handler, 200, json.dumps(policy).encode())
        elif handler.path == "/v1/gpus/1/remediate" and handler.command == "POST":
            handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
            status, body = remediate
            send(handler, status, body if isinstance(body, bytes) else json.dumps(body).encode())
        else:
            send(handler, 404, b'{"error": {"code": "not-found", "message": "no route"}}')
    return answering_gpud(answer)


@pytest.fixture
def drained_by_gpud(cluster):
    cluster.scontrol("update", f"nodename={cluster.node}", "state=drain", "reason=gpud: GPU 1 XID 95 (reset-gpu)")
    yield cluster
    cluster.scontrol("update", f"nodename={cluster.node}", "state=resume")


@pytest.mark.parametrize("status, body, mark, said", [
    (200, {"gpu": 1, "uuid": "GPU-1", "requester": "slurm", "reset": None, "action": "reset-gpu",
           "check": {"how": "read-back", "passed": False, "problems": ["XID 95 since the reset"]}},
     CHECK_FAILED, "check read-back failed: XID 95 since the reset"),
    (429, {"error": {"code": "reset-budget-spent", "message": "2 resets in the last hour", "retry_after_s": 1200.4}},
     BUDGET_SPENT, "(a reset is free again in 1200 s)"),
    (500, {"error": {"code": "internal", "message": "boom\n; rm -rf /"}}, RESET_FAILED, "failed: HTTP 500"),
    (200, b'{"gpu": 1, "check": "yes"}', RESET_FAILED, "gpud's answer has no check"),
])
def test_each_outcome_leaves_the_node_drained_saying_why(drained_by_gpud, status, body, mark, said):
    cluster = drained_by_gpud
    with scripted_gpud((status, body)) as path:
        run = run_health(cluster, path)
        assert run.returncode == 0, run
        assert said in run.stdout and "\n; rm" not in run.stdout, run
        assert cluster.node_reason() == f"gpud: {mark}: GPU 1 XID 95 (reset-gpu)"
        if mark in (CHECK_FAILED, RESET_FAILED):  # a person's work now: not reset again for the same problems
            again = run_health(cluster, path)
            assert "already tried for these problems" in again.stdout and "POST" not in again.stdout, again


@pytest.mark.parametrize("policy", [{"policy": {"enabled": "yes"}}, {"nothing": 1}, []])
def test_a_policy_that_is_not_gpuds_fails_and_leaves_the_node(drained_by_gpud, policy):
    cluster = drained_by_gpud
    with scripted_gpud((200, {}), policy=policy) as path:
        run = run_health(cluster, path)
        assert run.returncode == 4 and "/v1/remediation has no policy" in run.stderr, run
        assert cluster.node_reason() == "gpud: GPU 1 XID 95 (reset-gpu)"


def test_an_older_gpud_without_remediation_drains_as_before(drained_by_gpud):
    cluster = drained_by_gpud
    with scripted_gpud((200, {}), policy=None) as path:
        run = run_health(cluster, path)
        assert run.returncode == 0 and "remediation: off (this gpud has no GET /v1/remediation)" in run.stdout, run
        assert cluster.node_reason() == "gpud: GPU 1 XID 95 (reset-gpu)"


# -- the reset budget, then a reboot through Slurm (its own cluster: the reboot is real to Slurm) --


@pytest.mark.slow
def test_a_spent_budget_waits_and_a_reboot_is_asked_of_slurm_once():
    need_slurm()
    own = SlurmCluster()
    process, work = start_gpud("gsb", {"enabled": True, "slurm_reboot": True}, {"auto_reset_max_per_hour": 1})
    marker = own.dir / "rebooted"
    reboot = own.dir / "reboot.sh"
    # slurmd runs RebootProgram with system() (src/slurmd/slurmd/req.c _rpc_reboot): here it only says so
    reboot.write_text(f"#!/bin/sh\necho rebooted >> {marker}\n")
    reboot.chmod(0o755)
    try:
        own.set_extra_conf(f"RebootProgram={reboot}")
        xid(process, 1, RESET_XID)
        assert run_health(own, process.socket).returncode == 0
        assert "decision: resume" in run_health(own, process.socket).stdout  # the hour's one reset
        until(lambda: idle(own), 20, "node idle")
        xid(process, 1, RESET_XID)
        assert run_health(own, process.socket).returncode == 0
        spent = run_health(own, process.socket)
        assert "remediation: GPU 1: budget-spent: HTTP 429 reset-budget-spent" in spent.stdout, spent
        assert own.node_reason() == f"gpud: {BUDGET_SPENT}: GPU 1 XID 95 (reset-gpu)"
        xid(process, 6, REBOOT_XID)
        rebooting = run_health(own, process.socket)
        assert "decision: reboot: a GPU needs a reboot: Slurm reboots the node" in rebooting.stdout, rebooting
        until(lambda: marker.exists(), 30, f"slurmd to run the RebootProgram ({own.show_node()})", interval=0.2)
        assert (own.node_reason() or "").startswith(f"gpud: {REBOOT_NEEDED}: GPU 1 XID 95 (reset-gpu); GPU 6 XID 79")
        later = run_health(own, process.socket)
        assert "decision: leave" in later.stdout and "a reboot is under way" in later.stdout, later
        assert marker.read_text() == "rebooted\n"
    finally:
        process.stop()
        shutil.rmtree(work, ignore_errors=True)
        own.stop()
