"""The README's two set-up commands do what it says, from a fresh clone."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import IN_CI, REPO, accounts_lock

README = (REPO / "README.md").read_text()
USER = "gpud-readme"


def setup_commands() -> list[str]:
    section = README.split("## Set-up on a fresh Debian 12 machine", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.+?)\n```", section, re.S)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second():
    commands = setup_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert "--simulate dgx-a100" in commands[0]
    test_command = commands[1].removeprefix("sudo ").strip()
    ci = (REPO / ".ci" / "run").read_text()
    assert f"exec {test_command}" in ci


def test_setup_runs_on_a_fresh_debian_12_without_sudo_and_says_what_root_installs_first():
    """A fresh Debian 12 has no sudo, git or curl (issue 21): the set-up commands use no sudo, and the
    section names, as root's step, the packages that the set-up and the examples need."""
    section = README.split("## Set-up on a fresh Debian 12 machine", 1)[1].split("\n## ", 1)[0]
    assert not any("sudo" in command for command in setup_commands())
    root_step = re.search(r"As root \(.*?\), install\s+what this README uses: `apt-get install -y ([^`]+)`",
                          section, re.S)
    assert root_step and set(root_step[1].split()) >= {"python3-venv", "git", "curl"}
    assert "git clone" in section  # how to get the source


def _example_lines() -> list[str]:
    after_setup = README.split("## Set-up on a fresh Debian 12 machine", 1)[1].split("\n## ", 1)[1]
    return [line for block in re.findall(r"```sh\n(.+?)\n```", after_setup, re.S) for line in block.splitlines()]


def test_the_examples_put_the_set_ups_gpud_on_the_path_before_calling_a_bare_gpud():
    """The set-up makes .venv/bin/gpud only: a bare `gpud` in an example works once the PATH has it."""
    lines = _example_lines()
    first_gpud = next(i for i, line in enumerate(lines) if re.match(r"[$#] gpud ", line))
    assert "$ export PATH=$PWD/.venv/bin:$PATH" in lines[:first_gpud]
    path = subprocess.run(["bash", "-c", f"cd {REPO} && {lines[lines.index('$ export PATH=$PWD/.venv/bin:$PATH')][2:]}"
                           " && command -v gpud"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    assert path.stdout.strip() == str(REPO / ".venv" / "bin" / "gpud"), path.stderr


@pytest.mark.parametrize("xdg_runtime_dir", ["/run/user/1000", None])
def test_the_examples_socket_is_where_an_ordinary_users_gpud_listens(xdg_runtime_dir):
    """With $XDG_RUNTIME_DIR and without it (su, sudo -u, cron), the README's S is the socket that
    an ordinary user's gpud serve picks (gpud.config.user_runtime_dir, run in a process of that environment)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv, to run both as an ordinary user")
    as_nobody = [shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups"]
    socket_line = next(line[2:] for line in _example_lines() if line.startswith("$ S="))
    env = {"PATH": "/usr/bin:/bin", **({"XDG_RUNTIME_DIR": xdg_runtime_dir} if xdg_runtime_dir else {})}
    readme = subprocess.run([*as_nobody, "bash", "-c", f'{socket_line}; printf %s "$S"'], capture_output=True,
                            text=True, timeout=60, env=env)
    gpud = subprocess.run([*as_nobody, sys.executable, "-c", "from gpud.config import user_runtime_dir; print(user_runtime_dir() / 'gpud.sock', end='')"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert readme.stdout == gpud.stdout and gpud.stdout.endswith("/gpud.sock"), (readme, gpud)


@pytest.mark.slow
def test_first_command_serves_a_simulated_dgx_a100_as_an_ordinary_user(tmp_path):
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root")
        pytest.skip("needs root (to create an ordinary user)")
    system_path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    runuser = shutil.which("runuser", path=system_path)
    with accounts_lock():
        subprocess.run([shutil.which("useradd", path=system_path), "--create-home", USER],
                       capture_output=True, timeout=300)  # may exist from an earlier run
    home = Path(f"/home/{USER}")
    clone = home / "gpud"
    runtime = home / "run"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=300)
    runtime.mkdir(mode=0o700, exist_ok=True)
    subprocess.run(["chown", "-R", f"{USER}:{USER}", str(clone), str(runtime)], check=True, timeout=300)

    log = tmp_path / "readme.log"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime),
           "LANG": "C.UTF-8"}
    proc = subprocess.Popen([runuser, "-u", USER, "--", "bash", "-c", setup_commands()[0]], cwd=clone,
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    socket_path = runtime / "gpud" / "gpud.sock"
    try:
        deadline = time.monotonic() + 600
        gpus = None
        while time.monotonic() < deadline and proc.poll() is None:
            if socket_path.exists():
                answer = subprocess.run(["curl", "-s", "--unix-socket", str(socket_path),
                                         "http://localhost/v1/gpus"], capture_output=True, text=True, timeout=300)
                if answer.stdout.startswith('{"gpus"'):
                    gpus = json.loads(answer.stdout)["gpus"]
                    break
            time.sleep(0.5)
        assert gpus is not None, f"no answer on {socket_path}:\n{log.read_text()[-3000:]}"
        assert len(gpus) == 8
        assert {g["name"] for g in gpus} == {"NVIDIA A100-SXM4-40GB"}
        assert {g["pci_device_id"] for g in gpus} == {"0x20B010DE"}
        assert all(40000 < g["memory_total_mib"] <= 40960 for g in gpus)
        assert socket_path.stat().st_uid == int(subprocess.check_output(["id", "-u", USER], timeout=300))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
