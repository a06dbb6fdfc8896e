"""The import budget of the commands an operator types and Slurm runs before each job: what a command
imports is what it costs to start (bench/cli_startup.py has the figures), so what each may load is
held here and cannot creep back.

A command runs in a fresh interpreter against a simulated gpud and reports the modules it loaded
beyond `python -c pass`. The standard library it may use is what `import argparse, json, socket`
loads in that same interpreter (any Python command line asking a socket for JSON pays that; its set
differs between Python versions), plus the few modules named here; gpud's own modules are listed
exactly, command by command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO, GpudProcess

FLOOR = "import argparse, json, socket"
# Beyond the floor: importlib (the command's module is imported by name) and gettext's locale lookup.
STANDARD_EXTRA = {"importlib", "locale", "_locale"}
# `gpud slurm health` runs scontrol: the runner's standard library too (gpud/base/child.py)
RUNS_CHILDREN = "import subprocess, selectors, signal, threading"
CLIENT = {"gpud", "gpud.base", "gpud.base.bounded_json", "gpud.base.http1", "gpud.base.places", "gpud.cli",
          "gpud.cli.arguments", "gpud.cli.commands", "gpud.cli.output", "gpud.cli.parser", "gpud.client"}
SLURM_HEALTH = CLIENT | {"gpud.base.child", "gpud.cli.slurm", "gpud.slurm", "gpud.slurm.health"}
BUDGETS = {
    "status": (CLIENT | {"gpud.cli.serve", "gpud.cli.health"}, ""),
    "gpus": (CLIENT | {"gpud.cli.gpus", "gpud.cli.health"}, ""),
    "health": (CLIENT | {"gpud.cli.health"}, ""),
    "slurm health --dry-run": (SLURM_HEALTH, RUNS_CHILDREN),
    "slurm health --prolog": (SLURM_HEALTH, RUNS_CHILDREN),
    # the list of commands: no command's module, no client
    "--help": (CLIENT - {"gpud.client", "gpud.base", "gpud.base.bounded_json", "gpud.base.http1", "gpud.base.places"},
               "import textwrap"),
}
# Each once cost a command more than the interpreter's own start (issue 39), or has no business in a
# client: named, so that a failure says which came back.
NEVER = ("asyncio", "aiohttp", "yaml", "structlog", "typing", "dataclasses", "inspect", "pathlib", "http.client",
         "email", "shutil", "logging", "concurrent.futures", "gpud.config", "gpud.nvml", "gpud.api", "gpud.daemon")

REPORT = """
import json, sys
before = set(sys.modules)
{code}
print(json.dumps(sorted(set(sys.modules) - before)))
"""
RUN_GPUD = """
import contextlib, io, os
from gpud.cli import main
os.environ["SLURM_JOB_GPUS"] = "0,1"
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = main({argv!r})
assert code in (0, 1), code
"""


def _loaded(code: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", REPORT.format(code=code)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.fixture(scope="module")
def floor() -> set[str]:
    return _loaded(FLOOR) | STANDARD_EXTRA


@pytest.fixture(scope="module")
def simulated_socket():
    workdir = Path(tempfile.mkdtemp(prefix="gci", dir="/tmp"))  # short: a socket path holds 108 bytes
    gpud = GpudProcess(workdir, "--simulate", "A100-SXM4-40GB:2", "--sim-state", str(workdir / "sim.json"))
    try:
        gpud.wait_healthy()
        yield gpud.socket
    finally:
        gpud.proc.kill()
        gpud.proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("command", BUDGETS)
def test_a_command_loads_only_its_budget(command, floor, simulated_socket, tmp_path):
    gpud_modules, more_standard = BUDGETS[command]
    argv = command.split()
    if command != "--help":
        argv += ["--socket", str(simulated_socket)]
    if command.startswith("slurm health"):
        scontrol = tmp_path / "scontrol"  # Slurm 22.05's line for an idle node: nothing to drain or resume
        scontrol.write_text("#!/bin/sh\necho 'NodeName=n1 State=IDLE Partitions=gpu Reason=(null)'\n")
        scontrol.chmod(0o755)
        argv += ["--node-name", "n1", "--scontrol", str(scontrol), "--gres-conf", str(tmp_path / "absent")]
    allowed_standard = floor | (_loaded(more_standard) if more_standard else set())
    loaded = _loaded(RUN_GPUD.format(argv=argv))
    assert sorted(m for m in loaded if any(m == never or m.startswith(f"{never}.") for never in NEVER)) == []
    assert sorted(m for m in loaded if m.split(".")[0] == "gpud") == sorted(gpud_modules)
    assert sorted(m for m in loaded if m.split(".")[0] != "gpud" and m not in allowed_standard) == []


def test_the_budget_fails_on_a_heavy_import(floor):
    # the check itself: a client module that imported the config model would load YAML and typing
    loaded = _loaded("import gpud.client, gpud.config")
    assert {"yaml", "gpud.config"} <= loaded and not loaded - {"gpud"} <= floor
