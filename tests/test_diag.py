"""The active check (gpud check): DCGM's diagnostic run through dcgmi, read back, kept, and served.

dcgmi itself cannot run here (no GPU, no DCGM): tests/dcgmi_stand_in.py stands in for it, copying DCGM 4's
command line, JSON and exit codes from its source; what it finds is set per test (DCGMI_STAND_IN_MODE)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from helpers import REPO

from gpud.api.auth import ADMIN_POLICY, AdminPolicy
from gpud.api.check import CheckRoutes
from gpud.api.errors import ErrorTableRouter
from gpud.base.errors import ErrorKind, GpudError
from gpud.health import diag
from gpud.health.active_check import DiagStore
from gpud.health.diag import DiagRun, DiagTest, find_dcgmi, run_diag
from gpud.health.diag_verdicts import diag_problems

STAND_IN = REPO / "tests" / "dcgmi_stand_in.py"


@pytest.fixture
def dcgmi(tmp_path, monkeypatch):
    """The stand-in installed as `dcgmi` in a directory of its own (so a test can find it on PATH, and
    find its processes by that path), recording each command line it gets."""
    directory = tmp_path / "bin"
    directory.mkdir()
    path = directory / "dcgmi"
    shutil.copy(STAND_IN, path)
    path.chmod(0o755)
    monkeypatch.setenv("DCGMI_STAND_IN_ARGS", str(tmp_path / "args"))
    monkeypatch.setenv("DCGMI_STAND_IN_MODE", "pass")
    return path


def recorded_args(tmp_path: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "args").read_text().splitlines()]


def stand_in(*args: str, mode: str = "pass") -> subprocess.CompletedProcess:
    env = dict(os.environ, DCGMI_STAND_IN_MODE=mode)
    return subprocess.run([sys.executable, str(STAND_IN), *args], capture_output=True, text=True, env=env, timeout=30)


def processes_running(path: Path) -> list[int]:
    running = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    running.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
    return running


# -- the stand-in is as strict as dcgmi ------------------------------------------------------------


def test_stand_in_refuses_an_unknown_flag_as_tclap_does():
    done = stand_in("diag", "-r", "1", "--no-such-flag")
    assert done.returncode == 1
    assert done.stderr.startswith("PARSE ERROR: Argument: --no-such-flag\n             Couldn't find match")


@pytest.mark.parametrize("args, error", [
    (["-r", "5"], "Error: Invalid value '5' specified for -r.."),
    (["-r", "1", "--iterations", "0"], "Error: The value for iterations cannot be 0.."),
    (["-r", "1", "-i", "0", "--gpuList", "0"], "Error: Specifying a entity id and a gpu list are mutually exclusive."),
])
def test_stand_in_refuses_what_dcgmi_refuses_after_parsing(args, error):
    done = stand_in("diag", *args)
    assert done.returncode == 254  # main returns -2 when the command line threw
    assert done.stderr.splitlines() == [error, "An error occurred trying to parse the command line."]


def test_stand_in_wants_a_value_and_a_number_where_dcgmi_does():
    assert "Missing a value" in stand_in("diag", "-r").stderr
    assert stand_in("diag", "-r", "1", "--iterations", "two").returncode == 1


def test_stand_in_writes_dcgm_4_json_and_its_exit_codes():
    done = stand_in("diag", "-r", "2", "-j", "-i", "0,1", mode="fail-memory")
    assert done.returncode == 205  # DCGM_ST_NVVS_ISOLATE_ERROR (-51)
    document = json.loads(done.stdout)
    assert [c["category"] for c in document["DCGM Diagnostic"]["test_categories"]] == \
        ["Deployment", "Integration", "Hardware"]
    assert document["metadata"]["version"]
    memory = document["DCGM Diagnostic"]["test_categories"][2]["tests"][0]
    assert memory["name"] == "memory" and memory["test_summary"] == {"status": "Fail"}
    assert memory["results"][0]["warnings"][0]["error_id"] == 52  # DCGM_FR_FAULTY_MEMORY
    assert stand_in("diag", "-r", "1", "-j").returncode == 0


# -- run_diag ----------------------------------------------------------------------------------------


async def test_a_passing_run_reads_every_test_of_every_gpu(dcgmi, tmp_path):
    run = await run_diag(str(dcgmi), 2, [0, 1], timeout_s=30)
    assert (run.outcome, run.exit_code, run.error) == ("pass", 0, None)
    assert {(t.name, t.gpu_index) for t in run.tests} == {(name, gpu) for name in ("software", "pcie", "memory")
                                                         for gpu in (0, 1)}
    assert recorded_args(tmp_path) == [["diag", "-r", "2", "-j", "-i", "0,1"]]
    assert run.command == (str(dcgmi), "diag", "-r", "2", "-j", "-i", "0,1")
    assert json.loads(run.output)["metadata"]["version"]
    assert diag_problems(run) == {0: None, 1: None}


async def test_level_1_runs_the_deployment_test_and_no_gpu_list_means_all(dcgmi, tmp_path):
    run = await run_diag(str(dcgmi), 1, [], timeout_s=30)
    assert recorded_args(tmp_path) == [["diag", "-r", "1", "-j"]]
    assert {t.name for t in run.tests} == {"software"} and run.outcome == "pass"


async def test_a_memory_failure_is_unhealthy_and_wants_the_hardware_looked_at(dcgmi, monkeypatch):
    monkeypatch.setenv("DCGMI_STAND_IN_MODE", "fail-memory")
    run = await run_diag(str(dcgmi), 2, [0, 1], timeout_s=30)
    assert (run.outcome, run.exit_code) == ("fail", 205)
    failed = [t for t in run.tests if t.result == "fail"]
    assert [(t.name, t.gpu_index) for t in failed] == [("memory", 0)]
    assert "faulty memory" in failed[0].info
    problems = diag_problems(run)
    assert problems[1] is None
    assert problems[0][:2] == ("unhealthy", "inspect-hardware") and "memory" in problems[0][2]


async def test_a_pcie_warning_is_degraded_not_unhealthy(dcgmi, monkeypatch):
    monkeypatch.setenv("DCGMI_STAND_IN_MODE", "warn-pcie")
    run = await run_diag(str(dcgmi), 2, [0, 1], timeout_s=30)
    assert (run.outcome, run.exit_code) == ("warn", 226)
    assert [(t.name, t.gpu_index) for t in run.tests if t.result == "warn"] == [("pcie", 1)]
    problems = diag_problems(run)
    assert problems[0] is None and problems[1][:2] == ("degraded", "none")
    assert "link generation" in problems[1][2]


async def test_no_host_engine_is_an_error_that_quotes_dcgm(dcgmi, monkeypatch):
    monkeypatch.setenv("DCGMI_STAND_IN_MODE", "no-hostengine")
    run = await run_diag(str(dcgmi), 1, [0], timeout_s=30)
    assert (run.outcome, run.exit_code, run.tests) == ("error", 249, ())
    assert "Unable to start an embedded host engine" in run.error and "249" in run.error
    assert "embedded host engine" in run.output
    assert diag_problems(run) == {}  # no verdict on any GPU from a run that did not happen


async def test_a_hanging_dcgmi_is_killed_with_its_group_at_the_timeout(dcgmi, monkeypatch):
    monkeypatch.setenv("DCGMI_STAND_IN_MODE", "hang")
    started = time.monotonic()
    run = await run_diag(str(dcgmi), 2, [0], timeout_s=1)
    assert time.monotonic() - started < 15
    assert (run.outcome, run.exit_code) == ("error", None)
    assert "did not finish within 1 s" in run.error and "killed" in run.error
    assert processes_running(dcgmi) == []


async def test_garbage_output_is_an_error_and_kept(dcgmi, monkeypatch):
    monkeypatch.setenv("DCGMI_STAND_IN_MODE", "garbage")
    run = await run_diag(str(dcgmi), 1, [0], timeout_s=30)
    assert (run.outcome, run.exit_code) == ("error", 0)
    assert "not the JSON" in run.error and "Segmentation fault" in run.error
    assert "Segmentation fault" in run.output


async def test_truncated_json_is_an_error_and_kept(dcgmi, monkeypatch):
    monkeypatch.setenv("DCGMI_STAND_IN_MODE", "truncated")
    run = await run_diag(str(dcgmi), 2, [0, 1], timeout_s=30)
    assert run.outcome == "error" and "not the JSON" in run.error
    assert run.output.startswith('{\n   "DCGM Diagnostic"')


async def test_json_that_is_not_dcgms_document_is_an_error(dcgmi, monkeypatch):
    monkeypatch.setenv("DCGMI_STAND_IN_MODE", "garbage")
    monkeypatch.setenv("DCGMI_STAND_IN_GARBAGE", '{"DCGM Diagnostic": {"test_categories": [{"tests": [{}]}]}}')
    run = await run_diag(str(dcgmi), 1, [0], timeout_s=30)
    assert run.outcome == "error" and "not DCGM's diagnostic document" in run.error


async def test_huge_output_is_bounded_and_says_it_was_cut(dcgmi, monkeypatch):
    monkeypatch.setenv("DCGMI_STAND_IN_MODE", "huge")
    monkeypatch.setenv("DCGMI_STAND_IN_HUGE_BYTES", str(2 * 1024 * 1024))
    run = await run_diag(str(dcgmi), 2, [0, 1], timeout_s=60)
    assert run.outcome == "error" and "more than 262144 bytes" in run.error
    assert len(run.output.encode()) < diag.MAX_OUTPUT_BYTES + 300
    assert "[gpud: output cut at 262144 bytes]" in run.output


async def test_a_refusal_in_dcgms_json_is_an_error_naming_it(dcgmi, monkeypatch):
    monkeypatch.setenv("DCGMI_STAND_IN_GPUS", "1")  # GPU 3 is not on this node
    run = await run_diag(str(dcgmi), 1, [0, 3], timeout_s=30)
    assert (run.outcome, run.exit_code) == ("error", 255)
    assert "DCGM could not run the diagnostic" in run.error and "entity id '3'" in run.error


async def test_missing_dcgmi_says_what_gpud_would_have_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_dcgmi() is None
    assert find_dcgmi(str(tmp_path / "dcgmi")) is None
    run = await run_diag(find_dcgmi(), 2, [0, 1], timeout_s=30)
    assert (run.outcome, run.exit_code, run.tests) == ("unavailable", None, ())
    assert run.error == ("DCGM is not installed (dcgmi not found): gpud would have run dcgmi diag -r 2 -j -i 0,1; "
                         "install datacenter-gpu-manager and start nvidia-dcgm")


def test_find_dcgmi_takes_the_configured_path_else_path(dcgmi, monkeypatch):
    monkeypatch.setenv("PATH", str(dcgmi.parent))
    assert find_dcgmi() == str(dcgmi)
    assert find_dcgmi(str(dcgmi)) == str(dcgmi)


async def test_a_dcgmi_that_cannot_start_is_an_error(tmp_path):
    not_executable = tmp_path / "dcgmi"
    not_executable.write_text("#!/bin/sh\n")
    os.chmod(not_executable, 0o644)
    run = await run_diag(str(not_executable), 1, [0], timeout_s=30)
    assert run.outcome == "error" and "could not start" in run.error


async def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError):
        await run_diag("dcgmi", 3, [0], timeout_s=1)


def test_iterations_documents_are_read_whole():
    done = stand_in("diag", "-r", "1", "-j", "-i", "0", "--iterations", "2")
    tests, runtime_error = diag._tests_of(json.loads(done.stdout))
    assert runtime_error is None and [(t.name, t.gpu_index) for t in tests] == [("software", 0)] * 2


# -- diag_problems ----------------------------------------------------------------------------------


def _run(*tests: DiagTest, outcome: str = "fail") -> DiagRun:
    return DiagRun(2, ("dcgmi",), 0.0, 1.0, 226, outcome, tests, None, "")


def test_a_failure_of_no_one_gpu_is_every_gpus_and_software_wants_no_gpu_action():
    problems = diag_problems(_run(DiagTest("software", 0, "pass", ""), DiagTest("software", 1, "pass", ""),
                                  DiagTest("software", None, "fail", "Persistence mode for GPU 0 is disabled.",
                                           severity=2, category=3)))
    assert {gpu: p[:2] for gpu, p in problems.items()} == {0: ("unhealthy", "none"), 1: ("unhealthy", "none")}


def test_a_reset_severity_asks_for_a_gpu_reset_and_the_worst_finding_wins():
    problems = diag_problems(_run(DiagTest("pcie", 0, "warn", "slow link", severity=1),
                                  DiagTest("diagnostic", 0, "fail", "XID", severity=6)))
    assert problems[0][:2] == ("unhealthy", "reset-gpu")


def test_a_run_without_results_has_no_verdict():
    assert diag_problems(_run(outcome="error")) == {}
    assert diag_problems(_run(outcome="unavailable")) == {}


# -- DiagStore ----------------------------------------------------------------------------------------


async def test_the_last_run_survives_a_restart(dcgmi, tmp_path, monkeypatch):
    monkeypatch.setenv("DCGMI_STAND_IN_MODE", "fail-memory")
    run = await run_diag(str(dcgmi), 2, [0, 1], timeout_s=30)
    path = tmp_path / "state" / "check.json"
    assert DiagStore(path).last() is None
    DiagStore(path).save(run)
    assert DiagStore(path).last() == json.loads(json.dumps(run.as_dict()))
    assert DiagStore(path).last()["outcome"] == "fail"


@pytest.mark.parametrize("text", ['{"outcome": "pass"', "[1, 2]", '{"outcome": "pass"}'])
def test_a_corrupt_last_run_is_none_and_kept_aside(tmp_path, text):
    path = tmp_path / "check.json"
    path.write_text(text)
    assert DiagStore(path).last() is None
    assert (tmp_path / "check.json.corrupt").read_text() == text


# -- CheckRoutes -------------------------------------------------------------------------------------


class Check:
    """run_check and last as gpud passes them, recording what the route asked."""

    def __init__(self):
        self.asked: list[tuple[int, bool]] = []
        self.document: dict | None = None
        self.busy = False

    async def run(self, level: int, force: bool) -> dict:
        self.asked.append((level, force))
        if self.busy and not force:
            raise GpudError(ErrorKind.CONFLICT, "gpus-busy", "GPU 0 runs compute processes (pid 4242 python); "
                            "pass force to check anyway", gpus={"0": [4242]})
        self.document = {"level": level, "outcome": "pass"}
        return self.document


async def _serve(site_of, check: Check):
    app = web.Application()
    app.router.__class__ = ErrorTableRouter  # as gpud's own router: its routes answer GpudErrors by the table
    app[ADMIN_POLICY] = AdminPolicy("gpud-admin")
    CheckRoutes(check.run, lambda: check.document, body_timeout_s=5).register(app)
    runner = web.AppRunner(app)
    await runner.setup()
    await site_of(runner).start()
    return runner


async def test_check_routes_over_the_unix_socket(short_tmp):
    check = Check()
    socket = short_tmp / "api.sock"
    runner = await _serve(lambda r: web.UnixSite(r, str(socket)), check)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket))) as http:
            async def call(method, path, body=None):
                async with http.request(method, f"http://gpud{path}", json=body) as response:
                    return response.status, await response.json()

            assert await call("GET", "/v1/check/last") == (404, {"error": {
                "code": "no-check-yet",
                "message": "no check has run on this node yet: POST /v1/check (gpud check) runs one"}})
            assert await call("POST", "/v1/check") == (200, {"level": 1, "outcome": "pass"})
            assert await call("POST", "/v1/check", {"level": 2, "force": True}) == (200, {"level": 2, "outcome": "pass"})
            assert await call("GET", "/v1/check/last") == (200, {"level": 2, "outcome": "pass"})
            for body, code in [({"level": 3}, "invalid-field"), ({"level": "2"}, "invalid-field"),
                               ({"force": "yes"}, "invalid-field"), ({"levle": 2}, "unknown-field")]:
                status, answer = await call("POST", "/v1/check", body)
                assert (status, answer["error"]["code"]) == (400, code), body
            check.busy = True
            status, answer = await call("POST", "/v1/check", {"level": 1})
            assert status == 409 and answer["error"]["code"] == "gpus-busy"
            assert "force" in answer["error"]["message"] and answer["error"]["gpus"] == {"0": [4242]}
            assert check.asked == [(1, False), (2, True), (1, False)]
    finally:
        await runner.cleanup()


async def test_running_a_check_needs_an_admin_reading_the_last_does_not():
    # Over TCP gpud knows no peer credentials: admin_only must refuse it, as it refuses a non-admin user.
    check = Check()
    check.document = {"level": 1, "outcome": "pass"}
    runner = await _serve(lambda r: web.TCPSite(r, "127.0.0.1", 0), check)
    try:
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/check", json={}) as response:
                assert response.status == 403 and (await response.json())["error"]["code"] == "forbidden"
            async with http.get(f"http://127.0.0.1:{port}/v1/check/last") as response:
                assert response.status == 200
        assert check.asked == []
    finally:
        await runner.cleanup()
