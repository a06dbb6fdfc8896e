"""Podman 5 (Debian 13's 5.4, CDI library v0.8+, which checks cdiVersion) takes gpud's spec, and refuses
the 0.3.0 spec gpud wrote before. Debian 13 is debootstrapped, as tests/test_e2e_systemd.py does, and
podman runs chrooted in it, in a private mount namespace; the spec goes to the chroot's /etc/cdi, so the
host's runtimes never see it.

gpud's spec here holds device nodes only (cdi.driver_files: false): its driver-file hooks run gpud's
Python, which the Debian 13 root does not have; tests/test_cdi_driver.py runs those with the host's podman."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cdi_library import assert_cdi_library_accepts
from helpers import IN_CI, SYSTEM_PATH, sim_config, start_daemon, stop_daemon, until_async
from nspawn_root import apt_mirror

# The chroot's root must be a mount point (crun sets the propagation of "/"), with /proc, /sys and /dev;
# crun refuses cgroup v2's hybrid mount beside v1 (helpers.hybrid_cgroup2_with_controllers).
CHROOT = """set -e
root=$1; shift
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --make-rslave "$root/sys"
umount "$root/sys/fs/cgroup/unified" 2>/dev/null || true
mount --rbind /dev "$root/dev"
mount -t tmpfs tmpfs "$root/run"
mount -t tmpfs tmpfs "$root/tmp"
exec chroot "$root" "$@"
"""
PODMAN5_RUN = ("env", "PODMAN_IGNORE_CGROUPSV1_WARNING=1", "podman", "--cgroup-manager", "cgroupfs",
               "--storage-driver", "vfs", "run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024",
               "--ulimit", "nproc=1024:1024")


@pytest.fixture(scope="module")
def trixie(tmp_path_factory) -> Path:
    needed = ("debootstrap", "unshare", "chroot")
    if os.geteuid() != 0 or any(shutil.which(tool, path=SYSTEM_PATH) is None for tool in needed):
        if IN_CI:
            pytest.fail("CI runs as root with debootstrap (scripts/test-all installs it)")
        pytest.skip("needs root, debootstrap, unshare and chroot")
    root = tmp_path_factory.mktemp("trixie")
    made = subprocess.run([shutil.which("debootstrap", path=SYSTEM_PATH), "--variant=minbase",
                           "--include=podman,crun,busybox-static", "trixie", str(root), apt_mirror()],
                          capture_output=True, text=True, timeout=1200)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    for directory in ("bin", "proc", "sys", "dev", "etc", "tmp"):
        (root / "rootfs" / directory).mkdir(parents=True)
    shutil.copy(root / "usr" / "bin" / "busybox", root / "rootfs" / "bin" / "busybox")
    (root / "etc" / "cdi").mkdir()
    return root


def podman5(root: Path, device: str, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "--mount", "--fork", "sh", "-c", CHROOT, "sh", str(root), *PODMAN5_RUN,
                           "--device", f"gpud/gpu={device}", "--rootfs", "/rootfs", "/bin/busybox", "sh", "-c", script],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
async def test_podman_5_takes_gpuds_spec_and_refuses_a_0_3_0_one(trixie, short_tmp):
    version = subprocess.run(["chroot", str(trixie), "dpkg-query", "-W", "-f", "${Version}", "podman"],
                             capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("5."), version
    # a simulated node's own device nodes (links to /dev/null, which the chroot's /dev has too)
    config = sim_config(short_tmp, "A100-SXM4-40GB:2").with_overrides(**{"cdi.driver_files": False})
    node = await start_daemon(config)
    try:
        async def written():
            _, view = await node.get("/v1/cdi")
            return view["spec"]
        spec = await until_async(written, 2, "the spec")
        _, gpus = await node.get("/v1/gpus")
    finally:
        await stop_daemon(node)
    assert_cdi_library_accepts(spec)
    (trixie / "etc" / "cdi" / "gpud-gpu.json").write_text(json.dumps(spec))
    for device, gpu in (("0", "nvidia0"), (gpus["gpus"][1]["uuid"], "nvidia1")):
        inside = podman5(trixie, device, "ls -l /dev")
        assert inside.returncode == 0, inside.stderr
        nodes = {line.split()[-1]: line for line in inside.stdout.splitlines() if " nvidia" in line}
        assert sorted(nodes) == sorted([gpu, "nvidia-uvm", "nvidia-uvm-tools", "nvidiactl"]), inside.stdout
        assert all(line.startswith("c") and " 1,   3 " in line for line in nodes.values()), nodes
    # what gpud wrote before, cdiVersion 0.3.0 for the same devices: podman 5 refuses the whole spec
    (trixie / "etc" / "cdi" / "gpud-gpu.json").write_text(json.dumps({**spec, "cdiVersion": "0.3.0"}))
    refused = podman5(trixie, "0", "true")
    assert refused.returncode != 0 and "unresolvable CDI devices gpud/gpu=0" in refused.stderr, refused.stderr
