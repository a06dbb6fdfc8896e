"""Crash safety of dynamic MIG: gpud killed (SIGKILL) right after each NVML change of a claim's prepare and
unprepare converges when restarted: no orphaned instance, none made twice, the records and the GPU agree,
and the DRA plugin's retry gets the answer it would have had, asked at once as the restarted gpud answers (the
plugin waits out gpud's start-up convergence)."""

from __future__ import annotations

import shutil

import pytest

from gpud.client import Client, DaemonUnreachable
from gpud.dra.owner import GpudOwner
from gpud.nvml.reader import NodeReader
from gpud.nvml.sim.scenarios import started

PRESET = "H100-SXM5-80GB:2"
CLAIM = "5a6b7c8d-0000-4000-8000-000000000001"
# Prepare: MIG mode on, the GPU instance, its compute instance; unprepare: CI, GI, MIG mode off.
PREPARE_CHANGES, UNPREPARE_CHANGES = 3, 3


def hardware(state_path):
    """Per GPU: (MIG mode, [(placement start, compute instances)]) as the simulated hardware holds them."""
    sim = started(PRESET, state_path)
    try:
        inventory = NodeReader().read(sim, {})
    finally:
        sim.nvmlShutdown()
    return [(gpu.mig.mode, [(gi.placement.start, len(gi.compute_instances)) for gi in gpu.mig.instances])
            for gpu in inventory.gpus]


def until_answered(gpud, method, path, body=None):
    """The answer once start-up convergence is over (until then a claim is answered 503, and retried)."""
    answer = []
    gpud.wait_for(lambda: answer.append(gpud.client.request(method, path, body, ok_statuses=(503,)))
                  or answer[-1][0] != 503, what=f"{method} {path} past start-up")
    return answer[-1]


@pytest.mark.slow
def test_killed_after_every_change_of_a_claim_converges(run_gpud, short_tmp):
    state = short_tmp / "sim.json"
    config = short_tmp / "gpud.yaml"
    config.write_text(f"mig:\n  layouts_file: {short_tmp / 'absent.yaml'}\ndra:\n  dynamic_mig_gpus: [0]\n")
    args = ("--simulate", PRESET, "--sim-state", str(state), "--config", str(config))
    path = f"/v1/mig/dynamic/{CLAIM}"

    for crash_at in range(1, PREPARE_CHANGES + UNPREPARE_CHANGES + 1):
        state.unlink(missing_ok=True)
        shutil.rmtree(short_tmp / "state", ignore_errors=True)  # its files and directories (a simulated CDI spec's)
        doomed = run_gpud(*args, env={"GPUD_SIM_CRASH_AFTER_COMMITS": str(crash_at)})
        doomed.wait_healthy()
        gpu0 = doomed.client.get("/v1/gpus/0")["uuid"]
        body = {"devices": [{"gpu": gpu0, "gi_profile_id": 19, "placement_start": 3}]}
        try:
            status, made = until_answered(doomed, "PUT", path, body)
            assert status == 200, made
            until_answered(doomed, "DELETE", path)
        except (DaemonUnreachable, AssertionError):
            pass  # killed before its answer went out, or while a retry waited: the wait below holds it was the kill
        assert doomed.proc.wait(30) == -9, f"gpud was not killed at change {crash_at}"

        revived = run_gpud(*args)
        revived.wait_healthy()
        plugin = GpudOwner(Client(revived.socket, timeout=30), short_tmp / "no-pod-resources.sock")
        if crash_at <= PREPARE_CHANGES:  # the kubelet retries Prepare: the same device, made once
            again = plugin.make_mig_devices(CLAIM, body["devices"])
            assert again[0]["profile"] == "1g.10gb", (crash_at, again)
            view = revived.client.get("/v1/mig/dynamic")
            assert [(i["uuid"], i["state"]) for i in view["instances"]] == [(again[0]["uuid"], "present")]
            assert hardware(state) == [("enabled", [(3, 1)]), ("disabled", [])], crash_at
        else:  # the kubelet retries Unprepare: nothing left, the whole GPU back
            assert plugin.destroy_mig_devices(CLAIM) == [], crash_at
            assert revived.client.get("/v1/mig/dynamic")["instances"] == []
            assert hardware(state) == [("disabled", []), ("disabled", [])], crash_at
        assert revived.stop() == 0
