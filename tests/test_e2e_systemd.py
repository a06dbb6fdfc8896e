"""The operator's path under a real systemd: a Debian 12 root booted with systemd-nspawn, the .deb
installed there without network, `systemctl start gpud` on a simulated node, then what an
operator does: status, curl, reload, restart with MPS running, a non-admin user, a stalled
watchdog, remove and purge."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import IN_CI, REPO, SYSTEM_PATH

# Both modules build the packages into build/ and dist/: the same pytest-xdist worker runs them, one
# after the other.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packages")]
PACKAGES = "systemd,systemd-sysv,dbus,python3,curl,procps,passwd,nvidia-cuda-mps"


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
            for pid in _descendants(self.boot.pid):
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
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

    def show(self, prop: str) -> str:
        return self.run("systemctl", "show", "-p", prop, "--value", "gpud").stdout.strip()

    def wait_for(self, check, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}")

    def stop(self) -> None:
        self.boot.terminate()
        try:
            self.boot.wait(30)
        except subprocess.TimeoutExpired:
            self.boot.kill()


def _descendants(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1]) == pid:
                    children.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return children + [grandchild for child in children for grandchild in _descendants(child)]


def _apt_mirror() -> str:
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


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    needed = ("debootstrap", "systemd-nspawn", "nsenter", "dpkg-deb")
    if os.geteuid() != 0 or any(shutil.which(tool, path=SYSTEM_PATH) is None for tool in needed):
        if IN_CI:
            pytest.fail(f"CI runs as root with {', '.join(needed)} (scripts/test-all installs them)")
        pytest.skip("needs root, debootstrap and systemd-nspawn")
    build = subprocess.run(["packaging/build.sh"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-2000:]
    root = tmp_path_factory.mktemp("debian12")
    root.chmod(0o755)  # it is the container's "/": its users must be able to traverse it
    subprocess.run([shutil.which("debootstrap", path=SYSTEM_PATH), "--variant=minbase",
                    "--components=main,non-free", f"--include={PACKAGES}", "bookworm", str(root),
                    _apt_mirror()], check=True, capture_output=True, timeout=1200)
    from gpud import __version__
    shutil.copy(REPO / "dist" / f"gpud_{__version__}_amd64.deb", root / "root" / "gpud.deb")
    dropin = root / "etc/systemd/system/gpud.service.d"
    dropin.mkdir(parents=True)
    # The operator's drop-in that puts this install on a simulated node, with MPS on and a short
    # watchdog so the stall test is quick.
    (dropin / "simulate.conf").write_text("[Service]\nWatchdogSec=4s\n")
    box = Container.__new__(Container)
    try:
        box.__init__(root)
        yield box
    finally:
        if getattr(box, "boot", None):
            box.stop()


def test_install_start_reload_restart_access_watchdog_remove_purge(container):
    box = container
    install = box.run("dpkg", "-i", "/root/gpud.deb")
    assert install.returncode == 0, install.stdout + install.stderr
    (box.root / "etc/gpud/gpud.yaml").write_text("simulate: dgx-a100\nmps:\n  enabled: true\n  devices: [0]\n")
    box.run("systemctl", "restart", "gpud", check=True)
    box.wait_for(lambda: box.show("ActiveState") == "active" and "GPUs" in box.show("StatusText"), "READY")
    assert box.show("StatusText").startswith("8 GPUs")
    assert "8 GPUs" in box.run("systemctl", "status", "gpud", "--no-pager").stdout

    status, text = box.curl("/v1/gpus")
    assert status == 200 and len(json.loads(text)["gpus"]) == 8
    box.wait_for(lambda: '"state":"running"' in box.curl("/v1/mps")[1], "the MPS daemon")
    mps_pid = json.loads(box.curl("/v1/mps")[1])["daemons"][0]["pid"]
    main_pid = box.show("MainPID")

    box.run("systemctl", "reload", "gpud", check=True)
    box.wait_for(lambda: box.show("ActiveState") == "active", "reloaded")
    assert box.show("MainPID") == main_pid  # reload keeps the process and its connections
    assert json.loads(box.curl("/v1/mps")[1])["daemons"][0]["pid"] == mps_pid
    box.run("systemctl", "restart", "gpud", check=True)
    box.wait_for(lambda: box.curl("/healthz")[0] == 200, "gpud after restart")
    assert box.show("MainPID") != main_pid
    assert json.loads(box.curl("/v1/mps")[1])["daemons"][0]["pid"] == mps_pid  # MPS survived, adopted

    box.run("useradd", "-M", "-G", "gpud", "gpud-reader", check=True)
    assert box.curl("/v1/gpus", user="gpud-reader")[0] == 200
    assert box.curl("/v1/mig", "PUT", {"layout": "all-balanced"}, user="gpud-reader")[0] == 403

    stalled = box.show("MainPID")
    box.run("kill", "-STOP", stalled, check=True)  # a hung event loop: no more WATCHDOG=1
    box.wait_for(lambda: box.show("MainPID") not in (stalled, "0") and box.show("ActiveState") == "active",
                 "systemd to catch the stalled watchdog and restart gpud", timeout=60)
    assert "watchdog" in box.run("journalctl", "-u", "gpud", "--no-pager").stdout.lower()

    mps_pid = json.loads(box.curl("/v1/mps")[1])["daemons"][0]["pid"]
    box.run("apt-get", "remove", "-y", "gpud", check=True)
    assert not (box.root / "usr/bin/gpud").exists() and (box.root / "etc/gpud/gpud.yaml").exists()
    assert box.run("kill", "-0", str(mps_pid)).returncode != 0  # its MPS daemon went with it
    box.run("apt-get", "purge", "-y", "gpud", check=True)
    for leftover in ("etc/gpud", "var/lib/gpud", "var/log/gpud", "opt/gpud", "run/gpud",
                     "usr/lib/systemd/system/gpud.service", "etc/systemd/system/multi-user.target.wants/gpud.service"):
        assert not box.run("test", "-e", f"/{leftover}").returncode == 0, leftover


def test_the_rpm_installs_into_the_root_with_its_files_and_scriptlets(container):
    rpm = shutil.which("rpm", path=SYSTEM_PATH)
    if rpm is None:
        pytest.fail("scripts/test-all installs rpm") if IN_CI else pytest.skip("rpm is not installed")
    from gpud import __version__
    package = REPO / "dist" / f"gpud-{__version__}-1.x86_64.rpm"
    root = container.root
    subprocess.run([rpm, "--root", str(root), "--initdb"], check=True)
    # --nodeps: the Debian root's python3 is dpkg's, unknown to rpm's database.
    result = subprocess.run([rpm, "--root", str(root), "-i", "--nodeps", str(package)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for path in ("usr/bin/gpud", "usr/lib/systemd/system/gpud.service", "usr/lib/systemd/system/gpud.socket",
                 "etc/gpud/gpud.yaml", "opt/gpud/lib/gpud/cli.py"):
        assert (root / path).exists(), path
    assert "gpud-admin:" in (root / "etc/group").read_text()  # the postinstall scriptlet ran
    erase = subprocess.run([rpm, "--root", str(root), "-e", "gpud"], capture_output=True, text=True, timeout=300)
    assert erase.returncode == 0, erase.stderr
    assert not (root / "usr/bin/gpud").exists()


def test_a_gpu_process_in_a_systemd_run_scope_is_owned_by_that_scope(container):
    """gpud on a simulated node names the transient scope `systemd-run --scope` puts a process in,
    and drops the process once systemd stops the scope."""
    box = container
    if box.run("dpkg", "-s", "gpud").returncode != 0:  # run alone, or after the test that purges it
        install = box.run("dpkg", "-i", "/root/gpud.deb")
        assert install.returncode == 0, install.stdout + install.stderr
    (box.root / "etc/gpud/gpud.yaml").write_text("simulate: H100-SXM5-80GB:1\nhealth:\n  check_interval_s: 0.5\n")
    box.run("systemctl", "restart", "gpud", check=True)
    box.wait_for(lambda: box.curl("/healthz")[0] == 200, "gpud")
    unit = "gpud-e2e-job.scope"
    box.run("sh", "-c", f"systemd-run --unit={unit.removesuffix('.scope')} --scope sleep 300 >/dev/null 2>&1 &",
            check=True)
    def show(prop: str) -> str:
        return box.run("systemctl", "show", "-p", prop, "--value", unit).stdout.strip()
    box.wait_for(lambda: show("ActiveState") == "active", "the scope")
    cgroup = show("ControlGroup")
    # cgroup v2, or a v1 host's systemd hierarchy (the container's systemd uses the host's layout)
    procs = " ".join(f"/sys/fs/cgroup{mount}{cgroup}/cgroup.procs" for mount in ("", "/systemd", "/unified"))
    pid = int(box.run("sh", "-c", f"cat {procs} 2>/dev/null").stdout.split()[0])
    status, text = box.curl("/v1/sim/processes", "POST", {"gpu": 0, "processes": [{"pid": pid,
                                                                                  "used_memory_mib": 1024}]})
    assert status == 200, text

    def owner():
        processes = json.loads(box.curl("/v1/gpus/0/processes")[1])["devices"][0]["processes"]
        return next((p["owner"] for p in processes if p["pid"] == pid), None)
    box.wait_for(lambda: owner() is not None, "the process listed")
    assert owner()["kind"] == "systemd" and owner()["systemd_unit"] == unit, owner()
    assert f'systemd_unit="{unit}"' in box.curl("/metrics")[1]
    box.run("systemctl", "stop", unit, check=True)
    box.wait_for(lambda: owner() is None, "the process gone once its scope stopped")
    assert f'pid="{pid}"' not in box.curl("/metrics")[1]
