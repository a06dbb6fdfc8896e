"""The README's two set-up commands do what it says, from a fresh clone."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
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


@pytest.mark.slow
def test_first_command_serves_a_simulated_dgx_a100_as_an_ordinary_user(tmp_path):
    if os.geteuid() != 0 or shutil.which("sudo") is None:
        if IN_CI:
            pytest.fail("CI runs as root with sudo installed (scripts/test-all installs it)")
        pytest.skip("needs root (to create an ordinary user) and sudo")
    system_path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    runuser = shutil.which("runuser", path=system_path)
    with accounts_lock():
        subprocess.run([shutil.which("useradd", path=system_path), "--create-home", USER],
                       capture_output=True, timeout=300)  # may exist from an earlier run
    sudoers = Path(f"/etc/sudoers.d/{USER}")
    sudoers.write_text(f"{USER} ALL=(root) NOPASSWD: /usr/bin/apt-get\n")
    sudoers.chmod(0o440)
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
        sudoers.unlink(missing_ok=True)
