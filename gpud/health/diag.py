"""The active check: DCGM's diagnostic (`dcgmi diag -r 1|2 -j`), run on demand and read back into per-test
results (gpud.health.diag_verdicts says what they mean for each GPU, gpud.health.active_check keeps the
last run for `gpud check --last`).

What dcgmi prints and how it exits is DCGM 4's (NVIDIA/DCGM on GitHub), read from its source:
- dcgmi/Diag.cpp, Diag::HelperJsonBuildOutput and HelperJsonAddResult: the JSON document, whose names are
  nvvs/include/NvvsJsonStrings.h's ("DCGM Diagnostic" > "test_categories" > "category", "tests" > "name",
  "results" > "entity_group", "entity_id", "status", "warnings" > "warning", "error_id", "error_category",
  "error_severity"; "info"; "test_summary");
- Diag::HelperDisplayDiagResult: "Pass", "Skip", "Fail" (a DCGM_DIAG_RESULT_WARN is written "Fail" in JSON:
  only the table view says "Warn"), so a warning is told from a failure by its error_severity;
- Diag::HelperDisplayFailureMessage: a run that could not complete is {"DCGM Diagnostic": {"version",
  "runtime_error"}};
- Diag::RunStartDiag: with --iterations N > 1 the document is {"iterations": [...], "Overall Result"};
- dcgmi/main_dcgmi.cpp: the exit status is the dcgmReturn_t (dcgm_structs.h) as a byte: 0 ok,
  226 DCGM_ST_NVVS_ERROR (-30), 205 DCGM_ST_NVVS_ISOLATE_ERROR (-51), 254 a rejected command line (-2),
  1 a TCLAP parse error (dcgmi/NvcmTCLAP.h DCGMOutput::failure).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from gpud.base import bounded_json, child
from gpud.base.logs import get_logger

log = get_logger("diag")

LEVELS = (1, 2)
MAX_OUTPUT_BYTES = 256 * 1024
INSTALL_HINT = "install datacenter-gpu-manager and start nvidia-dcgm"

# dcgm_structs.h dcgmReturn_t, as the byte a process exits with (main_dcgmi.cpp returns the enum from main).
EXIT_MEANINGS = {
    0: "success",
    1: "dcgmi rejected its command line (usage error)",
    254: "dcgmi rejected its command line",
    255: "DCGM_ST_BADPARAM: bad parameter",
    226: "DCGM_ST_NVVS_ERROR: the diagnostic ran and reported an error",
    205: "DCGM_ST_NVVS_ISOLATE_ERROR: the diagnostic reported an error that needs the GPU drained",
    249: "DCGM_ST_INIT_ERROR: DCGM could not initialize (no host engine, and no embedded one)",
    235: "DCGM_ST_CONNECTION_NOT_VALID: no connection to the host engine",
    245: "DCGM_ST_TIMEOUT",
    217: "DCGM_ST_DIAG_ALREADY_RUNNING: another diagnostic is running",
    215: "DCGM_ST_DIAG_BAD_LAUNCH: DCGM could not launch the diagnostic",
    204: "DCGM_ST_NVVS_BINARY_NOT_FOUND: nvvs is not installed",
    203: "DCGM_ST_NVVS_KILLED: the diagnostic was killed",
    202: "DCGM_ST_PAUSED: DCGM is paused",
}
FAILED_EXITS = (226, 205)

# dcgm_errors.h dcgmErrorSeverity_t
SEVERITY_MONITOR, SEVERITY_ISOLATE, SEVERITY_CONFIG, SEVERITY_RESET = 1, 2, 5, 6
@dataclass(frozen=True)
class DiagTest:
    name: str              # DCGM's test (plugin) name: "software", "pcie", "memory", ...
    gpu_index: int | None  # None for a result not of one GPU (the test's summary, a CPU)
    result: str            # "pass" | "fail" | "warn" | "skip"
    info: str              # DCGM's warning and info text, trimmed
    severity: int | None = None  # worst error_severity DCGM gave (dcgmErrorSeverity_t), None without errors
    category: int | None = None  # that error's error_category (dcgmErrorCategory_t)


@dataclass(frozen=True)
class DiagRun:
    level: int
    command: tuple[str, ...]
    started_at: float
    finished_at: float
    exit_code: int | None      # None: it could not run, or was killed at its timeout
    outcome: str               # "pass" | "fail" | "warn" | "error" | "unavailable"
    tests: tuple[DiagTest, ...]
    error: str | None          # why it could not run or be read
    output: str                # dcgmi's stdout then stderr, at most MAX_OUTPUT_BYTES (a last line says when cut)

    def as_dict(self) -> dict:
        document = asdict(self)
        document["command"] = list(self.command)
        document["tests"] = [asdict(test) for test in self.tests]
        return document


def find_dcgmi(path: str | None = None) -> str | None:
    """The configured dcgmi when it is an executable file, else dcgmi on PATH; None without DCGM."""
    if path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which("dcgmi")


def diag_command(dcgmi: str, level: int, gpu_indices: Sequence[int]) -> tuple[str, ...]:
    command = (dcgmi, "diag", "-r", str(level), "-j")
    # -i/--entity-id (CommandLineParser.cpp ProcessDiagCommandLine); without it dcgmi takes "*,cpu:*"
    return command + (("-i", ",".join(str(index) for index in gpu_indices)) if gpu_indices else ())


async def run_diag(dcgmi: str | None, level: int, gpu_indices: Sequence[int], *, timeout_s: float) -> DiagRun:
    """Runs dcgmi's diagnostic at `level` on `gpu_indices` (all when empty) and reads its JSON. Never raises
    for what dcgmi does: a missing dcgmi, one that cannot start, hangs, exits non-zero or prints what is
    not its JSON is a DiagRun saying so, its output kept."""
    if level not in LEVELS:
        raise ValueError(f"diag level must be one of {LEVELS}, got {level!r}")
    started = time.time()
    if dcgmi is None:
        would = " ".join(diag_command("dcgmi", level, gpu_indices))
        return DiagRun(level, (), started, started, None, "unavailable", (),
                       f"DCGM is not installed (dcgmi not found): gpud would have run {would}; {INSTALL_HINT}", "")
    command = diag_command(dcgmi, level, gpu_indices)
    try:
        run = await child.run(command, timeout_s=timeout_s, output_cap=MAX_OUTPUT_BYTES)
    except OSError as exc:
        return DiagRun(level, command, started, time.time(), None, "error", (),
                       f"could not start {dcgmi}: {exc.strerror or exc}", "")
    if run.timed_out:
        return DiagRun(level, command, started, time.time(), None, "error", (),
                       f"dcgmi diag -r {level} did not finish within {timeout_s:g} s; gpud killed it and its "
                       f"process group", _output(run))
    if run.overflowed:  # the rest is not read: a dcgmi that floods is ended, not drained for hours
        return DiagRun(level, command, started, time.time(), None, "error", (),
                       f"dcgmi diag printed more than {MAX_OUTPUT_BYTES} bytes; gpud stopped reading and killed "
                       "it, its JSON unread", _output(run))
    return _read_run(level, command, started, time.time(), run.exit_code, run)


def _output(run: child.ChildRun) -> str:
    text = run.text()
    return text + (f"\n[gpud: output cut at {MAX_OUTPUT_BYTES} bytes]" if run.overflowed else "")


def _read_run(level: int, command: tuple[str, ...], started: float, finished: float, exit_code: int,
              run: child.ChildRun) -> DiagRun:
    output = _output(run)
    meaning = EXIT_MEANINGS.get(exit_code, "an exit status dcgmi does not document")
    said = _first_line(output)

    def error_run(why: str) -> DiagRun:
        return DiagRun(level, command, started, finished, exit_code, "error", (), why, output)

    try:
        document = bounded_json.loads(run.stdout, what="dcgmi diag's JSON")
    except ValueError as exc:
        return error_run(f"dcgmi diag exited {exit_code} ({meaning}) and its output is not the JSON -j asks for "
                         f"({exc}): {said or 'it printed nothing'}")
    try:
        tests, runtime_error = _tests_of(document)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        return error_run(f"dcgmi diag's JSON is not DCGM's diagnostic document ({type(exc).__name__}: {exc}); "
                         f"exit status {exit_code} ({meaning})")
    if runtime_error is not None:
        return error_run(f"DCGM could not run the diagnostic (exit status {exit_code}: {meaning}): "
                         f"{runtime_error.strip()}")
    if not tests:
        return error_run(f"dcgmi diag reported no test results (exit status {exit_code}: {meaning})")
    results = {test.result for test in tests}
    outcome = "fail" if "fail" in results else "warn" if "warn" in results else "pass"
    error = None
    if exit_code in FAILED_EXITS and outcome == "pass":
        outcome, error = "fail", f"dcgmi diag exited {exit_code} ({meaning}) though every test result passed"
    elif exit_code not in (0, *FAILED_EXITS):
        outcome, error = "error", f"dcgmi diag exited {exit_code} ({meaning}): {said}"
    return DiagRun(level, command, started, finished, exit_code, outcome, tuple(tests), error, output)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]


def _tests_of(document: Any) -> tuple[list[DiagTest], str | None]:
    """The test results in dcgmi's JSON, and its runtime_error when it has one. --iterations documents
    hold one diagnostic document per iteration: each iteration's results are kept."""
    if not isinstance(document, dict):
        raise TypeError(f"a JSON {type(document).__name__}, not an object")
    if "iterations" in document:
        tests: list[DiagTest] = []
        for iteration in document["iterations"]:
            found, runtime_error = _tests_of(iteration)
            if runtime_error is not None:
                return tests, runtime_error
            tests += found
        return tests, None
    diagnostic = document["DCGM Diagnostic"]
    if "runtime_error" in diagnostic:
        return [], str(diagnostic["runtime_error"])
    tests = []
    for category in diagnostic["test_categories"]:
        for test in category.get("tests", []):
            tests += _test_results(str(test["name"]), test)
    return tests, None


def _test_results(name: str, test: dict) -> list[DiagTest]:
    found = []
    for result in test.get("results", []):
        if result.get("entity_group") == "GPU":
            found.append(_diag_test(name, int(result["entity_id"]), result))
        elif "entity_group" in result:  # a CPU (CPU EUD): not a GPU's, named so it is not lost
            found.append(_diag_test(f"{name} ({result['entity_group']} {result.get('entity_id')})", None, result))
    summary = test.get("test_summary")
    # the summary carries the errors of no entity (HelperJsonAddTestSummary); it is kept when it says
    # more than the entities' results do
    if isinstance(summary, dict) and (not found or (summary.get("status") != "Pass"
                                                    and all(t.result in ("pass", "skip") for t in found))):
        found.append(_diag_test(name, None, summary))
    return found


def _diag_test(name: str, gpu_index: int | None, result: dict) -> DiagTest:
    status = str(result["status"])
    warnings = [w for w in result.get("warnings", []) if isinstance(w, dict)]
    texts = [_sanitized(str(w.get("warning", ""))) for w in warnings]
    infos = result.get("info", [])
    texts += [_sanitized(str(info)) for info in (infos if isinstance(infos, list) else [infos])]
    worst = max(warnings, key=lambda w: _severity_rank(w.get("error_severity")), default=None)
    severity = worst.get("error_severity") if worst else None
    category = worst.get("error_category") if worst else None
    result_name = {"Pass": "pass", "Skip": "skip", "Warn": "warn", "Fail": "fail"}.get(status)
    if result_name is None:
        raise ValueError(f"test {name!r} has status {status!r}, not Pass, Fail, Warn or Skip")
    if result_name == "fail" and warnings and all(w.get("error_severity") == SEVERITY_MONITOR for w in warnings):
        # HelperDisplayDiagResult writes DCGM_DIAG_RESULT_WARN as "Fail" in JSON; DCGM_ERROR_MONITOR is
        # "Can perform workload, but needs to be monitored" (dcgm_errors.h): a warning
        result_name = "warn"
    return DiagTest(name, gpu_index, result_name, "; ".join(t for t in texts if t)[:2000],
                    severity if isinstance(severity, int) else None, category if isinstance(category, int) else None)


def _severity_rank(severity: Any) -> int:
    return {SEVERITY_RESET: 5, SEVERITY_ISOLATE: 4, 4: 3, 3: 3, SEVERITY_CONFIG: 2, SEVERITY_MONITOR: 1}.get(severity, 0)


def _sanitized(message: str) -> str:
    """dcgmi's Sanitize (Diag.cpp): what precedes '***' is dropped, and the ends trimmed."""
    return message.split("***", 1)[1].strip() if "***" in message else message.strip()
