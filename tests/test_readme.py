"""The README's two set-up commands do what it says, from a fresh clone; its examples, run in order, print what
it shows (the tour)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
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
import helpers
from helpers import IN_CI, REPO, Lines, accounts_lock, kill_mps_under, until

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
    an ordinary user's gpud serve picks (gpud.base.places.user_runtime_dir, run in a process of that environment)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv, to run both as an ordinary user")
    as_nobody = [shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups"]
    socket_line = next(line[2:] for line in _example_lines() if line.startswith("$ S="))
    env = {"PATH": "/usr/bin:/bin", **({"XDG_RUNTIME_DIR": xdg_runtime_dir} if xdg_runtime_dir else {})}
    readme = subprocess.run([*as_nobody, "bash", "-c", f'{socket_line}; printf %s "$S"'], capture_output=True,
                            text=True, timeout=60, env=env)
    gpud = subprocess.run([*as_nobody, sys.executable, "-c", "import os; from gpud.base.places import user_runtime_dir; print(os.path.join(user_runtime_dir(), 'gpud.sock'), end='')"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert readme.stdout == gpud.stdout and gpud.stdout.endswith("/gpud.sock"), (readme, gpud)


@dataclasses.dataclass(frozen=True)
class ReadersClone:
    """A new ordinary user's clone of the project, after the README's first set-up command ran there."""

    path: Path
    gpus: list  # what its gpud answered on /v1/gpus
    socket_uid: int  # who owned that gpud's socket
    uid: int


@pytest.fixture(scope="module")
def readers_clone(tmp_path_factory) -> ReadersClone:
    """The README's first set-up command, exactly as written, run by a new ordinary user in a fresh
    clone with a plain PATH: its venv is of the system's python3, as a reader's on Debian 12 is (the
    suite's own .venv may be of a Python under /root, which no other user can run). Once its gpud
    answers /v1/gpus it is stopped; the clone stays for the tour."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root")
        pytest.skip("needs root (to create an ordinary user)")
    runuser = shutil.which("runuser", path=helpers.SYSTEM_PATH)
    with accounts_lock():
        subprocess.run([shutil.which("useradd", path=helpers.SYSTEM_PATH), "--create-home", USER],
                       capture_output=True, timeout=300)  # may exist from an earlier run
    uid = int(subprocess.check_output(["id", "-u", USER], timeout=60))
    home = Path(f"/home/{USER}")
    clone = home / "gpud"
    runtime = home / "run"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=300)
    runtime.mkdir(mode=0o700, exist_ok=True)
    subprocess.run(["chown", "-R", f"{USER}:{USER}", str(clone), str(runtime)], check=True, timeout=300)

    log = tmp_path_factory.mktemp("readme") / "readme.log"
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
        socket_uid = socket_path.stat().st_uid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    return ReadersClone(clone, gpus, socket_uid, uid)


@pytest.mark.slow
@pytest.mark.xdist_group("readme")  # one reader's clone for both tests
def test_first_command_serves_a_simulated_dgx_a100_as_an_ordinary_user(readers_clone):
    gpus = readers_clone.gpus
    assert len(gpus) == 8
    assert {g["name"] for g in gpus} == {"NVIDIA A100-SXM4-40GB"}
    assert {g["pci_device_id"] for g in gpus} == {"0x20B010DE"}
    assert all(40000 < g["memory_total_mib"] <= 40960 for g in gpus)
    assert readers_clone.socket_uid == readers_clone.uid


# -- the README tour: its examples, run in order, print what it shows ----------------------------

NOT_RUN = "# not run by the tour: "
NOT_RUN_BLOCK = "<!-- not run by the tour: "
# What the tour cannot do here, each marked so in the README: containers need an image, the packages a
# machine of their own (tests/test_e2e_systemd.py), a process listing a real container's process.
EXPECTED_NOT_RUN = {
    "podman run --rm --device gpud/gpu=MIG-", "podman run --rm --ipc host --device gpud/gpu=GPU-",
    "curl -s --unix-socket /run/gpud/gpud.sock http://localhost/v1/gpus/0/processes",
    "./packaging/build.sh", "dpkg -i", "echo 'simulate: dgx-a100'", "systemctl restart gpud", "systemctl status gpud",
    "curl -s --unix-socket /run/gpud/gpud.sock http://localhost/v1/gpus", "systemctl reload gpud",
    "usermod -aG gpud alice", "apt-get remove gpud", "apt-get purge gpud"}
# Only what differs between runs and machines is masked, the same way in the README and in what ran.
MASKS = [(re.compile(r'"hostname":"[^"]*"'), '"hostname":HOST'), (re.compile(r"\bon \S+, backend"), "on HOST, backend"),
         (re.compile(r'"inventory_read_at":[0-9.]+'), '"inventory_read_at":TIME'),
         # a simulated GPU's CPUs are the machine's (those of its NUMA node, or all online ones)
         (re.compile(r'"cpu_affinity":"[0-9,-]*"'), '"cpu_affinity":CPUS'),
         # the interpreter's patch release: Debian 12's python3 is 3.11.2, a developer's may be another
         (re.compile(r'"python":\{"version":"[0-9.]+"'), '"python":{"version":PYTHON'),
         (re.compile(r"\buid \d+"), "uid UID"), (re.compile(r"/tmp/tmp\.\w+"), "/tmp/tmp.D"),
         # an MPS daemon's pid, with the padding its width gives the column (a fresh machine's pids are short)
         (re.compile(r"^(gpu\S*\s+running\s+)\d+ +"), r"\1PID "), (re.compile(r"\bPID +RESTARTS\b"), "PID RESTARTS")]
SKIPPED = "…"


@dataclasses.dataclass
class Example:
    root: bool  # `# ` (root) or `$ ` (the ordinary user)
    command: str  # as written, with the lines of a here-document
    expected: list[str]
    run: bool


def tour() -> list[Example]:
    """The README's convention: every ```sh block after the set-up is examples: a line starting `$ ` or `# `
    is a command, the lines after it up to the next command (or the block's end) are what it prints; a command
    ending in `<<EOF` takes the lines up to `EOF`. A command with NOT_RUN, or a block after NOT_RUN_BLOCK, is
    not run."""
    after_setup = README.split("## Set-up on a fresh Debian 12 machine", 1)[1].split("\n## ", 1)[1]
    examples: list[Example] = []
    for before, block in re.findall(r"(.*?)```sh\n(.*?)\n```", after_setup, re.S):
        block_runs = not before.rstrip().endswith("-->") or NOT_RUN_BLOCK not in before.rstrip().rsplit("\n", 1)[-1]
        assert block[:2] in ("$ ", "# "), f"a ```sh block that does not start with a command:\n{block}"
        lines = iter(block.splitlines())
        for line in lines:
            if line[:2] in ("$ ", "# "):
                command = line[2:]
                if command.endswith("<<EOF"):
                    command += "\n" + "\n".join(iter(lines.__next__, "EOF")) + "\nEOF"
                examples.append(Example(line[0] == "#", command, [], block_runs and NOT_RUN not in command))
            else:
                examples[-1].expected.append(line)
    return examples


def test_the_tour_leaves_out_exactly_what_cannot_run_here():
    not_run = [example.command for example in tour() if not example.run]
    named = [max((prefix for prefix in EXPECTED_NOT_RUN if command.startswith(prefix)), key=len, default=command)
             for command in not_run]
    assert sorted(named) == sorted(EXPECTED_NOT_RUN), not_run


def masked(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        for pattern, replacement in MASKS:
            line = pattern.sub(replacement, line)
        out.append(line)
    return out


def drift(expected: list[str], actual: list[str]) -> bool:
    """Whether actual differs from expected, where a `…` line stands for any number of lines."""
    pattern = "".join(".*?" if line == SKIPPED else re.escape(line + "\n") for line in masked(expected))
    return re.fullmatch(pattern, "".join(line + "\n" for line in masked(actual)), re.S) is None


class Terminal:
    """One bash reading commands on stdin, as a reader's terminal: variables set by one command are there for
    the next. Each command's output (stdout and stderr) ends at a marker line with its exit status."""

    MARK = "::tour-end::"

    def __init__(self, argv: list[str], env: dict, cwd: Path):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=cwd, start_new_session=True)
        self.lines = Lines(self.proc.stdout, " ".join(argv[:3]))

    def run(self, command: str, timeout: float = 90) -> tuple[int, list[str]]:
        self.proc.stdin.write(f"{command}\necho; echo '{self.MARK}'$?\n")
        self.proc.stdin.flush()
        out = []
        while not (line := self.lines.next(f"the end of {command!r}", timeout)).startswith(self.MARK):
            out.append(line.rstrip("\n"))
        if out and out[-1] == "":
            out.pop()  # the marker's own new line, there to end a last line that had none
        return int(line[len(self.MARK):]), out

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)  # its background jobs too: a non-interactive bash keeps them in its group
        self.proc.wait(30)


def _user_environment(home: Path, runtime: Path | None) -> dict:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
            **({"XDG_RUNTIME_DIR": str(runtime)} if runtime else {})}


@pytest.mark.slow
@pytest.mark.xdist_group("readme")
@pytest.mark.parametrize("with_xdg_runtime_dir", [True, False])
def test_the_readme_tour(readers_clone, short_tmp, with_xdg_runtime_dir):
    """The README's examples in order: `$ ` as an ordinary user (a fresh home, with and without
    XDG_RUNTIME_DIR) against the set-up's gpud run by that user, `# ` as root against the root gpud the
    README starts in a private directory; each prints what the README shows."""
    uid, clone = readers_clone.uid, readers_clone.path
    home, runtime = short_tmp / "home", short_tmp / "run"
    for directory in (home, runtime):
        directory.mkdir(mode=0o700)
        os.chown(directory, uid, uid)
    short_tmp.chmod(0o755)
    no_xdg_runtime = Path(f"/tmp/gpud-{uid}")  # the user's runtime directory without XDG_RUNTIME_DIR
    shutil.rmtree(no_xdg_runtime, ignore_errors=True)  # a fresh node: no simulated state from an earlier run
    env = _user_environment(home, runtime if with_xdg_runtime_dir else None)
    as_user = [shutil.which("runuser", path=helpers.SYSTEM_PATH), "--preserve-environment", "-u", USER, "--"]  # its HOME, not /home/USER
    serve = setup_commands()[0].rsplit(" && ", 1)[1]  # the set-up's gpud, in the reader's clone
    gpud = subprocess.Popen([*as_user, "bash", "-c", serve], cwd=clone, env=env, stdout=(short_tmp / "gpud.log").open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    user = Terminal([*as_user, "bash"], env, clone)
    root = Terminal(["bash"], {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/root",
                               "LANG": "C.UTF-8"}, clone)
    try:
        socket = (runtime / "gpud" if with_xdg_runtime_dir else no_xdg_runtime) / "gpud.sock"
        until(lambda: user.run(f"curl -s --unix-socket {socket} http://localhost/healthz")[1] == ['{"status":"ok"}'],
              timeout=60, what=f"the user's gpud answering on {socket}", interval=0.2)
        drifted = []
        for example in tour():
            if not example.run:
                continue
            status, output = (root if example.root else user).run(example.command)
            if drift(example.expected, output):
                diff = "\n".join(difflib.unified_diff(example.expected, output, "README", "printed", lineterm=""))
                drifted.append(f"{'#' if example.root else '$'} {example.command}  (exit {status})\n{diff}")
        assert not drifted, "the README's examples print otherwise:\n\n" + "\n\n".join(drifted)
    finally:
        root_directory = root.run('printf %s "$D"', timeout=10)[1]  # the README's mktemp -d, under /tmp
        for terminal in (user, root):
            terminal.close()
        os.killpg(gpud.pid, signal.SIGTERM)
        gpud.wait(30)
        if root_directory and root_directory[0].startswith("/tmp/tmp."):
            kill_mps_under(Path(root_directory[0]))  # MPS daemons outlive gpud by design
            shutil.rmtree(root_directory[0], ignore_errors=True)
        shutil.rmtree(no_xdg_runtime, ignore_errors=True)
