"""`gpud …` as operators and scripts use it: every command against a simulated gpud, exit codes 0/1/2/3,
--json errors on stderr, the watch stream and closed pipes, socket discovery, completion and man page."""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import REPO, GpudProcess, Lines

from gpud.cli import main
from gpud.cli.health import HEALTH_REASON_KINDS
from gpud.cli.parser import build_parser
from gpud.client import SOCKET_ENV, find_socket
from gpud.nvml.sim.presets import PRESETS

# One simulated gpud serves this module's tests (each leaves the node as it found it): one worker runs them.
pytestmark = pytest.mark.xdist_group("cli")

LAYOUTS = """\
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  all-1g.5gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.5gb": 7}
  h100-only:
    - device-filter: "0x233010DE"
      devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  all-7g.80gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"7g.80gb": 1}
"""


@pytest.fixture(scope="module")
def node():
    """A simulated four-GPU A100 node with a layouts file and a config to reload."""
    workdir = Path(tempfile.mkdtemp(prefix="gpc", dir="/tmp"))
    (workdir / "layouts.yaml").write_text(LAYOUTS)
    (workdir / "gpud.yaml").write_text(f"mig:\n  layouts_file: {workdir / 'layouts.yaml'}\n"
                                       "health:\n  check_interval_s: 0.5\n")  # processes are read as often
    gpud = GpudProcess(workdir, "--simulate", "A100-SXM4-40GB:4", "--sim-state", str(workdir / "sim.json"),
                       "--config", str(workdir / "gpud.yaml"))
    try:
        gpud.wait_healthy()
        yield gpud
    finally:
        gpud.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """`gpud ARGV` in this process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def on(node, *argv: str) -> list[str]:
    return [*argv, "--socket", str(node.socket)]


def clear_health(node) -> None:
    for gpu in node.client.get("/v1/gpus")["gpus"]:
        node.client.request("POST", f"/v1/health/{gpu['index']}/clear", {})


def health_lines(status_out: str) -> list[str]:
    """The lines of `gpud status` that give a verdict on health."""
    return [line for line in status_out.splitlines() if "health" in line.split(":", 1)[0].lower()]


def json_error(err: str) -> dict:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one JSON object, nothing else
    return json.loads(lines[0])


# -- health in status and gpus -------------------------------------------------------------------


def test_status_and_gpus_show_health_and_status_exits_1_when_a_gpu_is_not(node, capsys):
    clear_health(node)
    code, out, _ = run(capsys, *on(node, "status"))
    assert code == 0 and health_lines(out) == ["health:  ok (4 of 4 GPUs healthy)"]

    assert run(capsys, *on(node, "sim", "xid", "3", "79"))[0] == 0
    # the XID reaches health through the driver's event stream, a moment after the simulator raised it
    node.wait_for(lambda: node.client.get("/v1/health")["gpus"][3]["state"] == "unhealthy", 10, "GPU 3 unhealthy")
    code, out, _ = run(capsys, *on(node, "status"))
    assert code == 1 and health_lines(out) == ["health:  unhealthy (3 of 4 GPUs healthy)"]  # one verdict, not "ok"
    assert "GPU 3: unhealthy" in out and "xid 79" in out and "action: reboot" in out
    code, out, _ = run(capsys, *on(node, "status", "--json"))
    assert code == 1 and json.loads(out)["gpu_health"]["status"] == "unhealthy"
    code, out, _ = run(capsys, *on(node, "gpus"))
    header, *rows = out.splitlines()
    assert code == 0 and header.split()[-1] == "HEALTH"
    assert [row.split()[-1] for row in rows] == ["healthy", "healthy", "healthy", "unhealthy"]
    code, out, _ = run(capsys, *on(node, "gpus", "show", "3", "--json"))
    assert code == 0 and json.loads(out)["health"]["state"] == "unhealthy"

    code, out, _ = run(capsys, *on(node, "health", "clear", "3", "--kind", "ecc"))  # not the XID's kind
    assert code == 0 and "unhealthy" in out and "still: xid 79" in out
    code, out, _ = run(capsys, *on(node, "health", "clear", "3", "--kind", "xid", "--json"))
    assert code == 0 and json.loads(out)["state"] == "healthy"
    assert run(capsys, *on(node, "status"))[0] == 0


def test_health_clear_of_an_unknown_device_is_invalid_input(node, capsys):
    code, _, err = run(capsys, *on(node, "health", "clear", "GPU-nope", "--json"))
    assert code == 2
    error = json_error(err)
    assert error["exit_code"] == 2 and error["error"]["code"] == "device-not-found"
    assert error["error"]["http_status"] == 404 and "GPU-nope" in error["error"]["message"]


# -- GPU reset, processes and the simulator drills -----------------------------------------------


def test_reset_names_what_blocks_it_and_force_ends_the_processes(node, capsys):
    worker = subprocess.Popen(["sleep", "60"])
    try:
        assert run(capsys, *on(node, "sim", "processes", "2", str(worker.pid)))[0] == 0
        listed = node.wait_for(lambda: node.client.get("/v1/gpus/2/processes")["devices"][0]["processes"],
                               what="the process listed")
        assert [p["pid"] for p in listed] == [worker.pid]
        code, out, _ = run(capsys, *on(node, "gpus", "processes", "2"))
        header, row = out.splitlines()
        assert code == 0 and header.split()[:3] == ["DEVICE", "PID", "NAME"]
        assert row.split()[:3] == ["GPU", str(worker.pid), "sleep"]

        code, out, err = run(capsys, *on(node, "gpus", "reset", "2"))
        assert code == 1 and out == ""
        assert "reset-blocked" in err and f"GPU 2: compute processes {worker.pid}" in err
        code, _, err = run(capsys, *on(node, "gpus", "reset", "2", "--json"))
        error = json_error(err)
        assert code == 1 and error["exit_code"] == 1 and error["error"]["code"] == "reset-blocked"
        assert [b["gpu"] for b in error["error"]["blockers"]] == [2]
        assert worker.poll() is None  # nothing was done

        code, out, _ = run(capsys, *on(node, "gpus", "reset", "2", "--force"))
        uuid = node.client.get("/v1/gpus/2")["uuid"]
        assert code == 0 and "GPU 2 reset" in out and f"ended processes on {uuid}: {worker.pid}" in out
        assert worker.poll() is None  # a simulated node ends its simulated processes, never host ones
    finally:
        worker.kill()
        worker.wait(10)
    node.wait_for(lambda: not node.client.get("/v1/gpus/2/processes")["devices"][0]["processes"],
                  what="the process gone")
    code, out, _ = run(capsys, *on(node, "gpus", "processes", "2"))
    assert code == 0 and out.strip() == "no compute processes on GPU 2"


def test_sim_drills(node, capsys):
    code, out, _ = run(capsys, *on(node, "sim", "lost", "1", "--how", "is-lost"))
    assert code == 0 and out.startswith("simulated gpu-lost on GPU 1")
    _, out, _ = run(capsys, *on(node, "gpus", "--json"))
    assert [gpu["lost"] for gpu in json.loads(out)["gpus"]] == [False, True, False, False]
    assert run(capsys, *on(node, "sim", "recover", "1"))[0] == 0
    _, out, _ = run(capsys, *on(node, "gpus", "--json"))
    assert not any(gpu["lost"] for gpu in json.loads(out)["gpus"])

    code, out, _ = run(capsys, *on(node, "sim", "ecc", "1", "--double-bit", "--json"))
    assert code == 0 and json.loads(out) == {"injected": "ecc", "gpu": 1, "double_bit": True}
    code, out, _ = run(capsys, *on(node, "sim", "holders", "1", "--process", "nv-hostengine", "--pid", "4242"))
    assert code == 0 and '"process": "nv-hostengine"' in out
    code, out, _ = run(capsys, *on(node, "sim", "holders", "1", "--release", "--json"))
    assert code == 0 and json.loads(out)["holders"] == []
    assert run(capsys, *on(node, "sim", "holders", "1", "--release", "--pid", "1"))[0] == 2  # one or the other

    code, _, err = run(capsys, *on(node, "sim", "xid", "1", "79", "--gi", "1"))  # MIG is off: no GPU instance 1
    assert code == 2 and "invalid-target" in err
    code, _, err = run(capsys, *on(node, "sim", "xid", "9", "79"))
    assert code == 2 and "invalid-target" in err
    code, _, err = run(capsys, *on(node, "sim", "xid", "1", "70000"))
    assert code == 2 and "between 1 and 65535" in err
    clear_health(node)


def test_reload_mps_and_metrics(node, capsys):
    code, out, _ = run(capsys, *on(node, "reload"))
    assert code == 0 and out.startswith("reloaded: ")
    code, out, _ = run(capsys, *on(node, "mps", "status"))
    assert code == 0 and "MPS is not enabled" in out
    for action in ("start", "stop", "restart"):
        code, _, err = run(capsys, *on(node, "mps", action, "gpu0", "--json"))
        assert code == 2 and json_error(err)["error"]["code"] == "mps-daemon-not-found"
    code, out, _ = run(capsys, *on(node, "metrics"))
    assert code == 0 and "# TYPE gpud_gpu_health gauge" in out


def _t4_with_mps(run_gpud, tmp, state: str, control_binary: str | None = None):
    """A simulated T4 with MPS on (its pipes and logs under tmp), once its daemon is `state`."""
    binary = f"  control_binary: {control_binary}\n" if control_binary else ""
    config = tmp / "gpud.yaml"
    config.write_text(f"mps:\n  enabled: true\n{binary}  pipe_root: {tmp / 'mps'}\n  log_root: {tmp / 'mpslog'}\n"
                      f"mig:\n  layouts_file: {tmp / 'absent.yaml'}\n")
    gpud = run_gpud("--simulate", "t4", "--sim-state", str(tmp / "sim.json"), "--config", str(config))
    gpud.wait_healthy()
    gpud.wait_for(lambda: gpud.client.get("/v1/mps")["daemons"][0]["state"] == state, what=f"MPS {state}")
    return gpud


def test_mps_stop_start_restart_and_env(run_gpud, mps_tmp, capsys):
    gpud = _t4_with_mps(run_gpud, mps_tmp, "running")
    code, out, _ = run(capsys, *on(gpud, "mps", "stop", "gpu0"))
    assert code == 0 and out.startswith("gpu0: stopped, pid -")
    assert run(capsys, *on(gpud, "mps", "status"))[0] == 1  # a daemon is down
    code, out, _ = run(capsys, *on(gpud, "mps", "start", "gpu0", "--json"))
    assert code == 0 and json.loads(out)["state"] == "running"
    code, out, _ = run(capsys, *on(gpud, "mps", "restart", "gpu0"))
    assert code == 0 and out.startswith("gpu0: running") and "restarts" in out
    code, out, _ = run(capsys, *on(gpud, "mps", "env", "gpu0", "--threads-percent", "20"))
    assert code == 0 and f"CUDA_MPS_PIPE_DIRECTORY={mps_tmp / 'mps'}" in out
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20" in out.splitlines()
    code, _, err = run(capsys, *on(gpud, "mps", "env", "gpu0", "--threads-percent", "120"))
    assert code == 2 and "limit-beyond-device" in err
    assert gpud.stop() == 0


def test_a_failed_mps_daemon_says_why_and_gives_no_environment(run_gpud, short_tmp, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # the reason on the daemon's row, unwrapped
    gpud = _t4_with_mps(run_gpud, short_tmp, "failed", control_binary="/nonexistent/nvidia-cuda-mps-control")
    code, out, _ = run(capsys, *on(gpud, "mps", "status"))
    header, row = out[out.index("NAME "):].splitlines()  # the reason fits its row: not repeated above
    assert code == 1 and header.split()[-1] == "WHY" and row.split()[:2] == ["gpu0", "failed"]
    assert "/nonexistent/nvidia-cuda-mps-control' is not installed" in row
    assert "non-free" in row  # where Debian has the package

    code, out, err = run(capsys, *on(gpud, "mps", "env", "gpu0"))
    assert code == 1 and out == "" and "MPS daemon gpu0 is failed" in err and "not installed" in err
    code, out, err = run(capsys, *on(gpud, "mps", "env", "gpu0", "--json"))
    assert code == 1 and out == "" and json_error(err)["error"]["code"] == "mps-daemon-not-running"
    assert gpud.stop() == 0


# -- MIG -----------------------------------------------------------------------------------------


def test_mig_layouts_show_what_fits_one_line_each_and_all_says_why_the_rest_do_not(node, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run(capsys, *on(node, "mig", "layouts"))
    lines = out.splitlines()
    assert code == 0 and lines[0].endswith("2 of 4 layouts fit this node (* = current)")
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:-1]}
    assert rows == {"all-disabled": ["yes", "0", "GPUs"], "all-1g.5gb": ["yes", "4", "GPUs"]}
    assert lines[-1] == "2 more do not fit this node: gpud mig layouts --all says why"

    code, out, _ = run(capsys, *on(node, "mig", "layouts", "--all"))
    lines = out.splitlines()
    assert code == 0 and max(map(len, lines)) <= 100
    too_big = next(i for i, line in enumerate(lines) if line.split()[:1] == ["all-7g.80gb"])
    assert lines[too_big].split()[1] == "no" and lines[too_big + 1].startswith(" " * 20)  # the reason wraps
    assert next(line for line in lines if line.split()[:1] == ["h100-only"]).split()[1:3] == ["no", "GPU"]

    code, _, err = run(capsys, *on(node, "mig", "apply", "h100-only"))
    assert code == 2 and "matches no GPU" in err
    assert node.client.get("/v1/mig")["layout"] != "h100-only"


def test_mig_apply_from_a_local_file(node, capsys, tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("version: v1\nmig-configs:\n  mine:\n    - devices: [0]\n      mig-enabled: true\n"
                    "      mig-devices: {\"3g.20gb\": 2}\n")
    code, out, err = run(capsys, *on(node, "mig", "apply", "--file", str(mine), "mine"))
    assert code == 0, err
    assert "GPU 0: done" in out and "layout mine: success" in out
    devices = node.client.get("/v1/gpus/0")["mig"]["devices"]
    assert [d["profile"] for d in devices] == ["3g.20gb", "3g.20gb"]

    code, _, err = run(capsys, *on(node, "mig", "apply", "--file", str(mine), "theirs", "--json"))
    assert code == 2 and json_error(err)["exit_code"] == 2
    code, _, err = run(capsys, *on(node, "mig", "apply", "--file", str(tmp_path / "absent.yaml"), "mine"))
    assert code == 2 and "absent.yaml" in err
    mine.write_text("version: v1\nmig-configs: [unclosed\n")
    code, _, err = run(capsys, *on(node, "mig", "apply", "--file", str(mine), "mine"))
    assert code == 2 and err.startswith("gpud: ")
    assert run(capsys, *on(node, "mig", "apply", "all-disabled"))[0] == 0


def test_validate_warns_and_strict_makes_warnings_errors(capsys, tmp_path):
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text("version: v1\nmig-configs:\n  twice:\n    - devices: [0, 0]\n      mig-enabled: false\n")
    code, out, err = run(capsys, "mig", "validate", str(layouts))
    assert code == 0 and "valid, 1 layouts: twice" in out and err.startswith("warning: mig-configs.twice[0].devices")
    code, out, err = run(capsys, "mig", "validate", str(layouts), "--strict")
    assert code == 2 and out == "" and "1 warning (--strict)" in err
    code, out, _ = run(capsys, "mig", "validate", str(layouts), "--json")
    assert code == 0 and json.loads(out)["layouts"] == ["twice"] and len(json.loads(out)["warnings"]) == 1
    code, _, err = run(capsys, "mig", "validate", str(layouts), "--strict", "--json")
    assert code == 2 and json_error(err)["error"]["code"] == "file-warnings"

    sharing = tmp_path / "sharing.yaml"
    sharing.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - name: nvidia.com/gpu\n"
                       "        replicas: 4\n    colour: blue\n")
    code, out, err = run(capsys, "sharing", "validate", str(sharing))
    assert code == 0 and "strategy time-slicing" in out and "colour" in err
    assert run(capsys, "sharing", "validate", str(sharing), "--strict")[0] == 2
    sharing.write_text("version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: -1}]}}\n")
    code, _, err = run(capsys, "sharing", "validate", str(sharing), "--json")
    assert code == 2 and json_error(err)["error"]["code"] == "file-invalid"
    code, out, _ = run(capsys, "config", "validate", str(REPO / "etc" / "gpud" / "gpud.yaml"), "--json")
    assert code == 0 and json.loads(out)["valid"] is True


# -- exit codes, usage and --json errors ---------------------------------------------------------


@pytest.mark.parametrize("argv", [["nosuch"], ["mig"], ["mig", "apply"], ["sim", "processes", "0", "pid1"],
                                  ["gpus", "reset"], ["watch", "--since", "soon"], []])
def test_usage_errors_exit_2_and_are_json_with_json(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and "usage: gpud" in err
    code, out, err = run(capsys, *argv, "--json")
    error = json_error(err)
    assert code == 2 and out == "" and error["exit_code"] == 2 and error["error"]["code"] == "usage"


def test_a_mistyped_command_gets_a_suggestion(capsys):
    code, out, err = run(capsys, "stauts")
    assert code == 2 and out == "" and "did you mean 'status'?" in err
    code, _, err = run(capsys, "mig", "layuots")
    assert code == 2 and "did you mean 'layouts'?" in err and "usage: gpud mig " in err


@pytest.mark.parametrize("argv, usage", [(["status", "--bogus"], "usage: gpud status "),
                                         (["mig", "apply", "x", "--bogus"], "usage: gpud mig apply "),
                                         (["sim", "holders", "1", "--release", "--pid", "1"], "usage: gpud sim holders "),
                                         (["device-plugin", "--unhealthy-after", "-1"], "usage: gpud device-plugin ")])
def test_an_option_error_shows_that_commands_usage(capsys, argv, usage):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.startswith(usage)


def test_an_invalid_health_kind_is_refused_naming_the_kinds(capsys):
    code, out, err = run(capsys, "health", "clear", "0", "--kind", "bogus", "--socket", "/nonexistent/gpud.sock")
    assert code == 2 and out == "" and "usage: gpud health clear" in err
    assert "invalid choice: 'bogus' (choose from " + ", ".join(HEALTH_REASON_KINDS) + ")" in err


def test_the_health_kinds_the_cli_takes_are_those_gpud_raises():
    """Every kind given as a literal to the health tracker (observe, _reason) or as a check's key."""
    kind_argument = {"observe": 1, "_reason": 0}  # tracker.observe(device, kind, code, …), _reason(kind, code, …)
    raised = set()
    for source in (REPO / "gpud" / "health").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            where = kind_argument.get(getattr(getattr(node, "func", None), "attr", None))
            if isinstance(node, ast.Call) and where is not None and isinstance(node.args[where], ast.Constant):
                raised.add(node.args[where].value)
            if isinstance(node, ast.Dict) and source.name == "checks.py":  # check_readings: {(kind, code): …}
                raised |= {key.elts[0].value for key in node.keys if isinstance(key, ast.Tuple)}
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["KIND"]:
                raised.add(node.value.value)  # a module's one kind (infiniband, diag), named once
    assert {"xid", "ecc", "lost", "mps", "temperature"} <= raised
    assert set(HEALTH_REASON_KINDS) == raised


def test_serve_help_lists_every_preset(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: names are not cut by wrapping
    code, out, _ = run(capsys, "serve", "--help")
    (simulate,) = [line for line in out.splitlines() if line.strip().startswith("--simulate")]
    assert code == 0 and PRESETS and all(f"{name} ({preset.description})" in simulate
                                         for name, preset in PRESETS.items())


def test_serve_help_names_each_default_socket(capsys, monkeypatch):
    """The defaults gpud.base.places.user_runtime_dir picks: root's, then $XDG_RUNTIME_DIR's, then /tmp/gpud-UID's."""
    monkeypatch.setenv("COLUMNS", "1000")
    code, out, _ = run(capsys, "serve", "--help")
    (socket,) = [line for line in out.splitlines() if line.strip().startswith("--socket")]
    assert code == 0 and all(place in socket for place in ("/run/gpud/gpud.sock as root", "$XDG_RUNTIME_DIR/gpud/gpud.sock",
                                                          "/tmp/gpud-UID/gpud.sock where XDG_RUNTIME_DIR is unset"))


def test_device_plugin_without_a_kubelet_directory_says_what_to_do(short_tmp):
    missing = subprocess.run([sys.executable, "-m", "gpud", "device-plugin", "--kubelet-dir", str(short_tmp / "none"),
                              "--log-format", "console"], capture_output=True, text=True, timeout=60, cwd=REPO)
    said = missing.stdout + missing.stderr
    assert missing.returncode == 2 and f"no directory {short_tmp / 'none'}" in said and "--kubelet-dir" in said


def test_an_unreachable_daemon_exits_3_and_says_where(capsys, short_tmp):
    absent = short_tmp / "absent.sock"
    code, _, err = run(capsys, "status", "--socket", str(absent))
    assert code == 3 and "gpud is not running" in err and str(absent) in err
    code, _, err = run(capsys, "status", "--socket", "/tmp/gpud-nope.sock")  # in a directory anyone may write in
    assert code == 3 and "no socket at /tmp/gpud-nope.sock" in err and "writable" not in err
    assert "gpud serve run by you listens at /run/gpud/gpud.sock" in err if os.geteuid() == 0 else \
        "gpud serve run by you listens at " in err
    refusing = short_tmp / "refusing.sock"
    bound = socket.socket(socket.AF_UNIX)
    bound.bind(str(refusing))  # bound, never listening: connect is refused
    try:
        code, _, err = run(capsys, "gpus", "--json", "--socket", str(refusing))
    finally:
        bound.close()
    error = json_error(err)
    assert code == 3 and error == {"error": {"code": "daemon-unreachable", "message": error["error"]["message"]},
                                   "exit_code": 3}
    assert "connection refused" in error["error"]["message"]


def _commands(parser: argparse.ArgumentParser, words: tuple = ()):
    """Every command of the tree (groups too), with its parser."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, words + (name,))


def test_json_is_json_for_every_command(run_gpud, short_tmp, capsys):
    """Each command of the parser, with --json and whatever its arguments need, against a simulated gpud:
    stdout is one JSON document, or (an error, a usage error included) stdout is empty and stderr is one
    JSON error. A command added later is walked too; one whose argument this test cannot fill fails it."""
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:2", "--sim-state", str(short_tmp / "sim.json"))
    gpud.wait_healthy()
    files = {("mig", "validate"): REPO / "etc" / "gpud" / "mig-layouts.yaml",
             ("config", "validate"): REPO / "etc" / "gpud" / "gpud.yaml",
             ("sharing", "validate"): short_tmp / "sharing.yaml"}
    files[("sharing", "validate")].write_text("version: v1\nsharing: {timeSlicing: {resources: "
                                              "[{name: nvidia.com/gpu, replicas: 2}]}}\n")
    values = {"id": ["0"], "gpu": ["0"], "xid": ["31"], "name": ["gpu0"], "layout": ["all-disabled"], "pids": []}
    printed = {}
    for words, parser in _commands(build_parser()):
        argv = list(words)
        for action in parser._actions:
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                argv += [str(files[words])] if action.dest == "path" else values[action.dest]
        if "--socket" in parser._option_string_actions:
            argv += ["--socket", str(gpud.socket)]
        if words == ("watch",):  # a stream: its first line, from a real process
            printed[words] = _first_watch_line(argv)
            continue
        code, out, err = run(capsys, *argv, "--json")
        if code == 0 or out:
            printed[words] = json.loads(out)
        else:
            assert json_error(err)["exit_code"] == code, (words, err)
            printed[words] = None
    assert printed[("metrics",)]["format"] == "prometheus-text" and "gpud_gpu_health" in printed[("metrics",)]["text"]
    assert printed[("mig", "export")]["format"] == "mig-parted-yaml"
    assert printed[("watch",)]["epoch"] and printed[("status",)]["node"] and printed[("serve",)] is None


def _first_watch_line(argv: list[str]) -> dict:
    watcher = subprocess.Popen([sys.executable, "-m", "gpud", *argv, "--json", "--since", "0"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        return json.loads(Lines(watcher.stdout, "gpud watch --json").next("first event"))
    finally:
        watcher.kill()
        watcher.wait(10)


def test_every_command_takes_json():
    def leaves(parser: argparse.ArgumentParser, words: tuple):
        if parser.get_default("run") is not None:
            yield words, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from leaves(child, words + (name,))

    found = dict(leaves(build_parser(), ("gpud",)))
    assert {("gpud", "reload"), ("gpud", "gpus", "reset"), ("gpud", "sim", "recover"), ("gpud", "doctor"),
            ("gpud", "mig", "validate"), ("gpud", "mps", "stop")} <= set(found)
    assert [words for words, parser in found.items() if "--json" not in parser._option_string_actions] == []


# -- socket discovery ----------------------------------------------------------------------------


@contextlib.contextmanager
def _bound(path: Path):
    """A Unix socket at path while in the block."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        try:
            yield
        finally:
            path.unlink()


def test_socket_discovery_order(short_tmp):
    system, own = short_tmp / "system", short_tmp / "own"
    system.mkdir(mode=0o755)
    own.mkdir(mode=0o700)
    system_socket = str(system / "gpud.sock")  # the client's paths are str (it does not import pathlib)
    own_socket = str(own / "gpud.sock")

    path, tried = find_socket({}, system_socket, own)
    assert path == system_socket and tried == [f"${SOCKET_ENV} (unset)", system_socket, own_socket]
    with _bound(own / "gpud.sock"):
        assert find_socket({}, system_socket, own)[0] == own_socket
        with _bound(Path(system_socket)):
            assert find_socket({}, system_socket, own)[0] == system_socket  # the system gpud first
            assert find_socket({SOCKET_ENV: "/x/y.sock"}, system_socket, own) == ("/x/y.sock",
                                                                                  ["$GPUD_SOCKET=/x/y.sock"])
        own.chmod(0o777)  # anyone could have put that socket there
        path, tried = find_socket({}, system_socket, own)
        assert path == system_socket and "writable by other users" in tried[-1]


def test_the_cli_finds_the_daemon_through_gpud_socket(node, capsys, monkeypatch):
    monkeypatch.setenv(SOCKET_ENV, str(node.socket))
    code, out, _ = run(capsys, "gpus", "--json")
    assert code == 0 and len(json.loads(out)["gpus"]) == 4
    monkeypatch.setenv(SOCKET_ENV, str(node.workdir / "other.sock"))
    code, _, err = run(capsys, "gpus")
    assert code == 3 and f"$GPUD_SOCKET={node.workdir / 'other.sock'}" in err


# -- watch ---------------------------------------------------------------------------------------


def test_watch_ends_quietly_when_its_reader_does(node, tmp_path):
    rc_file, err_file = tmp_path / "rc", tmp_path / "err"
    script = (f'"{sys.executable}" -m gpud watch --socket "{node.socket}" 2>"{err_file}" | head -2; '
              f'echo "${{PIPESTATUS[0]}}" > "{rc_file}"')
    pipeline = subprocess.Popen(["bash", "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while pipeline.poll() is None and time.monotonic() < deadline:
            node.client.request("POST", "/v1/sim/gpu-lost", {"gpu": 0})  # events until head and gpud are gone
            node.client.request("POST", "/v1/sim/gpu-recover", {"gpu": 0})
            time.sleep(0.1)
        assert pipeline.wait(5) == 0
    finally:
        pipeline.kill()
    assert re.match(r"#\d+ \w+: ", pipeline.communicate(timeout=10)[0].splitlines()[1])  # after the first line
    assert rc_file.read_text().strip() == "0"
    errors = err_file.read_text()
    assert "Traceback" not in errors and "Exception ignored" not in errors and "gpud run " in errors
    clear_health(node)


def test_watch_into_head_ends_at_once_when_no_event_comes(node):
    """`gpud watch | head -1` on a quiet node: the first line comes at once, and the watch ends with head,
    not at gpud's next heartbeat or event."""
    script = f'"{sys.executable}" -m gpud watch --socket "{node.socket}" | head -1; exit "${{PIPESTATUS[0]}}"'
    started = time.monotonic()
    pipeline = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert pipeline.returncode == 0 and time.monotonic() - started < 10  # gpud's heartbeat is 15 s apart
    assert pipeline.stdout == f"# watching gpud on {node.socket}: one line per event\n"


@pytest.mark.parametrize("reader_open", [True, False])
def test_a_pipe_whose_reader_closed_is_noticed_without_a_write(reader_open):
    """What `gpud watch` checks at each heartbeat, so that `gpud watch | head -1` ends even when no
    event comes after head's line."""
    read_end, write_end = os.pipe()
    if not reader_open:
        os.close(read_end)
    check = "import sys; from gpud.cli.output import stdout_reader_gone; sys.exit(3 if stdout_reader_gone() else 4)"
    try:
        result = subprocess.run([sys.executable, "-c", check], stdout=write_end, cwd=REPO, timeout=30)
    finally:
        os.close(write_end)
        if reader_open:
            os.close(read_end)
    assert result.returncode == (4 if reader_open else 3)


def test_watch_says_when_the_daemon_went_away(run_gpud, short_tmp):
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:1", "--sim-state", str(short_tmp / "sim.json"))
    gpud.wait_healthy()
    watcher = subprocess.Popen([sys.executable, "-m", "gpud", "watch", "--since", "0", "--json", "--socket",
                                str(gpud.socket)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = Lines(watcher.stdout, "gpud watch"), Lines(watcher.stderr, "gpud watch's stderr")
    assert err.next("run line").startswith("gpud run ")  # the replay of this run has begun
    gpud.proc.kill()  # no goodbye
    assert watcher.wait(10) == 3
    events = [json.loads(line) for line in out.rest().splitlines()]
    error = json_error(err.rest())
    assert error["error"]["code"] == "daemon-gone" and "went away" in error["error"]["message"]
    last = events[-1]
    assert f"--since {last['seq']} --epoch {last['epoch']}" in error["error"]["message"]


# -- completion and man page ---------------------------------------------------------------------


def _generated(kind: str, tmp_path: Path) -> Path:
    out = tmp_path / kind
    result = subprocess.run([sys.executable, "-m", "gpud.cli.docs", kind, str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return out


def _top_commands() -> list[str]:
    (subcommands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(subcommands.choices)


def test_bash_completion_completes_commands_options_and_values(tmp_path):
    script = _generated("bash", tmp_path)
    (tmp_path / "layouts.yaml").touch()
    probe = f"""source /usr/share/bash-completion/bash_completion 2>/dev/null; source {script}
complete -p gpud
t() {{ COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _gpud; echo "${{COMPREPLY[*]}}"; }}
t gpud ''
t gpud mi
t gpud mig apply --f
t gpud serve --log-level ''
t gpud gpus --json r
t gpud mig validate lay
t gpud sim xid 0 --gi 1 --c
"""
    result = subprocess.run(["bash", "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    registered, top, mi, apply, levels, gpus, files, sim = result.stdout.splitlines()
    assert registered == "complete -F _gpud gpud"
    assert top.split() == _top_commands()
    assert mi == "mig" and apply.split() == ["--file", "--force"] and levels.split() == ["debug", "info", "warning",
                                                                                        "error"]
    assert gpus == "reset" and files == "layouts.yaml" and sim == "--ci"


def test_zsh_completion_parses_and_completes(tmp_path):
    script = _generated("zsh", tmp_path)
    assert script.read_text().startswith("#compdef gpud\n")
    assert subprocess.run(["zsh", "-n", str(script)], capture_output=True, timeout=120).returncode == 0
    # The completion function run by zsh itself; compadd and _files, which only work inside the
    # completion system's widgets, print what they are given.
    probe = f"""compadd() {{ [[ $1 == -- ]] && shift; print -r -- "$*"; }}
_files() {{ print -r -- FILES; }}
functions[_gpud]=$(<{script})
t() {{ local -a words; words=("$@"); local CURRENT=$#; _gpud; }}
t gpud ''
t gpud mig apply --
t gpud mig apply --file ''
t gpud serve --log-format ''
"""
    result = subprocess.run(["zsh", "-f", "-c", probe], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    top, apply, file, formats = result.stdout.splitlines()
    assert top.split() == _top_commands()
    assert {"--file", "--dry-run", "--force", "--no-wait", "--json", "--socket"} <= set(apply.split())
    assert file == "FILES" and formats.split() == ["auto", "json", "console"]


def test_zsh_completes_in_an_interactive_shell(tmp_path):
    """The whole completion system: an interactive zsh (on a pseudo-terminal) with compinit and the
    script on its fpath completes what is typed when Tab is pressed."""
    functions = tmp_path / "functions"
    functions.mkdir()
    (functions / "_gpud").write_text(_generated("zsh", tmp_path).read_text())
    probe = f"""zmodload zsh/zpty
zpty z zsh -f -i
zpty -w z "PS1='%% '; fpath=({functions} \\$fpath); autoload -U compinit; compinit -u -D"
zpty -w -n z "gpud mig app"$'\\t'"--dr"$'\\t'
local screen= chunk
for i in {{1..50}}; do
    while zpty -r -t z chunk; do screen+=$chunk; done
    [[ $screen == *--dry-run* ]] && break
    sleep 0.1
done
zpty -d z
print -r -- "$screen"
"""
    result = subprocess.run(["zsh", "-f", "-c", probe], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    line = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", result.stdout.rsplit("% ", 1)[-1])  # the terminal's codes,
    line = re.sub(r".\x08", "", line)  # then what was backspaced over
    assert " ".join(line.split()) == "gpud mig apply --dry-run", result.stdout[-500:]  # "app", "--dr" completed


def test_the_man_page_renders_without_warnings_and_lists_every_command(tmp_path):
    page = _generated("man", tmp_path)
    checked = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(page)], capture_output=True, text=True,
                             timeout=120)
    assert checked.returncode == 0 and checked.stderr == ""
    rendered = subprocess.run(["groff", "-man", "-Tascii", "-P", "-cbou", str(page)], capture_output=True,
                              text=True, check=True, timeout=120).stdout
    headings = {line.strip() for line in rendered.splitlines() if line.startswith("   gpud ")}
    expected = {f"gpud {name}" for name in _top_commands()}
    assert expected <= headings
    assert {"gpud gpus reset", "gpud health clear", "gpud mps stop", "gpud sim xid", "gpud mig apply"} <= headings
    for section in ("EXIT STATUS", "ENVIRONMENT", "GPUD_SOCKET", "FILES"):
        assert section in rendered
    assert "gpud is unreachable" in rendered
