"""Crash safety: gpud killed at each NVML change of an apply, in turn, converges when restarted."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest

from gpud.client import DaemonUnreachable
from gpud.nvml.reader import NodeReader
from gpud.nvml.sim.scenarios import fill_with_gpu_instances, started

PRESET = "A100-SXM4-40GB:2"
BALANCED = {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}


def stage_all_1g(state_path):
    sim = started(PRESET, state_path)
    try:
        fill_with_gpu_instances(sim, sim.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    finally:
        sim.nvmlShutdown()


def hardware_instances(state_path):
    """What the simulated hardware holds, per GPU: the GPU instances and how many compute instances each has."""
    sim = started(PRESET, state_path)
    try:
        inventory = NodeReader().read(sim, {})
    finally:
        sim.nvmlShutdown()
    return [[len(gi.compute_instances) for gi in gpu.mig.instances] for gpu in inventory.gpus]


@pytest.mark.slow
@pytest.mark.parametrize("start_from", ["empty", "all-1g.5gb"])
def test_killed_at_every_mutation_then_converges(run_gpud, short_tmp, start_from):
    state = short_tmp / "sim.json"
    args = ("--simulate", PRESET, "--sim-state", str(state), "--config", str(short_tmp / "gpud.yaml"))
    (short_tmp / "gpud.yaml").write_text(f"mig:\n  layouts_file: {short_tmp / 'absent.yaml'}\n")

    def fresh_node():
        state.unlink(missing_ok=True)
        shutil.rmtree(short_tmp / "state", ignore_errors=True)  # its files and directories (a simulated CDI spec's)
        if start_from == "all-1g.5gb":
            stage_all_1g(state)

    # First, count the mutations of an uninterrupted apply.
    fresh_node()
    gpud = run_gpud(*args)
    gpud.wait_healthy()
    _status, body = gpud.client.request("PUT", "/v1/mig?wait=true", {"layout": "all-balanced"})
    total = sum(p["mutations"] for p in body["plan"])
    assert gpud.stop() == 0
    assert total >= 8

    for crash_at in range(1, total + 1):
        fresh_node()
        doomed = run_gpud(*args, env={"GPUD_SIM_CRASH_AFTER_COMMITS": str(crash_at)})
        doomed.wait_healthy()
        try:
            doomed.client.request("PUT", "/v1/mig", {"layout": "all-balanced"})
        except DaemonUnreachable:
            pass  # killed before its answer went out
        assert doomed.proc.wait(30) == -9, f"gpud was not killed at mutation {crash_at}"

        revived = run_gpud(*args)
        revived.wait_healthy()
        view = revived.wait_for(lambda: (lambda v: v if v["state"] == "success" else None)(
            revived.client.get("/v1/mig")), what=f"convergence after a crash at mutation {crash_at}")
        assert view["layout"] == "all-balanced" and view["in_sync"], (crash_at, view)
        for gpu in revived.client.get("/v1/gpus")["gpus"]:
            assert Counter(d["profile"] for d in gpu["mig"]["devices"]) == BALANCED, (crash_at, gpu["index"])
        assert hardware_instances(state) == [[1, 1, 1, 1]] * 2  # nothing leaked or duplicated on the hardware
        assert revived.stop() == 0
