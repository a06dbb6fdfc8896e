"""An ordinary user's gpud on the simulated DGX A100, as the README's first command runs it: MIG applies
and GPU resets need root (nvml.h, nvmlDeviceSetMigMode: "Requires root user"; nvidia-smi(1), -r: "Requires
root"), and the simulated driver refuses them to any other uid with NO_PERMISSION, as a real one does.
gpud refuses them before touching anything (after naming what blocks a reset, which the operator must
free either way), keeps no layout it could not apply, and says in /healthz and `gpud status` when a
layout it holds failed.

gpud runs here as uid 65534 (setpriv), its CLI too, as the README's ordinary user runs both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, GpudProcess, curl_as

from gpud.mig.desired import Desired, DesiredStore, GpuDesired
from gpud.nvml.sim import SimulatedNvml

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                 reason="needs root and setpriv, to run gpud as an ordinary user")]

NOBODY = 65534
AS_NOBODY = (shutil.which("setpriv") or "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
BALANCED = {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}  # all-balanced on an A100-SXM4-40GB


@pytest.fixture
def home(short_tmp):
    """The ordinary user's directory: its gpud's socket, state and simulated GPUs."""
    os.chown(short_tmp, NOBODY, NOBODY)
    short_tmp.chmod(0o755)
    return short_tmp


def serve(home) -> GpudProcess:
    gpud = GpudProcess(home, "--simulate", "dgx-a100", "--sim-state", str(home / "sim.json"), run_as=AS_NOBODY)
    try:
        gpud.wait_for(lambda: call(home, "GET", "/healthz")[0] == 200, what="healthz 200")
    except BaseException:
        gpud.stop()  # not left behind by a failed test
        raise
    return gpud


def call(home, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
    """The API as the ordinary user asks it (gpud's CLI, as root, trusts no socket in another user's
    directory: gpud.client.untrusted_because)."""
    status, text = curl_as("nobody", home / "gpud.sock", method, path, body)
    return status, json.loads(text) if text else None


def gpud_cli(home, *args: str) -> tuple[int, dict | str]:
    """`gpud --json ARGS` as the ordinary user: (exit code, the JSON error on stderr, else stdout)."""
    result = subprocess.run([*AS_NOBODY, sys.executable, "-m", "gpud", "--json", *args], capture_output=True,
                            text=True, timeout=60, cwd=REPO,
                            env={"PATH": os.environ["PATH"], "HOME": str(home),
                                 "GPUD_SOCKET": str(home / "gpud.sock")})
    if result.returncode != 0 and result.stderr.startswith("{"):
        return result.returncode, json.loads(result.stderr)["error"]
    return result.returncode, result.stdout


def mig_complaints(gpud: GpudProcess) -> list[dict]:
    return [e for e in gpud.log_events() if e.get("component") == "mig" and e.get("level") in ("warning", "error")]


def resets_tried(gpud: GpudProcess) -> list[dict]:
    return [e for e in gpud.log_events() if e.get("event") in ("gpu_reset", "gpu_reset_failed")]


def gpu_uuids(home) -> list[str]:
    nvml = SimulatedNvml("dgx-a100", home / "sim.json")
    nvml.nvmlInit()
    try:
        return [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())]
    finally:
        nvml.nvmlShutdown()


def test_blockers_first_then_a_refusal_for_want_of_root_and_nothing_is_touched_or_kept(home):
    """The issue's run: a process on GPU 1, nv-hostengine on GPU 3, then a MIG apply and a reset of GPU 0,
    which on an NVSwitch A100 without Fabric Manager takes every GPU with it (nvidia-smi(1), -r)."""
    SimulatedNvml("dgx-a100", home / "sim.json").sim_set_fabric_manager(False)  # systemctl stop nvidia-fabricmanager
    os.chown(home / "sim.json", NOBODY, NOBODY)
    gpud = serve(home)
    try:
        call(home, "POST", "/v1/sim/processes", {"gpu": 1, "pids": [1]})
        call(home, "POST", "/v1/sim/holders", {"gpu": 3, "process": "nv-hostengine", "pid": 4242})
        simulated = (home / "sim.json").read_bytes()

        for command in (("mig", "apply", "all-balanced"), ("gpus", "reset", "0")):
            code, error = gpud_cli(home, *command)
            assert code == 1 and error["code"] == "reset-blocked", (command, error)
            assert [b["gpu"] for b in error["blockers"]] == [1, 3] and error["reset_gpus"] == list(range(8))

        call(home, "POST", "/v1/sim/processes", {"gpu": 1, "pids": []})
        call(home, "POST", "/v1/sim/holders", {"gpu": 3, "release": True})
        simulated = (home / "sim.json").read_bytes()
        for command, what in ((("mig", "apply", "all-balanced"), "MIG changes"),
                              (("gpus", "reset", "0"), "GPU resets")):
            code, error = gpud_cli(home, *command)
            assert code == 1 and isinstance(error, dict) and error["code"] == "needs-root", (command, error)
            assert error["message"].startswith(f"gpud runs as uid {NOBODY}, not root"), error
            assert what in error["message"] and "run gpud as root" in error["message"], error
            assert "Nothing was changed" in error["message"], error
        assert (home / "sim.json").read_bytes() == simulated  # no mode set, no reset tried
        assert not (home / "state/mig-desired.json").exists()  # the refused layout is not desired
        assert mig_complaints(gpud) == [] and resets_tried(gpud) == []  # no Insufficient Permissions, no rollback
        mig = call(home, "GET", "/v1/mig")[1]
        assert mig["layout"] is None and mig["state"] == "success", mig
        assert gpud_cli(home, "status")[0] == 0  # nothing failed, nothing is pending
    finally:
        assert gpud.stop() == 0

    gpud = serve(home)  # a later start retries nothing
    try:
        gpud.wait_for(lambda: call(home, "GET", "/v1/mig")[1]["state"] == "success", what="MIG settled")
        assert mig_complaints(gpud) == [] and not (home / "state/mig-desired.json").exists()
    finally:
        assert gpud.stop() == 0


def test_a_layout_left_desired_by_an_earlier_gpud_is_withdrawn_once_not_retried_on_every_start(home):
    """What the issue's run left behind (an earlier gpud saved the layout it then failed to apply): the next
    start says once why it cannot apply it and withdraws it; `gpud status` says so; later starts are quiet."""
    (home / "state").mkdir()
    DesiredStore(home / "state/mig-desired.json").save(
        Desired("all-balanced", "api", False, {uuid: GpuDesired(True, BALANCED) for uuid in gpu_uuids(home)},
                "builtin"))
    for path in (home / "state", home / "state/mig-desired.json", home / "sim.json"):
        os.chown(path, NOBODY, NOBODY)
    simulated = (home / "sim.json").read_bytes()
    gpud = serve(home)
    try:
        mig = gpud.wait_for(lambda: (m := call(home, "GET", "/v1/mig")[1])["state"] not in ("pending", "applying")
                            and m, what="MIG settled")
        assert mig["state"] == "failed" and mig["layout"] == "all-balanced", mig
        assert f"uid {NOBODY}, not root" in mig["error"] and "withdrawn" in mig["error"], mig
        complaints = mig_complaints(gpud)
        assert [e["event"] for e in complaints] == ["mig_desired_withdrawn"], complaints
        assert (home / "sim.json").read_bytes() == simulated and not (home / "state/mig-desired.json").exists()
        health = call(home, "GET", "/healthz")[1]
        assert health["status"] == "degraded" and "all-balanced" in health["reason"], health
        code, status = gpud_cli(home, "status")
        assert code == 1 and "all-balanced" in status, status
    finally:
        assert gpud.stop() == 0

    gpud = serve(home)
    try:
        gpud.wait_for(lambda: call(home, "GET", "/v1/mig")[1]["state"] == "success", what="MIG settled")
        assert mig_complaints(gpud) == [] and call(home, "GET", "/healthz")[1] == {"status": "ok"}
        assert gpud_cli(home, "status")[0] == 0
    finally:
        assert gpud.stop() == 0
