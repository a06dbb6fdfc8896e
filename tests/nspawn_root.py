"""A Debian root booted with systemd-nspawn (Container), and gpud as packaged (Release): what the
end-to-end tests under a real systemd share (test_e2e_systemd, test_e2e_slurm, test_cdi_podman5)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from helpers import SYSTEM_PATH

from gpud import __version__


class Container:
    def __init__(self, root: Path):
        self.root = root
        nspawn = shutil.which("systemd-nspawn", path=SYSTEM_PATH)
        # --private-network: the install and everything after it run with no network at all.
        self.boot = subprocess.Popen([nspawn, "-D", str(root), "--register=no", "--keep-unit", "--private-network",
                                      "-b"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.init = self._find_init()
        # basic.target, not "running": logind may start slowly in a container, and gpud needs none of it.
        self.wait_for(lambda: self.run("systemctl", "is-active", "basic.target").stdout.strip() == "active",
                      "the container's systemd")

    def _find_init(self) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for pid in descendants(self.boot.pid):
                try:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:  # a short-lived process of the boot ended between the listing and this read
                    continue
                if name == "systemd":
                    return pid
            time.sleep(0.2)
        raise AssertionError("the container did not boot")

    def run(self, *command: str, user: str | None = None, check: bool = False) -> subprocess.CompletedProcess:
        prefix = [shutil.which("nsenter", path=SYSTEM_PATH), "-t", str(self.init), "-a"]
        if user:
            prefix += ["runuser", "-u", user, "--"]
        return subprocess.run(prefix + list(command), capture_output=True, text=True, timeout=120, check=check)

    def curl(self, path: str, method: str = "GET", body: dict | None = None, user: str | None = None):
        command = ["curl", "-s", "-w", "\n%{http_code}", "--unix-socket", "/run/gpud/gpud.sock", "-X", method,
                   f"http://localhost{path}"]
        if body is not None:
            command += ["-d", json.dumps(body)]
        text, _, code = self.run(*command, user=user).stdout.rpartition("\n")
        return int(code or 0), text

    def kill(self, signal_name: str, pid: str | int) -> subprocess.CompletedProcess:
        """The shell's own kill: the minimal root has no /bin/kill (procps)."""
        return self.run("sh", "-c", f"kill -{signal_name} {pid}")

    def show(self, prop: str) -> str:
        return self.run("systemctl", "show", "-p", prop, "--value", "gpud").stdout.strip()

    def wait_for(self, check, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}\n{self.gpud_journal()}")

    def gpud_journal(self) -> str:
        """What systemd says of gpud: a wait that timed out shows why (not started, restarted, hung)."""
        status = self.run("systemctl", "status", "--no-pager", "gpud")
        journal = self.run("journalctl", "-u", "gpud", "--no-pager", "-n", "60")
        # who owns what gpud writes at run time: a directory it cannot write stops a simulated node
        owners = self.run("sh", "-c", "ls -lan /run/gpud /run/gpud/*.sysfs /run/gpud/*.sysfs/* 2>&1 | head -60")
        return (status.stdout + status.stderr + owners.stdout + "\n".join(
            line[:2000] for line in journal.stdout.splitlines()[-40:]) + journal.stderr)

    def stop(self) -> None:
        self.boot.terminate()
        try:
            self.boot.wait(30)
        except subprocess.TimeoutExpired:
            self.boot.kill()


def descendants(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1]) == pid:
                    children.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return children + [grandchild for child in children for grandchild in descendants(child)]


def apt_mirror() -> str:
    """The Debian mirror this machine's apt already uses, so the test names none of its own."""
    for source in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]:
        if not source.exists():
            continue
        for line in source.read_text().splitlines():
            words = line.split()
            if words[:1] == ["URIs:"] and not words[1].endswith("-security"):
                return words[1]
            if words[:1] == ["deb"] and "security" not in line:
                return next(word for word in words[1:] if "://" in word)
    raise AssertionError("apt has no Debian mirror configured")


@dataclass(frozen=True)
class Release:
    """One version of gpud as packaged: its .deb and .rpm, and the /etc/gpud/gpud.yaml they ship."""

    version: str
    deb: Path
    rpm: Path
    default_config: str


def build_release(tree: Path, version: str | None = None) -> Release:
    """packaging/build.sh run in `tree` (the checkout, or a copy of it), with GPUD_VERSION when given."""
    env = dict(os.environ, GPUD_VERSION=version) if version else None
    build = subprocess.run(["packaging/build.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    version = version or __version__
    (deb,), (rpm,) = (tree / "dist").glob(f"gpud_{version}_*.deb"), (tree / "dist").glob(f"gpud-{version}-*.rpm")
    return Release(version, deb, rpm, (tree / "etc/gpud/gpud.yaml").read_text())
