"""`gpud device-plugin` and NVIDIA's own device plugin, put the same requests by the kubelet stand-in.

Both run on NVIDIA's mock NVML (../shared/nvidia-mock-nvml, a DGX A100's eight GPUs): NVIDIA's plugin
loads it directly, gpud's plugin reads gpud, whose real NVML backend loads it. Same GPUs, same sharing
file, `--device-list-strategy envvar` for both: the registration, the device IDs, their topology, and
what Allocate gives for replicas must be the same. NVIDIA's plugin puts its sockets in
/var/lib/kubelet/device-plugins whatever it is told, so it runs in a private mount namespace where
that directory is the test's, with the device nodes it looks for (../shared/nvidia-device-plugin/README.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MOCK_NVML_CONFIGS, REPO, SHARED, GpudProcess, mock_nvml_library, need
from kubelet_stand_in import Kubelet

NVIDIA_PLUGIN = SHARED / "nvidia-device-plugin" / "bin" / "nvidia-device-plugin"
MOCK_CONFIG = MOCK_NVML_CONFIGS / "mock-nvml-config-a100.yaml"
SHARING = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
# The namespace NVIDIA's plugin runs in: its own /dev with the nodes it opens, and the test's directory
# as the kubelet's.
NAMESPACE = """set -e
kubelet_dir=$1; shift
mount -t tmpfs tmpfs /dev
mknod -m 666 /dev/null c 1 3; mknod -m 666 /dev/zero c 1 5; mknod -m 666 /dev/urandom c 1 9
for name in nvidia0 nvidia1 nvidia2 nvidia3 nvidia4 nvidia5 nvidia6 nvidia7 nvidiactl nvidia-uvm nvidia-uvm-tools; do
  mknod -m 666 /dev/$name c 1 3
done
mount -t tmpfs tmpfs /var/lib
mkdir -p /var/lib/kubelet/device-plugins
mount --bind "$kubelet_dir" /var/lib/kubelet/device-plugins
exec "$@"
"""


@pytest.fixture(scope="module")
def mock_nvml() -> Path:
    need(NVIDIA_PLUGIN.exists(), f"{NVIDIA_PLUGIN} is absent")
    need(os.geteuid() == 0, "NVIDIA's plugin needs root here (a mount namespace)")
    return mock_nvml_library()


def _env(mock: Path) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": str(mock), "MOCK_NVML_CONFIG": str(MOCK_CONFIG)}


@pytest.mark.slow
def test_the_kubelet_gets_what_nvidias_plugin_gives(mock_nvml, short_tmp):
    (short_tmp / "sharing.yaml").write_text(SHARING)
    (short_tmp / "gpud.yaml").write_text(f"sharing:\n  file: {short_tmp / 'sharing.yaml'}\n"
                                         f"mig:\n  layouts_file: {short_tmp / 'absent.yaml'}\n")
    (short_tmp / "namespace.sh").write_text(NAMESPACE)
    kubelets = {name: Kubelet(_directory(short_tmp / name)) for name in ("nvidia", "gpud")}
    processes = []
    try:
        with (short_tmp / "nvidia.log").open("w") as log:
            processes.append(subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", str(short_tmp / "namespace.sh"),
                 str(short_tmp / "nvidia"), str(NVIDIA_PLUGIN),
                 "--kubelet-socket", str(short_tmp / "nvidia/kubelet.sock"),
                 "--config-file", str(short_tmp / "sharing.yaml"), "--device-list-strategy", "envvar",
                 "--fail-on-init-error=true"], env={**os.environ, **_env(mock_nvml)}, stdout=log,
                stderr=subprocess.STDOUT))
        gpud = GpudProcess(short_tmp, "--config", str(short_tmp / "gpud.yaml"), env=_env(mock_nvml))
        processes.append(gpud.proc)
        gpud.wait_healthy()
        with (short_tmp / "plugin.log").open("w") as log:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "gpud", "device-plugin", "--socket", str(gpud.socket), "--kubelet-dir",
                 str(short_tmp / "gpud"), "--device-list-strategy", "envvar", "--log-format", "json"],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        frames = {}
        for name, kubelet in kubelets.items():
            frames[name] = kubelet.frame_where("nvidia.com/gpu", lambda f: len(f) == 16, timeout=60,
                                               what=f"{name}'s 16 replicas")
        nvidia, ours = kubelets["nvidia"], kubelets["gpud"]
        (theirs_registration,), (our_registration,) = nvidia.registrations, ours.registrations
        assert (our_registration.version, our_registration.resource_name) == (
            theirs_registration.version, theirs_registration.resource_name)
        assert ours.options["nvidia.com/gpu"] == nvidia.options["nvidia.com/gpu"]
        assert sorted(frames["gpud"]) == sorted(frames["nvidia"])  # the same IDs, all Healthy
        assert ours.numa["nvidia.com/gpu"] == nvidia.numa["nvidia.com/gpu"]

        ids = sorted(i for i, _ in frames["nvidia"])  # <uuid>::0, <uuid>::1 of each GPU, in UUID order
        for request in ([ids[0]], [ids[0], ids[1]], [ids[3], ids[0], ids[5]]):
            theirs, given = nvidia.allocate("nvidia.com/gpu", request), ours.allocate("nvidia.com/gpu", request)
            assert dict(given.envs) == dict(theirs.envs), request
            assert given.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(dict.fromkeys(i.split("::")[0] for i in request))
            assert list(given.mounts) == list(theirs.mounts) == [] and not given.annotations and not theirs.annotations
        # Replicas spread across GPUs (`distributed`). NVIDIA's ties fall in Go's map order, which differs
        # run to run: the same kind of answer is compared, not the same IDs.
        for size, must in ((2, []), (3, [ids[4]]), (8, [])):
            for kubelet in (nvidia, ours):
                chosen = kubelet.preferred("nvidia.com/gpu", ids, size, must)
                assert len(chosen) == len({i.split("::")[0] for i in chosen}) == size and set(must) <= set(chosen)
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait(10)
        for kubelet in kubelets.values():
            kubelet.stop()


def _directory(path: Path) -> Path:
    path.mkdir()
    return path
