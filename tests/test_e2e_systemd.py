"""The operator's path under a real systemd: a Debian 12 root and a Debian 13 root (Python 3.11 and 3.13)
each booted with systemd-nspawn, the same .deb installed there without network, `systemctl start gpud`
on a simulated node, then what an operator does: status, curl, reload, restart with MPS running, a
non-admin user, a stalled watchdog, remove and purge; and upgrades to the next version, downgrades and
reinstalls that keep the operator's config, the MIG layout and the running MPS daemons (the .rpm too,
with `rpm --root`, as far as that goes without systemd)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import IN_CI, REPO, SYSTEM_PATH
from nspawn_root import Container, Release, apt_mirror, build_release


# Both modules build the packages into build/ and dist/: the same pytest-xdist worker runs them, one
# after the other.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packages")]
# No procps: the unit must not need /bin/kill (issue 20, item 2); the tests signal with sh's own kill.
PACKAGES = "systemd,systemd-sysv,dbus,python3,curl,passwd,nvidia-cuda-mps"
# Debian 12 (python3 3.11) and Debian 13 (python3 3.13): the same .deb boots on each, one after the other.
DISTRIBUTIONS = ("bookworm", "trixie")


def _next_version(version: str) -> str:
    bumped = re.sub(r"\d+$", lambda last: str(int(last[0]) + 1), version)
    assert bumped != version, f"no version follows {version!r}: it does not end in a number"
    return bumped


@pytest.fixture(scope="module")
def next_release(release, tmp_path_factory) -> Release:
    """Version N+1: the checkout's files copied (the checkout and its dist/ stay as they are), the
    default gpud.yaml changed as a new release may change it, packaged with the next version."""
    tree = tmp_path_factory.mktemp("next-release")
    skipped = shutil.ignore_patterns(".*", "build", "dist", "__pycache__", "*.egg-info")
    for entry in REPO.iterdir():
        if skipped(str(REPO), [entry.name]):
            continue
        if entry.is_dir():
            shutil.copytree(entry, tree / entry.name, ignore=skipped)
        else:
            shutil.copy2(entry, tree / entry.name)
    # The packaging tools and the downloaded wheels are the checkout's, not fetched again.
    (tree / "build").mkdir()
    for cache in ("tools", "pip-cache", "uv-cache"):
        if (REPO / "build" / cache).is_dir():
            (tree / "build" / cache).symlink_to(REPO / "build" / cache)
    config = tree / "etc/gpud/gpud.yaml"
    config.write_text(config.read_text() + "\n# A default that came with the next release.\n")
    return build_release(tree, _next_version(release.version))


@pytest.fixture(scope="module", params=DISTRIBUTIONS)
def container(request, release, tmp_path_factory):
    codename = request.param
    root = tmp_path_factory.mktemp(codename)
    root.chmod(0o755)  # it is the container's "/": its users must be able to traverse it
    subprocess.run([shutil.which("debootstrap", path=SYSTEM_PATH), "--variant=minbase",
                    "--components=main,non-free", f"--include={PACKAGES}", codename, str(root),
                    apt_mirror()], check=True, capture_output=True, timeout=1200)
    shutil.copy(release.deb, root / "root" / "gpud.deb")
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
    # postinstall compiled the libraries for the distribution's python3 (3.11 on Debian 12, 3.13 on 13)
    abi = box.run("python3", "-c", "import sys; print('%d%d' % sys.version_info[:2])", check=True).stdout.strip()
    assert (box.root / f"usr/lib/gpud/common/gpud/cli/__pycache__/__init__.cpython-{abi}.pyc").is_file()
    assert list((box.root / f"usr/lib/gpud/cp{abi}").glob("aiohttp/__pycache__/web.cpython-*.pyc"))
    # A real member of gpud's group, and an MPS daemon of its own user, as on a node with Kubernetes.
    box.run("useradd", "-M", "-G", "gpud", "gpud-reader", check=True)
    box.run("sh", "-c", "id gpud-mps >/dev/null 2>&1 || useradd -r -M gpud-mps", check=True)
    config = "simulate: dgx-a100\nmps:\n  enabled: true\n  devices: [0]\n  user: gpud-mps\n"
    (box.root / "etc/gpud/gpud.yaml").write_text(config)
    box.run("systemctl", "restart", "gpud", check=True)
    box.wait_for(lambda: box.show("ActiveState") == "active" and "GPUs" in box.show("StatusText"), "READY")
    assert box.show("StatusText").startswith("8 GPUs")
    assert "8 GPUs" in box.run("systemctl", "status", "gpud", "--no-pager").stdout

    status, text = box.curl("/v1/gpus")
    assert status == 200 and len(json.loads(text)["gpus"]) == 8
    # The CDI spec's createContainer hooks are gpud's own, run from the package: the interpreter and the
    # hook file the spec names are those of the installed system, and the hook runs there (refusing a
    # command it does not have, as in test_cdi_driver, so that no container is touched).
    box.wait_for(lambda: json.loads(box.curl("/v1/cdi")[1])["spec"], "the CDI spec")
    spec = json.loads(box.curl("/v1/cdi")[1])["spec"]
    hooks = [hook for edits in [spec.get("containerEdits", {}), *(d["containerEdits"] for d in spec["devices"])]
             for hook in edits.get("hooks", [])]
    assert hooks and {tuple(hook["args"][1:3]) for hook in hooks} == {("-I", "/usr/lib/gpud/common/gpud/cdi/hook.py")}
    refused = box.run(hooks[0]["path"], *hooks[0]["args"][1:3], "enable-cuda-compat")
    assert refused.returncode == 2 and "invalid choice" in refused.stderr, refused.stdout + refused.stderr
    box.wait_for(lambda: '"state":"running"' in box.curl("/v1/mps")[1], "the MPS daemon")
    mps_pid = json.loads(box.curl("/v1/mps")[1])["daemons"][0]["pid"]
    main_pid = box.show("MainPID")

    pipe = json.loads(box.curl("/v1/mps")[1])["daemons"][0]["pipe_directory"]
    owners = lambda: box.run("stat", "-c", "%U:%G %a %n", "/run/gpud", "/run/gpud/gpud.sock",  # noqa: E731
                             pipe, check=True).stdout.split("\n")[:3]
    as_packaged = ["root:root 755 /run/gpud", "root:gpud 660 /run/gpud/gpud.sock", f"gpud-mps:gpud-mps 755 {pipe}"]
    assert owners() == as_packaged
    # The unit reloads without procps (issue 20, item 2): no kill(1) in this root.
    assert not any((box.root / path).exists() for path in ("bin/kill", "usr/bin/kill"))
    # Each reload is one ExecReload= run, for which systemd sets up RuntimeDirectory= again (and chowns
    # it recursively where its owner differs from the unit's): the group keeps the socket, mps.user its pipes.
    for attempt in range(3):
        box.run("systemctl", "reload", "gpud", check=True)
        assert box.show("ActiveState") == "active"  # `systemctl reload` returned once the reload was done
        assert box.show("MainPID") == main_pid  # reload keeps the process and its connections
        assert owners() == as_packaged, attempt
        assert box.curl("/v1/gpus", user="gpud-reader")[0] == 200, attempt
        daemon = json.loads(box.curl("/v1/mps")[1])["daemons"][0]
        assert (daemon["pid"], daemon["state"]) == (mps_pid, "running"), attempt
    # A config gpud refuses fails the reload, and the running gpud goes on with the config it has.
    (box.root / "etc/gpud/gpud.yaml").write_text(config + "mps_typo: 1\n")
    refused = box.run("systemctl", "reload", "gpud")
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert box.show("ActiveState") == "active" and box.show("MainPID") == main_pid
    (box.root / "etc/gpud/gpud.yaml").write_text(config)
    box.run("systemctl", "reload", "gpud", check=True)
    box.run("systemctl", "restart", "gpud", check=True)
    box.wait_for(lambda: box.curl("/healthz")[0] == 200, "gpud after restart")
    assert box.show("MainPID") != main_pid
    assert json.loads(box.curl("/v1/mps")[1])["daemons"][0]["pid"] == mps_pid  # MPS survived, adopted

    assert box.curl("/v1/gpus", user="gpud-reader")[0] == 200
    assert box.curl("/v1/mig", "PUT", {"layout": "all-balanced"}, user="gpud-reader")[0] == 403

    # A short watchdog for the stall alone, so it is caught quickly: kept for the other steps too, it
    # had a gpud slowed by a loaded machine killed over and over.
    dropin = box.root / "etc/systemd/system/gpud.service.d/short-watchdog.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text("[Service]\nWatchdogSec=4s\n")
    box.run("systemctl", "daemon-reload", check=True)
    box.run("systemctl", "restart", "gpud", check=True)
    box.wait_for(lambda: box.curl("/healthz")[0] == 200, "gpud with a short watchdog")
    stalled = box.show("MainPID")
    box.kill("STOP", stalled).check_returncode()  # a hung event loop: no more WATCHDOG=1
    box.wait_for(lambda: box.show("MainPID") not in (stalled, "0") and box.show("ActiveState") == "active",
                 "systemd to catch the stalled watchdog and restart gpud", timeout=60)
    assert "watchdog" in box.run("journalctl", "-u", "gpud", "--no-pager").stdout.lower()
    dropin.unlink()
    box.run("systemctl", "daemon-reload", check=True)

    mps_pid = json.loads(box.curl("/v1/mps")[1])["daemons"][0]["pid"]
    box.run("apt-get", "remove", "-y", "gpud", check=True)
    assert not (box.root / "usr/bin/gpud").exists() and (box.root / "etc/gpud/gpud.yaml").exists()
    assert box.kill("0", mps_pid).returncode != 0  # its MPS daemon went with it
    box.run("apt-get", "purge", "-y", "gpud", check=True)
    for leftover in ("etc/gpud", "var/lib/gpud", "var/log/gpud", "usr/lib/gpud", "opt/gpud", "run/gpud",
                     "usr/lib/systemd/system/gpud.service", "etc/systemd/system/multi-user.target.wants/gpud.service"):
        assert not box.run("test", "-e", f"/{leftover}").returncode == 0, leftover


def _rpm_in(root: Path):
    """rpm acting on the package database and files of `root` (its scriptlets run chrooted there)."""
    rpm = shutil.which("rpm", path=SYSTEM_PATH)
    if rpm is None:
        pytest.fail("scripts/test-all installs rpm") if IN_CI else pytest.skip("rpm is not installed")
    subprocess.run([rpm, "--root", str(root), "--initdb"], check=True, timeout=600)
    return lambda *args: subprocess.run([rpm, "--root", str(root), *args], capture_output=True, text=True,
                                        timeout=300)


# The rpm checks need no systemd and no second distribution: Debian 12's root only.
@pytest.mark.parametrize("container", ["bookworm"], indirect=True)
def test_the_rpm_installs_into_the_root_with_its_files_and_scriptlets(container, release):
    """%post follows Fedora's %systemd_post: the presets decide whether gpud is enabled, and nothing is
    started (tests/test_packaging_rpm.py runs the scriptlets where systemd runs). Fedora and RHEL ship
    `disable *` as the last preset (fedora-release's 99-default-disable.preset), so gpud is disabled
    unless a preset of the operator's enables it; the enablement is read back with the root's own
    systemctl."""
    root = container.root
    rpm = _rpm_in(root)
    presets = root / "etc/systemd/system-preset"
    presets.mkdir(parents=True, exist_ok=True)
    (presets / "99-default-disable.preset").write_text("disable *\n")
    try:
        for operator_preset, expected in ((None, "disabled"), ("enable gpud.service\n", "enabled")):
            if operator_preset:
                (presets / "80-gpud.preset").write_text(operator_preset)
            # --nodeps: the Debian root's python3 is dpkg's, unknown to rpm's database.
            result = rpm("-i", "--nodeps", str(release.rpm))
            assert result.returncode == 0, result.stderr
            for path in ("usr/bin/gpud", "usr/lib/systemd/system/gpud.service", "usr/lib/systemd/system/gpud.socket",
                         "etc/gpud/gpud.yaml"):
                assert (root / path).exists(), path
            cli = [path for path in rpm("-ql", "gpud").stdout.split() if path.endswith("/gpud/cli/__init__.py")]
            assert cli and all((root / path.lstrip("/")).exists() for path in cli)
            assert "gpud-admin:" in (root / "etc/group").read_text()  # the postinstall scriptlet ran
            assert _enabled_in(root, "gpud.service") == expected, operator_preset
            # the socket and the two plugins are not the package's to turn on, preset or not
            for unit in ("gpud.socket", "gpud-device-plugin.service", "gpud-dra-plugin.service"):
                assert _enabled_in(root, unit) == "disabled", unit
            erase = rpm("-e", "gpud")
            assert erase.returncode == 0, erase.stderr
            assert not (root / "usr/bin/gpud").exists()
            assert _enabled_in(root, "gpud.service") != "enabled"
    finally:
        shutil.rmtree(presets)


def _enabled_in(root: Path, unit: str) -> str:
    """`systemctl is-enabled` of the root's own systemctl, chrooted (no systemd runs there)."""
    return subprocess.run(["chroot", str(root), "systemctl", "is-enabled", unit], capture_output=True, text=True,
                          timeout=600).stdout.strip()


def _install_unless_whole(box: Container) -> None:
    """The .deb installed, where a test run alone, or after one that purged it, finds it missing. dpkg's
    record alone is not enough: the rpm tests install and erase the same files with rpm, so an earlier
    test that failed half-way can leave dpkg's gpud "installed" with its files gone."""
    status = box.run("dpkg-query", "-W", "-f", "${db:Status-Status}", "gpud").stdout
    if status == "installed" and box.run("test", "-f", "/usr/lib/gpud/common/gpud/__init__.py").returncode == 0:
        return
    install = box.run("dpkg", "-i", "/root/gpud.deb")
    assert install.returncode == 0, install.stdout + install.stderr


def test_a_gpu_process_in_a_systemd_run_scope_is_owned_by_that_scope(container):
    """gpud on a simulated node names the transient scope `systemd-run --scope` puts a process in,
    and drops the process once systemd stops the scope."""
    box = container
    _install_unless_whole(box)
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


# linux/capability.h: the bit of each capability gpud.service keeps.
CAPABILITY_BITS = {"CAP_CHOWN": 0, "CAP_DAC_READ_SEARCH": 2, "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7,
                   "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21, "CAP_MKNOD": 27, "CAP_SYSLOG": 34}


def _sandbox_of(box: Container, pid: str) -> dict[str, str]:
    """The kernel's view of a process's sandbox: /proc/<pid>/status lines (proc(5))."""
    lines = box.run("cat", f"/proc/{pid}/status", check=True).stdout.splitlines()
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    return {"CapBnd": status["CapBnd"].strip(), "NoNewPrivs": status["NoNewPrivs"].strip(),
            "Seccomp": status["Seccomp"].strip(), "Uid": status["Uid"].split()[1]}


def test_the_sandbox_holds_gpud_and_its_mps_daemons_and_mig_mps_reset_still_work(container):
    """What `systemd-analyze security` scores is what the kernel enforces on gpud and on the MPS
    daemon it starts as mps.user, and the privileged work still succeeds under it: a MIG apply
    with its GPU reset, an MPS daemon started as another user, an explicit reset, the device plugin."""
    box = container
    _install_unless_whole(box)
    box.run("sh", "-c", "id gpud-mps >/dev/null 2>&1 || useradd -r -M gpud-mps", check=True)
    mps_uid = box.run("id", "-u", "gpud-mps", check=True).stdout.strip()
    (box.root / "etc/gpud/gpud.yaml").write_text(
        "simulate: A100-SXM4-40GB:2\nmps:\n  enabled: true\n  devices: [1]\n  user: gpud-mps\n")
    box.run("systemctl", "restart", "gpud", check=True)
    box.wait_for(lambda: box.curl("/healthz")[0] == 200, "gpud")

    unit = (box.root / "usr/lib/systemd/system/gpud.service").read_text()
    kept = next(line for line in unit.splitlines() if line.startswith("CapabilityBoundingSet=")).split("=", 1)[1]
    # within the container's own bounding set: systemd-nspawn keeps no CAP_SYSLOG, a host's systemd does
    container_bounding = int(_sandbox_of(box, "1")["CapBnd"], 16)
    bounding = f"{sum(1 << CAPABILITY_BITS[name] for name in kept.split()) & container_bounding:016x}"
    gpud = _sandbox_of(box, box.show("MainPID"))
    assert gpud == {"CapBnd": bounding, "NoNewPrivs": "1", "Seccomp": "2", "Uid": "0"}, gpud
    assert box.show("DevicePolicy") == "closed" and box.show("UMask") == "0022"

    def mps_daemon():
        daemons = json.loads(box.curl("/v1/mps")[1])["daemons"]
        return daemons[0] if daemons and daemons[0]["state"] == "running" else None
    box.wait_for(mps_daemon, "the MPS daemon as gpud-mps")
    mps = _sandbox_of(box, str(mps_daemon()["pid"]))
    assert mps == {"CapBnd": bounding, "NoNewPrivs": "1", "Seccomp": "2", "Uid": mps_uid}, mps

    layout = ("version: v1\nmig-configs:\n  sandboxed:\n    - devices: [0]\n      mig-enabled: true\n"
              "      mig-devices: {\"1g.5gb\": 7}\n")
    status, text = box.curl("/v1/mig?wait=true", "PUT", {"layout": "sandboxed", "config": layout})
    assert status == 200, text  # an A100 changes MIG mode with a GPU reset
    assert json.loads(box.curl("/v1/mig")[1])["in_sync"]
    status, text = box.curl("/v1/gpus/0/reset", "POST", {})
    assert status == 200 and 0 in json.loads(text)["reset"], text
    box.wait_for(mps_daemon, "the MPS daemon back after the resets")
    assert _sandbox_of(box, str(mps_daemon()["pid"]))["Uid"] == mps_uid

    # The device plugin, with no capability, no device and only AF_UNIX, still serves its
    # endpoints beside the kubelet's socket.
    plugins = "/var/lib/kubelet/device-plugins"
    box.run("mkdir", "-p", plugins, check=True)
    box.run("systemctl", "start", "gpud-device-plugin", check=True)
    try:
        box.wait_for(lambda: box.run("sh", "-c", f"ls {plugins}/*.sock").returncode == 0, "the plugin's endpoints")
        pid = box.run("systemctl", "show", "-p", "MainPID", "--value", "gpud-device-plugin").stdout.strip()
        plugin = _sandbox_of(box, pid)
        assert plugin == {"CapBnd": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2", "Uid": "0"}, plugin
    finally:
        box.run("systemctl", "stop", "gpud-device-plugin")
        box.run("rm", "-rf", "/var/lib/kubelet")


# The operator's edit of /etc/gpud/gpud.yaml, which no package change may touch: two simulated H100s,
# MPS on every device, the simulated GPUs' state where it outlives gpud's restarts as a driver's does.
OPERATOR_CONFIG = """\
# edited by the operator
simulate: H100-SXM5-80GB:2
sim_state: /run/gpud/sim-e2e.json
mps:
  enabled: true
  devices: all
"""
# GPU 0 split into two 3g.40gb MIG devices, GPU 1 whole: with MPS on every device, three MPS daemons.
MIG_LAYOUT = {"layout": "e2e-upgrade", "config": """\
version: v1
mig-configs:
  e2e-upgrade:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
    - devices: [1]
      mig-enabled: false
"""}


@dataclass(frozen=True)
class NodeState:
    """What a package change must leave as it was, and gpud's process, which it must replace."""

    main_pid: str
    mps: dict  # daemon name -> PID, of the running ones
    mig: dict  # the layout, whether in sync, each GPU's actual MIG state
    mig_applies: int  # entries in the MIG apply history
    simulated_gpus: str  # the simulator's state file: rewritten by every MIG change it sees

    def kept(self, before: NodeState) -> bool:
        return (self.mps, self.mig, self.mig_applies, self.simulated_gpus) == \
            (before.mps, before.mig, before.mig_applies, before.simulated_gpus)


def _node_state(box: Container) -> NodeState | None:
    """None while gpud does not answer (restarting)."""
    try:
        mig, mps = json.loads(box.curl("/v1/mig")[1]), json.loads(box.curl("/v1/mps")[1])
    except ValueError:
        return None
    return NodeState(box.show("MainPID"), {d["name"]: d["pid"] for d in mps["daemons"] if d["state"] == "running"},
                     {"layout": mig["layout"], "in_sync": mig["in_sync"], "gpus": [g["actual"] for g in mig["gpus"]]},
                     len(mig["history"]), box.run("cat", "/run/gpud/sim-e2e.json").stdout)


def _state_after_package_change(box: Container, before: NodeState, timeout: float = 30) -> NodeState:
    """The node as the new gpud sees it once it adopted what ran before (or the last state seen)."""
    deadline = time.monotonic() + timeout
    while True:
        after = _node_state(box)
        if after is not None and after.kept(before) or time.monotonic() > deadline:
            assert after is not None, "gpud does not answer after the package change"
            return after
        time.sleep(0.3)


def _assert_kept(before: NodeState, after: NodeState) -> None:
    assert after.main_pid not in (before.main_pid, "0", "")  # gpud restarted on the new code
    assert after.mps == before.mps  # the same MPS daemons, adopted by the new gpud
    assert after.mig == before.mig and after.mig["in_sync"]  # the same layout, in sync
    assert after.mig_applies == before.mig_applies  # no MIG apply ran
    assert after.simulated_gpus == before.simulated_gpus  # the GPUs saw no MIG change at all


def test_upgrade_downgrade_and_reinstall_keep_the_config_mig_layout_and_mps_daemons(container, release,
                                                                                   next_release):
    """Each package change leaves: dpkg's record of the version installed, gpud enabled and running that
    version in a new process, the operator's gpud.yaml as edited (the changed package's default beside
    it as gpud.yaml.dpkg-dist), the MIG layout with no MIG operation, the MPS daemons with their PIDs."""
    box = container
    if box.run("dpkg-query", "-W", "gpud").returncode == 0:  # an earlier test's install, or what is left of it
        box.run("apt-get", "purge", "-y", "gpud", check=True)
    shutil.copy(next_release.deb, box.root / "root" / "gpud-next.deb")
    install = box.run("dpkg", "-i", "/root/gpud.deb")
    assert install.returncode == 0, install.stdout + install.stderr
    config = box.root / "etc/gpud/gpud.yaml"
    config.write_text(OPERATOR_CONFIG)
    box.run("systemctl", "restart", "gpud", check=True)
    box.wait_for(lambda: box.curl("/healthz")[0] == 200, "gpud on the operator's config")
    status, text = box.curl("/v1/mig?wait=true", "PUT", MIG_LAYOUT)
    assert status == 200, text
    box.wait_for(lambda: len(_node_state(box).mps) == 3, "three MPS daemons")
    state = _node_state(box)
    assert state.mig["in_sync"] and state.mig["gpus"][0] == {"mig_enabled": True, "devices": {"3g.40gb": 2}}

    for change, deb, installed in (("upgrade", "gpud-next.deb", next_release), ("downgrade", "gpud.deb", release),
                                   ("reinstall", "gpud.deb", release)):
        # what `apt install ./gpud.deb` does, without the conffile prompt: keep the operator's file
        result = box.run("dpkg", "-i", "--force-confdef", "--force-confold", f"/root/{deb}")
        assert result.returncode == 0, (change, result.stdout + result.stderr)
        assert box.run("dpkg-query", "-W", "-f", "${Version}", "gpud").stdout == installed.version, change
        assert config.read_text() == OPERATOR_CONFIG, change
        assert (box.root / "etc/gpud/gpud.yaml.dpkg-dist").read_text() == installed.default_config, change
        assert box.run("systemctl", "is-enabled", "gpud").stdout.strip() == "enabled", change
        after = _state_after_package_change(box, state)
        assert json.loads(box.curl("/v1/node")[1])["gpud_version"] == installed.version, change
        _assert_kept(state, after)
        state = after

    box.run("apt-get", "remove", "-y", "gpud", check=True)
    for pid in state.mps.values():  # a removal takes the MPS daemons with it
        assert box.kill("0", pid).returncode != 0, pid
    assert box.run("systemctl", "is-enabled", "gpud").stdout.strip() != "enabled"
    # Installed again after the removal (its configuration kept): enabled and running, as before it.
    install = box.run("dpkg", "-i", "/root/gpud.deb")
    assert install.returncode == 0, install.stdout + install.stderr
    assert config.read_text() == OPERATOR_CONFIG
    assert box.run("systemctl", "is-enabled", "gpud").stdout.strip() == "enabled"
    box.wait_for(lambda: box.curl("/healthz")[0] == 200, "gpud installed again")
    box.run("apt-get", "purge", "-y", "gpud", check=True)


def _mps_daemon_in(root: Path, pipe: str) -> int | None:
    """The PID of an MPS control daemon chrooted in `root` that serves `pipe`."""
    wanted = f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "nvidia-cuda-mps" and \
                    Path(os.readlink(entry / "root")) == root.resolve() and \
                    wanted in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except OSError:
            continue  # gone meanwhile
    return None


@pytest.mark.parametrize("container", ["bookworm"], indirect=True)
def test_the_rpm_upgrade_downgrade_and_reinstall_keep_the_config_enablement_and_mps(container, release,
                                                                                   next_release):
    """rpm runs the new package's %post before the old one's %preun and %postun: those must neither
    disable gpud nor stop its MPS daemons. There is no running systemd here (scriptlets chrooted into
    the root): the unit's enablement stands for what they would do to the service. The operator's
    preset enables gpud (Debian's root has no `disable *`: unlisted units are enabled by a preset)."""
    root = container.root
    rpm = _rpm_in(root)
    if rpm("-q", "gpud").returncode == 0:  # an earlier test's install
        rpm("-e", "gpud")
    presets = root / "etc/systemd/system-preset"
    presets.mkdir(parents=True, exist_ok=True)
    (presets / "80-gpud.preset").write_text("enable gpud.service\n")
    install = rpm("-i", "--nodeps", str(release.rpm))
    assert install.returncode == 0, install.stderr
    config = root / "etc/gpud/gpud.yaml"
    config.write_text(OPERATOR_CONFIG)
    # An MPS control daemon where gpud keeps its daemons' pipes, as gpud would have started it.
    pipe, logs = "/run/gpud/mps/gpu0/pipe", "/var/log/gpud/mps/gpu0"
    for directory in (pipe, logs):
        (root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
    enabled = lambda: _enabled_in(root, "gpud.service")  # noqa: E731
    assert enabled() == "enabled"
    subprocess.run(["chroot", str(root), "env", f"CUDA_MPS_PIPE_DIRECTORY={pipe}", f"CUDA_MPS_LOG_DIRECTORY={logs}",
                    "nvidia-cuda-mps-control", "-d"], check=True, timeout=30)
    try:
        mps_pid = _mps_daemon_in(root, pipe)
        assert mps_pid is not None
        for change, flags, installed in (("upgrade", ["-U"], next_release),
                                         ("downgrade", ["-U", "--oldpackage"], release),
                                         ("reinstall", ["--reinstall"], release)):
            result = rpm(*flags, "--nodeps", str(installed.rpm))
            assert result.returncode == 0, (change, result.stderr)
            assert rpm("-q", "--qf", "%{VERSION}", "gpud").stdout == installed.version, change
            assert config.read_text() == OPERATOR_CONFIG, change
            assert (root / "etc/gpud/gpud.yaml.rpmnew").read_text() == installed.default_config, change
            assert enabled() == "enabled", change
            assert _mps_daemon_in(root, pipe) == mps_pid, change
        erase = rpm("-e", "gpud")
        assert erase.returncode == 0, erase.stderr
        assert enabled() != "enabled"
        deadline = time.monotonic() + 10
        while _mps_daemon_in(root, pipe) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _mps_daemon_in(root, pipe) is None  # a removal takes the MPS daemons with it
        assert (root / "etc/gpud/gpud.yaml.rpmsave").read_text() == OPERATOR_CONFIG
    finally:
        leftover = _mps_daemon_in(root, pipe)
        if leftover is not None:
            os.kill(leftover, signal.SIGKILL)
        shutil.rmtree(presets, ignore_errors=True)


FABRIC_MANAGER_CHECK = """
import json, os, sys
lib = "/usr/lib/gpud"
sys.path[:0] = [os.path.join(lib, "cp%d%d" % sys.version_info[:2]), os.path.join(lib, "common")]
from gpud.health.node import fabric_manager_problem, fabric_manager_unit
unit = "nvidia-fabricmanager.service"
properties = fabric_manager_unit(unit)
print(json.dumps([properties, fabric_manager_problem(unit, properties)]))
"""


@pytest.mark.parametrize("container", ["bookworm"], indirect=True)
def test_the_fabric_manager_check_reads_real_systemd(container):
    """gpud's Fabric Manager check, as packaged, asks the container's real systemd: a unit not installed,
    one that failed, one that runs."""
    box = container
    _install_unless_whole(box)

    def check() -> tuple[dict | None, list | None]:
        done = box.run("python3", "-I", "-c", FABRIC_MANAGER_CHECK)
        assert done.returncode == 0, done.stdout + done.stderr
        return tuple(json.loads(done.stdout))

    properties, problem = check()
    assert properties["LoadState"] == "not-found" and problem[0] == "unhealthy" and "not installed" in problem[2]
    unit = box.root / "etc/systemd/system/nvidia-fabricmanager.service"
    try:
        unit.write_text("[Service]\nExecStart=/bin/false\n")
        box.run("systemctl", "daemon-reload", check=True)
        box.run("systemctl", "start", "nvidia-fabricmanager")
        box.wait_for(lambda: box.run("systemctl", "is-failed", "nvidia-fabricmanager").stdout.strip() == "failed",
                     "the unit failed")
        properties, problem = check()
        assert properties["ActiveState"] == "failed" and "is failed/failed, result exit-code" in problem[2], problem
        unit.write_text("[Service]\nExecStart=/bin/sleep infinity\n")
        box.run("systemctl", "daemon-reload", check=True)
        box.run("systemctl", "reset-failed", "nvidia-fabricmanager")
        box.run("systemctl", "start", "nvidia-fabricmanager", check=True)
        properties, problem = check()
        assert properties["ActiveState"] == "active" and problem is None
    finally:
        box.run("systemctl", "stop", "nvidia-fabricmanager")
        unit.unlink(missing_ok=True)
        box.run("systemctl", "daemon-reload")
