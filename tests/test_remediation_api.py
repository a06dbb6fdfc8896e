"""POST /v1/gpus/{id}/remediate and GET /v1/remediation (issue 40) on simulated nodes: a GPU whose driver
asks for a reset is reset and checked, one that needs a reboot or is held is refused with nothing done, the
reset budget health.auto_reset keeps is the remediations' too and holds across a restart, and the check
(gpud's read-back, or DCGM's diagnostic through tests/dcgmi_stand_in.py) fails a GPU that is not well.

The simulator models the driver of each branch (gpud/nvml/sim): from R565 on, an XID 48 or 95 sets the
recovery action to GPU reset and an XID 79 to node reboot (NVIDIA's XID catalog), a reset is refused while
a process runs on the GPU (nvidia-smi(1), -r), and a reset clears a GPU-reset recovery action."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import curl_as, mig_config, sim_config, start_daemon, stop_daemon, until_async
from openapi_check import assert_matches_openapi
from test_health_closed_loop import stand_in_dcgmi
from test_reset import gpud_of_readers_and_admins

from gpud.config import Config, HealthConfig
from gpud.health import persistence

DRIVER_WITH_ACTION = "580.65.06"  # R565 and later keep the recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)


def node_config(tmp: Path, preset: str = "A100-SXM4-80GB:2", dcgmi: str | None = None, **health) -> Config:
    """A node whose health is checked only when a test (or a remediation) asks; no dcgmi unless given."""
    config = sim_config(tmp, preset).with_overrides(sim_driver=DRIVER_WITH_ACTION)
    return dataclasses.replace(config, health=dataclasses.replace(
        HealthConfig(), check_interval_s=3600.0, dcgmi=dcgmi or str(tmp / "no-dcgmi"), **health))


async def remediate(node, gpu, body=None, data=None) -> tuple[int, dict]:
    return await node.post(f"/v1/gpus/{gpu}/remediate", body, data)


async def sick(node, gpu: int, xid: int) -> dict:
    """The GPU after the XID, its driver's recovery action read by a health pass."""
    assert (await node.post("/v1/sim/xid", {"gpu": gpu, "xid": xid}))[0] == 200
    await until_async(lambda: _reasons(node, gpu), what=f"XID {xid}'s reason")
    await node.daemon.health.check_once()
    return (await node.get(f"/v1/gpus/{gpu}/health"))[1]


async def _reasons(node, gpu: int) -> list:
    return (await node.get(f"/v1/gpus/{gpu}/health"))[1]["reasons"]


def watched(node, after: int) -> list[dict]:
    events, _ = node.daemon.bus.backlog_after(after)
    return [json.loads(event.line)["data"] for event in events if event.type == "health"]


async def metrics_text(node) -> str:
    async with node.http.get("http://localhost/metrics") as response:
        return await response.text()


# -- a reset the GPU needs ------------------------------------------------------------------------


async def test_a_gpu_whose_driver_asks_for_a_reset_is_reset_checked_and_healthy_after(short_tmp):
    node = await start_daemon(node_config(short_tmp))
    try:
        # XID 48: the catalog says reboot (drivers that say nothing), the R565+ driver says a GPU reset does
        health = await sick(node, 0, 48)
        assert health["state"] == "unhealthy" and health["driver_action"] == "gpu-reset"
        assert health["suggested_action"] == "reboot" and health["remedy"] == "reset-gpu"  # the driver decides
        since = node.daemon.bus.sequence
        status, body = await remediate(node, 0, {"requester": "k8s-agent"})
        assert status == 200, body
        assert_matches_openapi("POST", "/v1/gpus/{id}/remediate", 200, body)
        assert (body["gpu"], body["requester"], body["action"]) == (0, "k8s-agent", "none")
        assert body["reset"]["reset"] == [0]
        assert ("xid", "48") in {(c["kind"], c["code"]) for c in body["reset"]["cleared"]}
        assert body["check"] == {"how": "read-back", "passed": True, "problems": []}
        after = (await node.get("/v1/gpus/0/health"))[1]
        assert after["state"] == "healthy" and after["driver_action"] == "none"
        status, view = await node.get("/v1/remediation")
        assert status == 200
        assert_matches_openapi("GET", "/v1/remediation", 200, view)
        assert view["results"]["passed"] == 1 and sum(view["results"].values()) == 1
        assert view["reset_budget"] == {"max_per_hour": 2, "used": 1, "next_free_in_s": None}
        assert view["policy"]["enabled"] is False and view["policy"]["lease_namespace"] == "gpud-system"
        said = [e for e in watched(node, since) if e.get("cause") == "remediation"]
        assert [(e["gpu_index"], e["remediation"], e["requester"]) for e in said] == [(0, "passed", "k8s-agent")]
        text = await metrics_text(node)
        assert 'gpud_gpu_remediations_total{result="passed"} 1' in text
        assert 'gpud_gpu_remediations_total{result="blocked"} 0' in text
    finally:
        await stop_daemon(node)


async def test_a_healthy_gpu_is_only_checked(short_tmp):
    node = await start_daemon(node_config(short_tmp))
    try:
        sim_state = (short_tmp / "sim.json").read_bytes()
        status, body = await remediate(node, "0")
        assert status == 200, body
        assert (body["reset"], body["requester"], body["action"]) == (None, None, "none")
        assert body["check"] == {"how": "read-back", "passed": True, "problems": []}
        assert_matches_openapi("POST", "/v1/gpus/{id}/remediate", 200, body)
        _, view = await node.get("/v1/remediation")
        assert view["results"]["not-needed"] == 1 and view["reset_budget"]["used"] == 0
        assert (short_tmp / "sim.json").read_bytes() == sim_state  # nothing was reset
    finally:
        await stop_daemon(node)


async def test_where_the_driver_says_nothing_the_catalog_decides_the_remedy(short_tmp):
    node = await start_daemon(node_config(short_tmp).with_overrides(sim_driver="550.90.07"))  # before R565
    try:
        health = await sick(node, 0, 48)
        assert health["driver_action"] is None and health["remedy"] == "reboot"
        status, body = await remediate(node, 0, {"requester": "k8s-agent"})
        assert status == 409 and body["error"]["code"] == "needs-reboot", body
        assert (await sick(node, 1, 95))["remedy"] == "reset-gpu"
    finally:
        await stop_daemon(node)


# -- refused, nothing done ----------------------------------------------------------------------


async def test_a_gpu_that_needs_a_reboot_is_refused_and_not_reset(short_tmp):
    node = await start_daemon(node_config(short_tmp))
    try:
        health = await sick(node, 1, 79)
        assert health["driver_action"] == "node-reboot" and health["remedy"] == "reboot"
        sim_state = (short_tmp / "sim.json").read_bytes()
        status, body = await remediate(node, 1, {"requester": "slurm"})
        assert status == 409 and body["error"]["code"] == "needs-reboot", body
        assert body["error"]["action"] == "reboot" and "node-reboot" in body["error"]["message"]
        assert_matches_openapi("POST", "/v1/gpus/{id}/remediate", 409, body)
        assert (short_tmp / "sim.json").read_bytes() == sim_state
        _, view = await node.get("/v1/remediation")
        assert view["results"]["needs-reboot"] == 1 and view["reset_budget"]["used"] == 0
    finally:
        await stop_daemon(node)


async def test_a_gpu_with_processes_is_not_reset_and_spends_no_budget(short_tmp):
    node = await start_daemon(node_config(short_tmp))
    try:
        await sick(node, 0, 95)  # uncontained memory error: reset-gpu in the catalog and for the driver
        assert (await node.post("/v1/sim/processes", {"gpu": 0, "pids": [4343]}))[0] == 200
        status, body = await remediate(node, 0, {"requester": "k8s-agent"})
        assert status == 409 and body["error"]["code"] == "reset-blocked", body
        assert [b["gpu"] for b in body["error"]["blockers"]] == [0] and "4343" in body["error"]["message"]
        assert_matches_openapi("POST", "/v1/gpus/{id}/remediate", 409, body)
        # exactly as the reset route refuses it
        status, reset = await node.post("/v1/gpus/0/reset")
        assert status == 409 and reset["error"]["blockers"] == body["error"]["blockers"]
        assert (await node.get("/v1/gpus/0/health"))[1]["driver_action"] == "gpu-reset"
        _, view = await node.get("/v1/remediation")
        assert view["results"]["blocked"] == 1 and view["reset_budget"]["used"] == 0
    finally:
        await stop_daemon(node)


async def test_the_budget_auto_reset_keeps_is_spent_by_remediations_and_holds_across_a_restart(short_tmp):
    config = node_config(short_tmp, auto_reset_max_per_hour=1)
    node = await start_daemon(config)
    try:
        await sick(node, 0, 48)
        await sick(node, 1, 48)
        assert (await remediate(node, 0))[0] == 200
        status, body = await remediate(node, 1, {"requester": "slurm"})
        assert status == 429 and body["error"]["code"] == "reset-budget-spent", body
        assert 3590 < body["error"]["retry_after_s"] <= 3600
        assert_matches_openapi("POST", "/v1/gpus/{id}/remediate", 429, body)
        async with node.http.post("http://localhost/v1/gpus/1/remediate") as response:
            assert response.status == 429 and 3590 < int(response.headers["Retry-After"]) <= 3600
        assert (await node.get("/v1/gpus/1/health"))[1]["driver_action"] == "gpu-reset"  # not reset
        # health.auto_reset draws from the same budget: it resets nothing either
        node.daemon.health.settings = dataclasses.replace(node.daemon.health.settings, auto_reset=True)
        await node.daemon.health.check_once()
        assert node.daemon.health.auto_reset.results == {"rate-limited": 1}
    finally:
        await stop_daemon(node)
    saved = json.loads((short_tmp / "state" / "health.json").read_text())
    assert len(saved["auto_resets"]) == 1  # the key older versions wrote: an upgrade keeps the count
    node = await start_daemon(config)
    try:
        await node.daemon.health.check_once()
        status, body = await remediate(node, 1)
        assert status == 429 and body["error"]["code"] == "reset-budget-spent", body
        _, view = await node.get("/v1/remediation")
        assert view["reset_budget"]["used"] == 1 and 3590 < view["reset_budget"]["next_free_in_s"] <= 3600
        assert view["results"]["budget-spent"] == 1
    finally:
        await stop_daemon(node)


def test_a_health_file_of_an_older_gpud_gives_the_budget_its_resets():
    document = {"reasons": {}, "xid_counts": [], "last_xid": {}, "auto_resets": [100.0, 200.5]}
    assert persistence.persisted_from(document).auto_resets == [100.0, 200.5]


# -- the check --------------------------------------------------------------------------------------


async def test_an_xid_after_the_reset_fails_the_check_though_health_stays_healthy(short_tmp, monkeypatch):
    node = await start_daemon(node_config(short_tmp))
    try:
        await sick(node, 0, 48)
        resetter, reset_gpus = node.daemon.resetter, node.daemon.resetter.reset_gpus

        async def reset_then_an_xid(*args, **kwargs):
            outcome = await reset_gpus(*args, **kwargs)
            # XID 13, an application's: it leaves health alone, but no XID may follow a remediation's reset
            await node.daemon.session.call(lambda nvml: nvml.sim_inject_xid(0, 13))
            await until_async(lambda: node.daemon.health.xids.counts.get((outcome_uuid, 13)), what="the XID")
            return outcome

        outcome_uuid = (await node.get("/v1/gpus/0"))[1]["uuid"]
        monkeypatch.setattr(resetter, "reset_gpus", reset_then_an_xid)
        status, body = await remediate(node, 0)
        assert status == 200 and body["reset"] is not None, body
        assert body["check"]["passed"] is False and body["check"]["how"] == "read-back"
        assert body["check"]["problems"] == ["XID 13 on the GPU since the remediation began"]
        assert (await node.get("/v1/gpus/0/health"))[1]["state"] == "healthy"
        _, view = await node.get("/v1/remediation")
        assert view["results"]["failed"] == 1
    finally:
        await stop_daemon(node)


async def test_a_gpu_a_reset_does_not_mend_fails_the_check_and_says_why(short_tmp):
    node = await start_daemon(node_config(short_tmp))
    try:
        # XID 32 (invalid push buffer): unhealthy, and the catalog asks for the application to restart
        health = await sick(node, 0, 32)
        assert (health["state"], health["suggested_action"], health["driver_action"]) == \
            ("unhealthy", "restart-app", "none")
        status, body = await remediate(node, 0)
        assert status == 200 and body["reset"] is None, body
        assert body["check"]["passed"] is False and body["action"] == "restart-app"
        assert body["check"]["problems"] == ["the GPU is unhealthy: XID 32: invalid or corrupted push buffer"]
        _, view = await node.get("/v1/remediation")
        assert view["results"]["failed"] == 1 and view["reset_budget"]["used"] == 0
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("mode, passed", [("pass", True), ("no-hostengine", False)])
async def test_where_dcgmi_is_found_the_check_is_dcgms_diagnostic_on_that_gpu(short_tmp, mode, passed):
    node = await start_daemon(node_config(short_tmp, dcgmi=str(stand_in_dcgmi(short_tmp, mode))))
    try:
        await sick(node, 1, 95)
        status, body = await remediate(node, 1)
        assert status == 200 and body["reset"]["reset"] == [1], body
        assert body["check"]["how"] == "dcgm-diag-1" and body["check"]["passed"] is passed, body
        run = node.daemon.active_check.last()
        assert run["command"][1:] == ["diag", "-r", "1", "-j", "-i", "1"]  # level 1, that GPU alone
        if not passed:
            assert "DCGM could not initialize" in body["check"]["problems"][0]
        assert body["action"] == "none"  # the reset mended what the driver asked for, whatever DCGM says
        _, view = await node.get("/v1/remediation")
        assert view["results"]["passed" if passed else "failed"] == 1
    finally:
        await stop_daemon(node)


# -- bad requests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("data, status, code", [
    (b'{"requester": 5}', 400, "invalid-field"),
    (b'{"requester": true}', 400, "invalid-field"),
    (b'{"requester": ["k8s-agent"]}', 400, "invalid-field"),
    (json.dumps({"requester": "x" * 65}).encode(), 400, "invalid-field"),
    (b'{"requester": ""}', 400, "invalid-field"),
    (b'{"requester": "a\\nb"}', 400, "invalid-field"),
    (b'{"requester": "k8s\\u0000agent"}', 400, "invalid-field"),
    (b'{"requestor": "k8s-agent"}', 400, "unknown-field"),
    (b'{"requester": "k8s-agent"', 400, "invalid-json"),
    (b"\xff\xfe garbage", 400, "invalid-json"),
    (b'["k8s-agent"]', 400, "invalid-body"),
    (b"NaN", 400, "invalid-json"),
])
async def test_bad_bodies_are_refused_with_nothing_done(short_tmp, data, status, code):
    node = await start_daemon(node_config(short_tmp))
    try:
        await sick(node, 0, 48)
        got, body = await remediate(node, 0, data=data)
        assert (got, body["error"]["code"]) == (status, code), body
        assert_matches_openapi("POST", "/v1/gpus/{id}/remediate", status, body)
        _, view = await node.get("/v1/remediation")
        assert sum(view["results"].values()) == 0 and view["reset_budget"]["used"] == 0
    finally:
        await stop_daemon(node)


async def test_unknown_gpus_and_mig_devices_are_refused(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        status, body = await remediate(node, 7)
        assert status == 404 and body["error"]["code"] == "gpu-not-found"
        async with node.http.put("http://localhost/v1/mig?wait=true", json={"layout": "all-7g.40gb"}) as response:
            assert response.status == 200
        mig_uuid = (await node.get("/v1/gpus/0"))[1]["mig"]["devices"][0]["uuid"]
        status, body = await remediate(node, mig_uuid, {"requester": "k8s-agent"})
        assert status == 422 and body["error"]["code"] == "not-a-gpu" and "remediation" in body["error"]["message"]
        assert_matches_openapi("POST", "/v1/gpus/{id}/remediate", 422, body)
    finally:
        await stop_daemon(node)


def test_remediating_is_for_admins_and_reading_for_readers(run_gpud, short_tmp, users):
    gpud = gpud_of_readers_and_admins(run_gpud, short_tmp)
    status, text = curl_as("gpudt-reader", gpud.socket, "POST", "/v1/gpus/0/remediate", {"requester": "me"})
    assert status == 403 and json.loads(text)["error"]["code"] == "forbidden", text
    status, text = curl_as("gpudt-reader", gpud.socket, "GET", "/v1/remediation")
    assert status == 200 and json.loads(text)["results"]["not-needed"] == 0, text
    status, text = curl_as("gpudt-admin", gpud.socket, "POST", "/v1/gpus/0/remediate", {"requester": "me"})
    assert status == 200 and json.loads(text)["check"]["passed"] is True, text
    assert gpud.stop() == 0
