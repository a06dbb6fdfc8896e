"""`gpud slurm health` (gpud/slurm/health.py): the pure parts (scontrol's node line, the reason, the
decision table, SLURM_JOB_GPUS and gres.conf), then the program against a real Slurm cluster
(tests/slurm_cluster.py) and a simulated gpud, run by hand and by slurmd itself."""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import socketserver
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from helpers import REPO, GpudProcess, cli, until
from slurm_cluster import SlurmCluster, need_slurm

from gpud.slurm.health import (DRAIN, LEAVE, NOTHING, RESUME, UPDATE, Problem, SlurmNode, decide, drain_reason,
                               gres_gpu_minors, job_gpu_indices, parse_job_gpus, parse_show_node, problems)

LINE = ("NodeName=vm Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 Gres=gpu:8 State={state} "
        "ThreadsPerCore=1 Partitions=gpu  BootTime=2026-11-25T22:39:54 SlurmdStartTime=2026-11-26T10:00:00 "
        "CfgTRES=cpu=2,mem=1M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 "
        "ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s{reason}\n")


def line(state: str, reason: str | None = None, stamp: str = " [root@2026-11-26T10:05:04]") -> str:
    return LINE.format(state=state, reason="" if reason is None else f" Reason={reason}{stamp}")


# -- parsing scontrol ---------------------------------------------------------------------------


def test_a_node_line_without_a_reason():
    assert parse_show_node(line("IDLE")) == SlurmNode("vm", "IDLE", None)


@pytest.mark.parametrize("reason", ["gpud: GPU 2 XID 79 (reboot)", "maintenance", "disk [sda] failing [ticket 7]",
                                    "a@b [x@y] odd"])
def test_a_reason_with_spaces_and_brackets_ends_at_its_stamp(reason):
    assert parse_show_node(line("IDLE+DRAIN", reason)).reason == reason


def test_newer_slurm_prints_fields_after_the_reason():
    text = line("MIXED+DRAIN", "maintenance").rstrip("\n") + " Comment=rack 4 Extra=x ReservationName=r1"
    node = parse_show_node(text)
    assert (node.state, node.reason, node.drained, node.drained_by_gpud) == ("MIXED+DRAIN", "maintenance", True, False)


def test_a_reason_without_a_stamp():
    assert parse_show_node(line("DOWN+DRAIN", "gpud: node: driver mismatch", stamp="")).reason == \
        "gpud: node: driver mismatch"


def test_an_unreadable_answer_is_an_error():
    with pytest.raises(ValueError):
        parse_show_node("Node nosuch not found\n")


# -- gpud's health as a reason ------------------------------------------------------------------


def reason(kind="xid", code="79", action="reboot", severity="unhealthy"):
    return {"kind": kind, "code": code, "message": "m", "severity": severity, "action": action}


def gpu(index, state="healthy", reasons=(), mig=()):
    return {"index": index, "uuid": f"GPU-{index}", "state": state, "reasons": list(reasons), "mig_devices": list(mig)}


def view(*gpus, node=None, subjects=()):
    return {"status": "x", "node": node or {"state": "healthy", "reasons": []}, "gpus": list(gpus),
            "subjects": list(subjects)}


def test_the_reason_names_gpu_xid_and_action():
    found = problems(view(gpu(0), gpu(2, "unhealthy", [reason()]), gpu(5, "unhealthy", [reason(code="48")])))
    assert drain_reason(found) == "gpud: GPU 2 XID 79 (reboot); GPU 5 XID 48 (reboot)"


def test_mig_devices_node_reasons_and_degraded():
    mig = {"uuid": "MIG-1", "profile": "1g.5gb", "gi_id": 9, "ci_id": 0, "state": "unhealthy",
           "reasons": [reason(code="94", action="restart-app")]}
    found = problems(view(gpu(3, mig=[mig]), gpu(4, "degraded", [reason("temperature", "slowdown", "none",
                                                                       "degraded")]),
                          node={"state": "unhealthy", "reasons": [reason("fabric-manager", "inactive", "reboot")]}))
    assert [(p.subject, p.state) for p in found] == [("node", "unhealthy"), ("GPU 3 MIG 1g.5gb", "unhealthy"),
                                                     ("GPU 4", "degraded")]
    unhealthy = [p for p in found if p.state == "unhealthy"]
    assert drain_reason(unhealthy) == "gpud: node: fabric manager inactive (reboot); GPU 3 MIG 1g.5gb XID 94 " \
                                      "(restart-app)"


def test_infiniband_ports_drain_only_when_asked():
    port = {"name": "ib:mlx5_0/1", "state": "unhealthy", "reasons": [reason("infiniband", "down", "inspect-hardware")]}
    assert problems(view(gpu(0), subjects=[port])) == []
    assert problems(view(gpu(0), subjects=[port]), include_infiniband=True)[0].subject == "ib:mlx5_0/1"


def test_quotes_and_newlines_from_gpud_do_not_reach_the_reason():
    found = problems(view(gpu(1, "unhealthy", [reason("xid", '79"\n; rm -rf /', "re'boot\r\n")])))
    text = drain_reason(found)
    assert "\n" not in text and '"' not in text and "'" not in text and text.startswith("gpud: GPU 1 XID 79")


def test_a_long_reason_is_cut():
    found = problems(view(*(gpu(i, "unhealthy", [reason(code=str(i) * 30)]) for i in range(8))))
    assert len(drain_reason(found)) == 200 and drain_reason(found).endswith("...")


@pytest.mark.parametrize("document", [[], {"gpus": "no"}, {"gpus": [{"state": "unhealthy"}]}, {"gpus": [1]}])
def test_a_document_that_is_not_gpuds_health_is_refused(document):
    with pytest.raises(ValueError):
        problems(document)


# -- the decision table -------------------------------------------------------------------------

SICK = [Problem("GPU 2", 2, "unhealthy", "XID 79 (reboot)")]
OURS = "gpud: GPU 2 XID 79 (reboot)"


@pytest.mark.parametrize("state, node_reason, sick, action", [
    ("IDLE", None, [], NOTHING),
    ("IDLE", None, SICK, DRAIN),
    ("MIXED", "Not responding", SICK, DRAIN),  # a reason on an undrained node is no one's drain
    ("IDLE+DRAIN", OURS, [], RESUME),
    ("MIXED+DRAIN", OURS, [], RESUME),  # draining: jobs go on, the drain goes
    ("IDLE+DRAIN", OURS, SICK, NOTHING),
    ("IDLE+DRAIN", "gpud: GPU 5 XID 48 (reboot)", SICK, UPDATE),
    ("IDLE+DRAIN", "maintenance", [], LEAVE),
    ("IDLE+DRAIN", "maintenance", SICK, LEAVE),
    ("MIXED+DRAIN", "maintenance", SICK, LEAVE),
    ("IDLE+DRAIN", None, SICK, LEAVE),
    ("IDLE+FAIL", "bad dimm", SICK, LEAVE),
    ("DOWN", "Not responding", SICK, LEAVE),
    ("DOWN", None, [], LEAVE),
    ("DOWN+DRAIN", "maintenance", [], LEAVE),
    ("DOWN+DRAIN", OURS, [], LEAVE),  # resume would also clear DOWN: Slurm's to decide
    ("DOWN+DRAIN", "gpud: GPU 5 XID 48 (reboot)", SICK, UPDATE),
])
def test_the_decision_table(state, node_reason, sick, action):
    decision = decide(SlurmNode("vm", state, node_reason), sick)
    assert decision.action == action, decision
    assert (decision.reason == OURS) == (action in (DRAIN, UPDATE))


# -- the job's GPUs -----------------------------------------------------------------------------


def test_slurm_job_gpus_are_gres_indices_mapped_through_gres_conf():
    conf = ("# comment\nNodeName=other Name=gpu File=/dev/nvidia9\n"
            "NodeName=vm[1-2],vm Name=gpu Type=a100 File=/dev/nvidia[4-5]\n"
            "Name=gpu Type=1g.5gb MultipleFiles=/dev/nvidia1,/dev/nvidia-caps/nvidia-cap[21-22]\n"
            "Name=shard Count=8 File=/dev/nvidia0\n")
    minors = gres_gpu_minors(conf, "vm")
    assert minors == [4, 5, 1]
    gpud_minors = {1: 0, 4: 2, 5: 3}  # gpud: {minor: index}
    assert job_gpu_indices(parse_job_gpus("0,2"), minors, gpud_minors) == {2, 0}
    assert job_gpu_indices([3], minors, gpud_minors) is None  # unmapped: every GPU is checked


@pytest.mark.parametrize("text", ["", "0,,1", "gpu:0", "0;rm"])
def test_slurm_job_gpus_must_be_numbers(text):
    with pytest.raises(ValueError):
        parse_job_gpus(text)


# -- against a real Slurm cluster and a simulated gpud ------------------------------------------


def run_health(cluster, socket, *args, env=None, timeout=60):
    command = [sys.executable, "-m", "gpud", "slurm", "health", "--socket", str(socket), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**cluster.env, **(env or {})})


@pytest.fixture(scope="module")
def cluster():
    need_slurm()
    running = SlurmCluster()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def gpud():
    work = Path(tempfile.mkdtemp(prefix="gsh", dir="/tmp"))
    process = GpudProcess(work, "--simulate", "dgx-a100", "--sim-state", str(work / "sim.json"))
    process.wait_healthy()
    yield process
    process.stop()
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def fresh(cluster, gpud):
    """No job, every GPU healthy and held by nothing, and the node idle and undrained, before and after each
    test (tests/test_slurm_remediation.py uses it with its own cluster and gpud)."""
    def reset():
        subprocess.run(["scancel", "-u", "root"], capture_output=True, env=cluster.env, timeout=30)
        for index in range(8):
            gpud.client.request("POST", "/v1/sim/holders", {"gpu": index, "release": True})
            gpud.client.request("POST", f"/v1/health/{index}/clear", {})
        if "DRAIN" in cluster.node_state():
            cluster.scontrol("update", f"nodename={cluster.node}", "state=resume")
        until(lambda: idle(cluster), 20, "node idle")
    reset()
    yield cluster, gpud
    reset()


def idle(cluster) -> bool:
    """Idle and not drained (slurmctld may flag NOT_RESPONDING for a moment on a loaded machine)."""
    return cluster.node_state().replace("+NOT_RESPONDING", "") == "IDLE"


def xid(gpud, index, number=79):
    gpud.client.request("POST", "/v1/sim/xid", {"gpu": index, "xid": number})
    gpud.wait_for(lambda: gpud.client.get("/v1/health")["gpus"][index]["state"] == "unhealthy", 10, "unhealthy")


def test_an_xid_drains_the_node_and_clearing_it_resumes(fresh):
    cluster, gpud = fresh
    quiet = run_health(cluster, gpud.socket)
    assert quiet.returncode == 0 and "decision: nothing" in quiet.stdout, quiet
    xid(gpud, 2)
    drained = run_health(cluster, gpud.socket)
    assert drained.returncode == 0, drained
    assert "decision: drain" in drained.stdout and "GPU 2 unhealthy: XID 79 (reboot)" in drained.stdout
    assert "DRAIN" in cluster.node_state()
    assert cluster.node_reason() == "gpud: GPU 2 XID 79 (reboot)"
    again = run_health(cluster, gpud.socket)
    assert again.returncode == 0 and "already drained by gpud" in again.stdout, again
    xid(gpud, 5, 48)
    updated = run_health(cluster, gpud.socket)
    assert "decision: update-reason" in updated.stdout, updated
    assert cluster.node_reason().startswith("gpud: GPU 2 XID 79 (reboot); GPU 5 XID 48")
    for index in (2, 5):
        assert cli("health", "clear", str(index), socket=gpud.socket).returncode == 0
    resumed = run_health(cluster, gpud.socket)
    assert resumed.returncode == 0 and "decision: resume" in resumed.stdout, resumed
    assert idle(cluster)


def test_an_operator_drain_is_never_touched(fresh):
    cluster, gpud = fresh
    cluster.scontrol("update", f"nodename={cluster.node}", "state=drain", "reason=maintenance")
    healthy = run_health(cluster, gpud.socket)
    assert healthy.returncode == 0 and "decision: leave" in healthy.stdout, healthy
    xid(gpud, 2)
    sick = run_health(cluster, gpud.socket)
    assert sick.returncode == 0 and "decision: leave" in sick.stdout and "maintenance" in sick.stdout, sick
    # NOT_RESPONDING aside: slurmctld sets and clears it by itself on a busy machine (it flaked the full suite)
    assert (cluster.node_state().replace("+NOT_RESPONDING", ""), cluster.node_reason()) == ("IDLE+DRAIN", "maintenance")


def test_dry_run_prints_the_command_and_changes_nothing(fresh):
    cluster, gpud = fresh
    xid(gpud, 2)
    dry = run_health(cluster, gpud.socket, "--dry-run")
    assert dry.returncode == 0, dry
    assert f'would run: scontrol update nodename={cluster.node} state=drain "reason=gpud: GPU 2 XID 79 (reboot)"' \
        in dry.stdout
    assert idle(cluster)


def test_gpud_unreachable_fails_and_leaves_the_node(fresh, tmp_path):
    cluster, gpud = fresh
    xid(gpud, 2)
    assert run_health(cluster, gpud.socket).returncode == 0
    gone = run_health(cluster, tmp_path / "none.sock")
    assert gone.returncode == 3 and gone.stdout == "", gone
    assert gone.stderr.startswith("gpud slurm health: gpud is not running: no socket at") and \
        gone.stderr.count("\n") == 1
    assert cluster.node_reason() == "gpud: GPU 2 XID 79 (reboot)" and "DRAIN" in cluster.node_state()


def test_scontrol_failures_have_their_own_exit_code(fresh):
    cluster, gpud = fresh
    unknown = run_health(cluster, gpud.socket, "--node-name", "nosuch")
    assert unknown.returncode == 5 and "Node nosuch not found" in unknown.stderr, unknown
    missing = run_health(cluster, gpud.socket, "--scontrol", "/nonexistent/scontrol")
    assert missing.returncode == 5 and "scontrol not found" in missing.stderr, missing


class _FakeGpud(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@contextlib.contextmanager
def answering_gpud(answer):
    """A socket whose every GET and POST is answered by answer(handler) (gpud gone wrong); yields its path."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            try:
                answer(self)
            except OSError:  # the client hung up on an answer it would not read whole
                pass

        do_POST = do_GET

        def log_message(self, *args):
            pass

    directory = Path(tempfile.mkdtemp(prefix="gsf", dir="/tmp"))
    server = _FakeGpud(str(directory / "f.sock"), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield directory / "f.sock"
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(directory, ignore_errors=True)


def send(handler, status: int, body: bytes, length: int | None = None) -> None:
    """An answer of status and body, its Content-Length saying length (default: the body's)."""
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body) if length is None else length))
    handler.end_headers()
    handler.wfile.write(body)


def fake_gpud(status: int, body: bytes):
    """A socket answering every request with status and body; yields its path."""
    return answering_gpud(lambda handler: send(handler, status, body))


@pytest.mark.parametrize("status, body", [(500, b'{"error": {"code": "internal", "message": "boom"}}'),
                                          (200, b"<html>garbage"), (200, b'{"gpus": "none"}')])
def test_gpud_answering_garbage_leaves_the_node(cluster, status, body):
    with fake_gpud(status, body) as path:
        before = cluster.show_node()
        result = run_health(cluster, path)
        assert result.returncode == 4 and result.stderr.count("\n") == 1, result
        # the state is unchanged, but for NOT_RESPONDING, which slurmctld sets and clears by itself on a busy machine
        state = lambda line: line.split("State=")[1].split()[0].replace("+NOT_RESPONDING", "")  # noqa: E731
        assert idle(cluster) and state(cluster.show_node()) == state(before)


def test_a_hostile_reason_from_gpud_is_one_safe_argument(fresh):
    cluster, _gpud = fresh
    document = view(gpu(0), gpu(2, "unhealthy", [reason("xid", '79"; scontrol delete\nx', "reboot'`$(id)`")]))
    with fake_gpud(200, json.dumps(document).encode()) as path:
        result = run_health(cluster, path)
        assert result.returncode == 0, result
        assert "DRAIN" in cluster.node_state()
        assert cluster.node_reason() == "gpud: GPU 2 XID 79 ; scontrol delete x (reboot (id))"


def test_prolog_refuses_a_job_on_a_sick_gpu_and_drains_first(fresh):
    cluster, gpud = fresh
    xid(gpud, 2)
    sick = run_health(cluster, gpud.socket, "--prolog", env={"SLURM_JOB_GPUS": "2"})
    assert sick.returncode == 1, sick
    assert "refusing the job" in sick.stderr and "GPU 2 XID 79 (reboot)" in sick.stderr
    assert "job's GPUs (SLURM_JOB_GPUS=2) are gpud's GPU 2" in sick.stdout
    assert cluster.node_reason() == "gpud: GPU 2 XID 79 (reboot)"
    healthy = run_health(cluster, gpud.socket, "--prolog", env={"SLURM_JOB_GPUS": "0,1"})
    assert healthy.returncode == 0 and "the job's GPUs are healthy" in healthy.stdout, healthy
    every = run_health(cluster, gpud.socket, "--prolog", env={"SLURM_JOB_GPUS": ""})
    assert every.returncode == 1 and "checking every GPU" in every.stdout, every
    bad = run_health(cluster, gpud.socket, "--prolog", env={"SLURM_JOB_GPUS": "0;x"})
    assert bad.returncode == 2, bad


def wrapper(directory: Path, socket: Path, *args: str) -> Path:
    """A script slurmd runs (with an environment of its own making): gpud's program, and its env saved."""
    script = directory / f"hc{len(args)}.sh"
    name = script.stem
    script.write_text(f"#!/bin/sh\nenv > {directory}/{name}.env\nexport SLURM_CONF={directory}/slurm.conf\n"
                      f"exec {sys.executable} -m gpud slurm health --socket {socket} {' '.join(args)} "
                      f">> {directory}/{name}.out 2>&1\n")
    script.chmod(0o755)
    return script


def test_slurmd_runs_it_as_its_health_check_program(fresh):
    cluster, gpud = fresh
    script = wrapper(cluster.dir, gpud.socket)
    try:
        cluster.set_extra_conf(f"HealthCheckProgram={script}\nHealthCheckInterval=1\nHealthCheckNodeState=ANY")
        until(lambda: (cluster.dir / "hc0.out").exists(), 20, "slurmd to run the health check", interval=0.1)
        xid(gpud, 2)
        until(lambda: cluster.node_reason() == "gpud: GPU 2 XID 79 (reboot)", 20,
              f"slurmd's health check to drain the node ({cluster.show_node()})", interval=0.2)
        assert cli("health", "clear", "2", socket=gpud.socket).returncode == 0
        until(lambda: idle(cluster), 20, "slurmd's health check to resume the node", interval=0.2)
        env = (cluster.dir / "hc0.env").read_text()
        assert f"SLURMD_NODENAME={cluster.node}\n" in env  # slurmd.c run_script_health_check sets it
    finally:
        cluster.set_extra_conf("")


def test_slurmd_runs_it_as_the_prolog_of_a_job_on_a_sick_gpu(fresh):
    cluster, gpud = fresh
    script = wrapper(cluster.dir, gpud.socket, "--prolog")
    try:
        cluster.set_extra_conf(f"Prolog={script}")
        xid(gpud, 0)  # the first free gpu gres (index 0, /dev/nvidia0) is what the job gets
        submitted = subprocess.run(["sbatch", "--parsable", "--gres=gpu:1", "-o", "/dev/null", "--wrap", "true"],
                                   capture_output=True, text=True, env=cluster.env, timeout=30)
        assert submitted.returncode == 0, submitted
        job = submitted.stdout.strip().split(";")[0]
        until(lambda: (cluster.dir / "hc1.out").exists() and "refusing" in (cluster.dir / "hc1.out").read_text(),
              20, "slurmd to run the prolog", interval=0.1)
        # The prolog drained first, so slurmctld keeps gpud's reason (no "Prolog error": node_mgr.c
        # validate_node_specs drains for ESLURMD_PROLOG_FAILED only a node not drained yet).
        until(lambda: "DRAIN" in cluster.node_state(), 20, "the node drained", interval=0.2)
        assert cluster.node_reason() == "gpud: GPU 0 XID 79 (reboot)"
        assert "SLURM_JOB_GPUS=0\n" in (cluster.dir / "hc1.env").read_text()
        # slurmctld requeues the job and holds it (22.05: "launch_failed_requeued_held"), once slurmd's
        # report of the failed prolog reached it: the job shows RUNNING until then.
        def held() -> str | None:
            shown = cluster.scontrol("show", "job", job).stdout
            return shown if "JobState=PENDING" in shown and "requeued_held" in shown else None
        until(held, 30, "the job requeued and held", interval=0.2)
    finally:
        subprocess.run(["scancel", "-u", "root"], capture_output=True, env=cluster.env, timeout=30)
        cluster.set_extra_conf("")


def test_every_kind_of_health_reason_has_its_words():
    from gpud.cli.health import HEALTH_REASON_KINDS
    from gpud.slurm.health import KIND_TEXT

    assert set(HEALTH_REASON_KINDS) <= set(KIND_TEXT)
