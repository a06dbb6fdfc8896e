"""gpud's global options, --socket PATH and --json, go before or after the command (issue 39: `gpud --socket
PATH status` said `invalid choice: PATH`), for every command that talks to gpud; a command that does not
refuses --socket instead of ignoring it. And what a command says when the socket refuses this user."""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.helpers import READERS, REPO, SYSTEM_PATH, until


def gpud(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpud", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.fixture
def running(run_gpud, short_tmp):
    process = run_gpud("--simulate", "A100-SXM4-40GB:2", "--sim-state", str(short_tmp / "sim.json"))
    process.wait_healthy()
    return process


@pytest.mark.parametrize("where", ["before", "after", "between"])
def test_the_socket_and_json_go_anywhere(running, where):
    options = ["--socket", str(running.socket), "--json"]
    argv = {"before": [*options, "gpus", "show", "0"], "after": ["gpus", "show", "0", *options],
            "between": ["--json", "gpus", "--socket", str(running.socket), "show", "0"]}[where]
    shown = gpud(*argv)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["index"] == 0


def test_status_with_the_socket_first_asks_that_gpud(running, short_tmp):
    first = gpud("--socket", str(running.socket), "status")
    assert first.returncode == 0 and "backend simulated" in first.stdout, first.stderr
    elsewhere = gpud("--socket", str(short_tmp / "none.sock"), "status")
    assert elsewhere.returncode == 3 and f"no socket at {short_tmp / 'none.sock'}" in elsewhere.stderr


def test_slurm_health_takes_the_socket_before_the_command(running, short_tmp):
    scontrol = short_tmp / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 'NodeName=n1 State=IDLE Partitions=gpu Reason=(null)'\n")
    scontrol.chmod(0o755)
    checked = gpud("--socket", str(running.socket), "slurm", "health", "--dry-run", "--node-name", "n1",
                   "--scontrol", str(scontrol))
    assert checked.returncode == 0, checked.stderr
    assert "healthy" in checked.stdout


def test_serve_listens_where_the_socket_given_first_says(short_tmp):
    sock = short_tmp / "first.sock"
    serving = subprocess.Popen([sys.executable, "-m", "gpud", "--socket", str(sock), "serve", "--simulate",
                                "A100-SXM4-40GB:1", "--sim-state", str(short_tmp / "sim.json"), "--state-dir",
                                str(short_tmp / "state")], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        until(lambda: gpud("status", "--socket", str(sock)).returncode == 0, timeout=30, what="gpud on first.sock")
    finally:
        serving.terminate()
        serving.wait(20)


@pytest.mark.parametrize("argv", [["config", "validate", "/dev/null"], ["mig", "validate", "/dev/null"],
                                  ["doctor", "--simulate", "A100-SXM4-40GB:1"]])
def test_a_command_that_does_not_talk_to_gpud_refuses_the_socket(argv, short_tmp):
    refused = gpud("--socket", str(short_tmp / "x.sock"), *argv)
    assert refused.returncode == 2
    assert f"--socket: gpud {' '.join(argv[:2 if argv[0] != 'doctor' else 1])} does not talk to the daemon" \
        in refused.stderr


def test_json_before_a_local_command_is_taken(short_tmp):
    config = short_tmp / "gpud.yaml"
    config.write_text("log:\n  level: info\n")
    checked = gpud("--json", "config", "validate", str(config))
    assert checked.returncode == 0 and json.loads(checked.stdout) == {"path": str(config), "valid": True}


def test_an_abbreviated_global_option_is_not_guessed(short_tmp):
    # --sock PATH could read PATH as the command: abbreviations of the global options are refused
    refused = gpud("--sock", str(short_tmp / "x.sock"), "status")
    assert refused.returncode == 2 and f"invalid choice: '{short_tmp / 'x.sock'}'" in refused.stderr


@pytest.mark.parametrize("group", ["root", READERS])
def test_a_refused_connection_says_what_lets_this_user_in(users, short_tmp, group):
    # Guards against "join the gpud group, or use sudo" on a source install, which has neither (issue 39)
    sock_path = short_tmp / "gpud.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock_path))
    listener.listen()
    try:
        os.chown(sock_path, 0, grp.getgrnam(group).gr_gid)
        sock_path.chmod(0o660)
        short_tmp.chmod(0o755)
        as_other = [shutil.which("setpriv", path=SYSTEM_PATH), "--reuid=gpudt-other", "--regid=gpudt-other",
                    "--clear-groups"]
        refused = subprocess.run([*as_other, sys.executable, "-m", "gpud", "status", "--socket", str(sock_path)],
                                 cwd=REPO, capture_output=True, text=True, timeout=60)
    finally:
        listener.close()
    assert refused.returncode == 3
    said = f"no permission to connect to {sock_path} (owner uid 0, group {group}, mode 0660): run the command as root"
    assert said in refused.stderr and "sudo" not in refused.stderr
    if group == READERS:
        assert f"or as a member of group {READERS} (as root: usermod -aG {READERS} gpudt-other" in refused.stderr
    else:
        assert "member of group" not in refused.stderr
