"""packaging/build.sh: the .deb and .rpm, their metadata, and that the packaged gpud runs offline on
the OS's python3 alone (no venv, no network). Installing them into a booted system is issue 7's
nspawn test, still to come."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import IN_CI, REPO

from gpud.client import ApiFailure, Client, DaemonUnreachable

# Both modules build the packages into build/ and dist/: the same pytest-xdist worker runs them, one
# after the other.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packages")]
OS_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="module")
def packages():
    if shutil.which("dpkg-deb") is None or not Path(OS_PYTHON).exists():
        if IN_CI:
            pytest.fail("CI runs on Debian 12, with dpkg-deb and python3")
        pytest.skip("needs dpkg-deb and /usr/bin/python3")
    result = subprocess.run(["packaging/build.sh"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    from gpud import __version__
    deb, rpm = REPO / "dist" / f"gpud_{__version__}_amd64.deb", REPO / "dist" / f"gpud-{__version__}-1.x86_64.rpm"
    assert deb.exists() and rpm.exists()
    return deb, rpm


def test_deb_metadata_conffiles_and_scripts(packages):
    deb, _ = packages
    info = subprocess.run(["dpkg-deb", "-I", str(deb)], capture_output=True, text=True, check=True).stdout
    assert "Package: gpud" in info and "Depends: python3 (>= 3.11)" in info
    conffiles = subprocess.run(["dpkg-deb", "--ctrl-tarfile", str(deb)], capture_output=True, check=True).stdout
    assert b"conffiles" in conffiles and b"postinst" in conffiles and b"prerm" in conffiles
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    for path in ("./usr/bin/gpud", "./usr/lib/systemd/system/gpud.service", "./usr/lib/systemd/system/gpud.socket",
                 "./etc/gpud/gpud.yaml", "./etc/gpud/mig-layouts.yaml", "./opt/gpud/lib/aiohttp/",
                 "./opt/gpud/lib/gpud/mig/data/mig-layouts.yaml", "./opt/gpud/lib/gpud/health/xids.yaml",
                 "./usr/share/man/man1/gpud.1.gz", "./usr/share/bash-completion/completions/gpud",
                 "./usr/share/zsh/vendor-completions/_gpud", "./usr/lib/systemd/system/gpud-device-plugin.service",
                 "./opt/gpud/lib/grpc/", "./opt/gpud/lib/gpud/device_plugin/api_pb2.py",
                 "./opt/gpud/lib/gpud/device_plugin/api_pb2_grpc.py"):
        assert path in listing, path


def test_the_packaged_gpud_runs_on_the_os_python_alone(packages, short_tmp):
    deb, _ = packages
    root = short_tmp / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    launcher = (root / "usr/bin/gpud").read_text().replace("/opt/gpud/lib", str(root / "opt/gpud/lib"))
    (root / "gpud-here").write_text(launcher)
    command = [OS_PYTHON, "-I", str(root / "gpud-here")]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(short_tmp)}  # nothing from the venv or the user
    version = subprocess.run(command + ["--version"], capture_output=True, text=True, env=env, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("gpud "), version.stderr
    # the device plugin's gRPC modules (generated at build time) load: it gets as far as the kubelet's directory
    plugin = subprocess.run(command + ["device-plugin", "--kubelet-dir", str(short_tmp / "none"), "--log-format",
                                       "json"], capture_output=True, text=True, env=env, timeout=60)
    assert plugin.returncode == 2 and "kubelet_dir_missing" in plugin.stdout, plugin.stdout + plugin.stderr
    sock = short_tmp / "p.sock"
    proc = subprocess.Popen(command + ["serve", "--simulate", "t4", "--socket", str(sock), "--sim-state",
                                       str(short_tmp / "sim.json"), "--state-dir", str(short_tmp / "state")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client = Client(sock, timeout=5)
        deadline = time.monotonic() + 30
        gpus = None
        while time.monotonic() < deadline and gpus is None and proc.poll() is None:
            try:
                gpus = client.get("/v1/gpus")["gpus"]
            except (DaemonUnreachable, ApiFailure):  # not up yet, or still starting
                time.sleep(0.1)
        assert gpus and gpus[0]["name"] == "Tesla T4", proc.stderr.read().decode()[-2000:] if proc.poll() else ""
    finally:
        proc.terminate()
        proc.wait(10)


def test_rpm_metadata_config_files_and_scriptlets(packages):
    _, rpm = packages
    if shutil.which("rpm") is None:
        if IN_CI:
            pytest.fail("CI installs rpm (scripts/test-all)")
        pytest.skip("rpm is not installed")
    query = lambda *flags: subprocess.run(["rpm", "-qp", *flags, str(rpm)], capture_output=True, text=True,  # noqa: E731
                                          check=True).stdout
    assert query("-c").split() == ["/etc/gpud/gpud.yaml", "/etc/gpud/mig-layouts.yaml"]
    scripts = query("--scripts")
    assert "postinstall scriptlet" in scripts and "groupadd --system gpud" in scripts
    assert "/usr/lib/systemd/system/gpud.service" in query("-l")
    assert "python3 >= 3.11" in query("--requires")
