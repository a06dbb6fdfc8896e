"""The CDI library's own verdict on a spec, through NVIDIA's nvidia-ctk (../shared/nvidia-container-toolkit,
which vendors tags.cncf.io/container-device-interface v1.1.0: the validation containerd 2.x, CRI-O and
podman 5 apply). Every CDI test passes every spec it produces through assert_cdi_library_accepts.

Debian's podman 4.3 cannot judge: it vendors the library before v0.5.4, which added the cdiVersion
check, and so does Debian 12's golang-github-container-orchestrated-devices-container-device-interface-dev
(0.5.2): both accept a spec that today's runtimes refuse whole."""

from __future__ import annotations

import contextlib
import fcntl
import json
import subprocess
import tempfile
from pathlib import Path

from helpers import IN_CI, SHARED

NVIDIA_CTK = SHARED / "nvidia-container-toolkit" / "bin" / "nvidia-ctk"
REGISTRY_ERRORS = "The following registry errors were reported"
# The container runtimes' spec directory podman 4.3 reads (it has no setting for another one), shared
# by tests in parallel processes: they take the lock while their spec is there.
RUNTIME_SPEC_DIR = Path("/var/run/cdi")
PODMAN_LOCK = Path("/tmp/gpud-tests-cdi.lock")


def need_nvidia_ctk() -> None:
    import pytest
    if not NVIDIA_CTK.exists():
        if IN_CI:
            pytest.fail(f"CI always has {NVIDIA_CTK}")
        pytest.skip(f"{NVIDIA_CTK} is absent: no CDI library to judge the spec")


def cdi_library_verdict(spec: dict) -> tuple[list[str], str]:
    """(the devices the library lists, its registry errors or ""), for the spec alone in a directory.
    nvidia-ctk exits 0 either way; a refused spec is a warning line and its devices are not listed."""
    need_nvidia_ctk()
    with tempfile.TemporaryDirectory(prefix="gpud-cdi-verdict-") as directory:
        (Path(directory) / "gpud-gpu.json").write_text(json.dumps(spec))
        listed = subprocess.run([NVIDIA_CTK, "cdi", "list", "--spec-dir", directory], capture_output=True,
                                text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    errors = listed.stderr.partition(REGISTRY_ERRORS)[2]
    return listed.stdout.split(), errors


def assert_cdi_library_accepts(spec: dict) -> None:
    """The library loads the spec and lists every device in it, by its fully qualified name."""
    devices, errors = cdi_library_verdict(spec)
    assert not errors, f"the CDI library refuses the spec: {errors.strip()}"
    assert sorted(devices) == sorted(f"{spec['kind']}={device['name']}" for device in spec["devices"]), devices


@contextlib.contextmanager
def gpud_on_the_runtimes_spec_dir(run_gpud, tmp: Path, config: str, *args: str):
    """A simulated gpud (args: --simulate ...) whose config (its text) has it write its spec where podman
    4.3 reads specs, alone there while it runs: tests in parallel processes take turns. Its spec is
    removed after."""
    (tmp / "gpud.yaml").write_text(config)
    with PODMAN_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        gpud = run_gpud(*args, "--sim-state", str(tmp / "sim.json"), "--config", str(tmp / "gpud.yaml"))
        try:
            gpud.wait_healthy()
            yield gpud
        finally:
            gpud.stop()
            (RUNTIME_SPEC_DIR / "gpud-gpu.json").unlink(missing_ok=True)
