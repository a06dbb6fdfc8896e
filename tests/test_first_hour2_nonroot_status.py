"""What an ordinary user's gpud answers a MIG apply and a GPU reset (501 needs-root, before any change), in
process with the uid read as 1000 by gpud and the simulated driver alike; and that a layout gpud holds but
could not apply (failed, or waiting for a reset) is never called ok by /healthz and `gpud status`."""

from __future__ import annotations

import asyncio

import pytest
from helpers import cli, mig_config, put_layout, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi


async def test_a_gpud_that_is_not_root_refuses_a_mig_apply_and_a_reset_before_any_change(short_tmp, monkeypatch):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        simulated = (short_tmp / "sim.json").read_bytes()
        monkeypatch.setattr("os.geteuid", lambda: 1000)
        status, body = await put_layout(node, "all-balanced")
        assert status == 501 and body["error"]["code"] == "needs-root", body
        assert_matches_openapi("PUT", "/v1/mig", 501, body)
        assert body["error"]["message"].startswith("gpud runs as uid 1000, not root"), body
        assert "layout 'all-balanced' would change GPU 0, 1" in body["error"]["message"], body
        assert body["error"]["message"].endswith("run gpud as root") and body["error"]["uid"] == 1000, body

        status, body = await node.post("/v1/gpus/0/reset")
        assert status == 501 and body["error"]["code"] == "needs-root", body
        assert_matches_openapi("POST", "/v1/gpus/{id}/reset", 501, body)
        assert "GPU resets" in body["error"]["message"] and "resetting GPU 0 would fail" in body["error"]["message"]

        assert (short_tmp / "sim.json").read_bytes() == simulated
        assert not (short_tmp / "state/mig-desired.json").exists()
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] is None and mig["state"] == "success" and mig["history"] == [], mig
        assert (await node.get("/healthz"))[1] == {"status": "ok"}  # nothing failed, nothing is pending
    finally:
        monkeypatch.undo()
        await stop_daemon(node)


@pytest.mark.parametrize("allow_gpu_reset", [True, False])
async def test_a_layout_that_failed_or_waits_for_a_reset_is_not_ok_until_one_is_applied(short_tmp,
                                                                                     allow_gpu_reset):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2", allow_gpu_reset=allow_gpu_reset))
    try:
        if allow_gpu_reset:
            assert (await put_layout(node, "all-balanced"))[0] == 200
            node.daemon.session.nvml.sim_fail_mig_call(after=1)  # the first change of the next apply fails
            state, code = "failed", "apply-failed"
        else:  # a held GPU keeps its mode change pending (idle, an A100 switches at once), for the operator's reset
            assert (await node.post("/v1/sim/holders", {"gpu": 0, "process": "nvidia-persiste", "pid": 900}))[0] == 200
            state, code = "reset-required", "reset-required"
        status, body = await put_layout(node, "all-1g.5gb")
        assert status == 409 and body["error"]["code"] == code, body
        status, health = await node.get("/healthz")
        assert status == 200 and health["status"] == "degraded", health
        assert health["problems"] == [f"MIG layout 'all-1g.5gb' {state}: {body['error']['mig']['error']}"], health
        assert_matches_openapi("GET", "/healthz", 200, health)
        result = await asyncio.to_thread(cli, "status", socket=short_tmp / "g.sock")  # gpud serves meanwhile
        assert result.returncode == 1 and f"MIG layout 'all-1g.5gb' {state}" in result.stdout, result

        assert (await put_layout(node, "all-disabled"))[0] == 200  # the operator chooses again: all clear
        assert (await node.get("/healthz"))[1] == {"status": "ok"}
    finally:
        await stop_daemon(node)
