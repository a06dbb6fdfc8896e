"""Health on a simulated node: XIDs, ECC, lost GPUs, the watch stream and the metrics."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from helpers import (REPO, Lines, cli, mig_config, put_layout, sharing_config, start_daemon, stop_daemon,
                     until_async)
from openapi_check import assert_matches_openapi

SHARED_MIG = """version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/mig-3g.20gb
      replicas: 3
"""


async def read_events(node, path: str, count: int, timeout: float = 5.0) -> list[dict]:
    events = []
    async with node.http.get(f"http://localhost{path}") as response:
        assert response.status == 200 and response.content_type == "application/x-ndjson"
        while len(events) < count:
            line = await asyncio.wait_for(response.content.readline(), timeout)
            event = json.loads(line)
            if event["type"] != "heartbeat":
                events.append(event)
    return events


def metric(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
async def node(short_tmp):
    running = await start_daemon(mig_config(short_tmp, "dgx-a100"))
    yield running
    await stop_daemon(running)


async def test_xid_79_makes_the_gpu_unhealthy_everywhere(node):
    seq = node.daemon.bus.sequence
    # The watcher resumes after the last event before the XID: whenever it subscribes, it gets the XID.
    watcher = asyncio.ensure_future(read_events(node, f"/v1/watch?since={seq}&types=health", 1))
    assert (await node.post("/v1/sim/xid", {"gpu": 2, "xid": 79}))[0] == 200
    (event,) = await watcher
    assert event["type"] == "health" and event["data"]["gpu_index"] == 2 and event["data"]["state"] == "unhealthy"
    assert event["data"]["reasons"][0]["action"] == "reboot"

    _, health = await node.get("/v1/health")
    assert_matches_openapi("GET", "/v1/health", 200, health)
    assert health["status"] == "unhealthy"
    states = {g["index"]: g["state"] for g in health["gpus"]}
    assert states[2] == "unhealthy" and [s for i, s in states.items() if i != 2] == ["healthy"] * 7
    (reason,) = health["gpus"][2]["reasons"]
    assert (reason["kind"], reason["code"], reason["action"], reason["count"]) == ("xid", "79", "reboot", 1)
    _, gpu2 = await node.get("/v1/gpus/2/health")
    assert_matches_openapi("GET", "/v1/gpus/{id}/health", 200, gpu2)
    assert gpu2["state"] == "unhealthy"

    async with node.http.get("http://localhost/metrics") as response:
        text = await response.text()
    assert metric(text, "gpud_gpu_health", gpu="2") == 2 and metric(text, "gpud_gpu_health", gpu="1") == 0
    assert metric(text, "DCGM_FI_DEV_XID_ERRORS", gpu="2") == 79
    assert metric(text, "gpud_xid_errors_total", gpu="2", xid="79") == 1
    assert metric(text, "DCGM_FI_DEV_GPU_TEMP", gpu="0") is not None
    assert 'modelName="NVIDIA A100-SXM4-40GB"' in text and "# TYPE DCGM_FI_DEV_GPU_TEMP gauge" in text

    _, cleared = await node.post("/v1/health/2/clear", {})
    assert cleared["state"] == "healthy"
    _, health = await node.get("/v1/health")
    assert health["status"] == "healthy"


async def test_application_xid_13_leaves_the_gpu_healthy(node):
    assert (await node.post("/v1/sim/xid", {"gpu": 1, "xid": 13}))[0] == 200

    async def counted():
        async with node.http.get("http://localhost/metrics") as response:
            return metric(await response.text(), "gpud_xid_errors_total", gpu="1", xid="13")
    assert await until_async(counted) == 1  # seen and counted
    _, health = await node.get("/v1/health")
    assert health["status"] == "healthy"


async def test_an_xid_with_instance_ids_marks_only_that_mig_device_and_its_replicas(short_tmp):
    node = await start_daemon(sharing_config(short_tmp, "dgx-a100", SHARED_MIG))
    try:
        assert (await put_layout(node, "all-3g.20gb"))[0] == 200
        _, gpu = await node.get("/v1/gpus/4")
        target, sibling = gpu["mig"]["devices"]
        await node.post("/v1/sim/xid", {"gpu": 4, "xid": 48, "gi_id": target["gi_id"], "ci_id": target["ci_id"]})

        async def marked():
            _, health = await node.get("/v1/gpus/4/health")
            return health if health["mig_devices"] and any(d["state"] == "unhealthy"
                                                            for d in health["mig_devices"]) else None
        health = await until_async(marked)
        status, by_mig_uuid = await node.get(f"/v1/gpus/{target['uuid']}/health")  # a MIG UUID names its GPU
        assert status == 200 and by_mig_uuid == health
        by_uuid = {d["uuid"]: d["state"] for d in health["mig_devices"]}
        assert by_uuid == {target["uuid"]: "unhealthy", sibling["uuid"]: "healthy"}
        assert health["state"] == "healthy"  # the GPU itself and its other instance are fine

        _, sharing = await node.get("/v1/sharing")
        (resource,) = [r for r in sharing["resources"] if r["name"] == "nvidia.com/mig-3g.20gb"]
        unhealthy = {d["id"] for d in resource["devices"] if not d["healthy"]}
        assert unhealthy == {f"{target['uuid']}::{n}" for n in range(3)}
        _, cleared = await node.post(f"/v1/health/{target['uuid']}/clear", {})
        assert cleared["uuid"] == target["uuid"] and cleared["state"] == "healthy"  # only that MIG device
    finally:
        await stop_daemon(node)


async def test_a_lost_gpu_is_unhealthy_and_every_route_answers(node):
    assert (await node.post("/v1/sim/gpu-lost", {"gpu": 6}))[0] == 200
    _, health = await node.get("/v1/health")
    gpu6 = health["gpus"][6]
    assert gpu6["state"] == "unhealthy" and gpu6["reasons"][0]["kind"] == "lost"
    for path in ("/healthz", "/v1/node", "/v1/gpus", "/v1/gpus/6", "/v1/gpus/6/health", "/v1/health", "/v1/mig",
                 "/v1/mig/layouts", "/v1/mps", "/v1/sharing", "/v1/openapi.json"):
        assert (await node.get(path))[0] == 200, path
    async with node.http.get("http://localhost/metrics") as response:
        assert response.status == 200 and metric(await response.text(), "gpud_gpu_lost", gpu="6") == 1
    status, body = await put_layout(node, "all-balanced")
    assert status == 409 and body["error"]["code"] == "gpu-lost"


async def test_double_bit_ecc_event_and_the_pending_row_remap(node):
    await node.post("/v1/sim/ecc", {"gpu": 3, "double_bit": True})

    async def reasons():
        _, health = await node.get("/v1/gpus/3/health")
        return health["reasons"] if health["state"] == "unhealthy" else None
    kinds = {(r["kind"], r["code"]) for r in await until_async(reasons)}
    assert ("ecc", "dbe-event") in kinds


async def test_watch_resumes_after_a_sequence_number_and_rejects_bad_queries(node):
    start = node.daemon.bus.sequence
    await node.post("/v1/sim/xid", {"gpu": 0, "xid": 79})
    await node.post("/v1/sim/xid", {"gpu": 1, "xid": 79})
    events = await read_events(node, f"/v1/watch?since={start}&types=health", 2)
    assert [e["data"]["gpu_index"] for e in events] == [0, 1] and events[1]["seq"] > events[0]["seq"] > start
    again = await read_events(node, f"/v1/watch?since={events[0]['seq']}&types=health", 1)
    assert again[0]["seq"] == events[1]["seq"]
    for query in ("since=abc", "types=nonsense"):
        status, body = await node.get(f"/v1/watch?{query}")
        assert status == 400 and body["error"]["code"] == "invalid-query"
    status, body = await node.post("/v1/health/GPU-nope/clear", {})
    assert status == 404


def test_cli_health_and_watch(run_gpud, short_tmp):
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:2", "--sim-state", str(short_tmp / "sim.json"))
    gpud.wait_healthy()
    assert cli("health", socket=gpud.socket).returncode == 0
    gpud.wait_for(lambda: len(gpud.client.get("/v1/health")["gpus"]) == 2, what="health")
    # --since 0: the watcher replays this fresh gpud's stream from its start, so the XID reaches it
    # however long it takes to start and subscribe (a fixed wait for that lost the race under load).
    watcher = subprocess.Popen([sys.executable, "-m", "gpud", "watch", "--since", "0", "--types", "health",
                                "--socket", str(gpud.socket)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    lines = Lines(watcher.stdout, "gpud watch")
    gpud.client.request("POST", "/v1/sim/xid", {"gpu": 1, "xid": 79})
    line = lines.until(lambda line: '"state": "unhealthy"' in line, "GPU 1 unhealthy", timeout=30)
    assert line.startswith("#") and " health: " in line and '"gpu_index": 1' in line
    assert lines.seen[0].startswith("# watching gpud on ")  # the header, printed once the watch is accepted
    assert all(" health: " in seen for seen in lines.seen[1:])  # --types health: nothing else
    unhealthy = cli("health", socket=gpud.socket)
    assert unhealthy.returncode == 1 and "xid 79" in unhealthy.stdout and "action: reboot" in unhealthy.stdout
    started = time.monotonic()
    assert gpud.stop() == 0 and time.monotonic() - started < 5  # an open watch stream does not hold gpud up
    assert watcher.wait(10) == 3  # the daemon went away: the watcher says so and exits 3
    events = [e for e in gpud.log_events() if e.get("event") == "xid"]
    assert events and events[0]["xid"] == 79 and events[0]["level"] == "warning"


async def test_a_gpu_reset_clears_the_xid_it_resolves(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        await node.post("/v1/sim/xid", {"gpu": 0, "xid": 79})

        async def state():
            _, health = await node.get("/v1/gpus/0/health")
            return health["state"]
        assert await until_async(lambda: _is(state, "unhealthy"))
        assert (await put_layout(node, "all-balanced"))[0] == 200  # enabling MIG on an A100 resets the GPU
        assert await state() == "healthy"
    finally:
        await stop_daemon(node)


async def _is(read, wanted):
    return await read() == wanted


async def gpu_health(node, index: int) -> dict:
    return (await node.get(f"/v1/gpus/{index}/health"))[1]


async def test_nvlink_down_degrades_and_clears_only_after_three_passing_checks(node):
    sim, health = node.daemon.session.nvml, node.daemon.health
    await health.check_once()  # links count as down only once seen up (a bridgeless board's never are)
    sim.sim_set_nvlink(1, 3, up=False)
    await health.check_once()
    gpu1 = await gpu_health(node, 1)
    assert gpu1["state"] == "degraded"
    (reason,) = gpu1["reasons"]
    assert (reason["kind"], reason["action"]) == ("nvlink", "inspect-hardware") and "3 of 12" in reason["message"]
    sim.sim_set_nvlink(1, 3, up=True)
    for expected in ("degraded", "degraded", "healthy"):  # hysteresis: three passes in a row
        await health.check_once()
        assert (await gpu_health(node, 1))["state"] == expected


async def test_a_burst_of_pcie_replays_degrades_the_gpu(node):
    await node.daemon.health.check_once()  # a first reading to compare with
    node.daemon.session.nvml.sim_add_pcie_replays(5, 500)
    await node.daemon.health.check_once()
    gpu5 = await gpu_health(node, 5)
    assert gpu5["state"] == "degraded" and gpu5["reasons"][0]["kind"] == "pcie"
    async with node.http.get("http://localhost/metrics") as response:
        assert metric(await response.text(), "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", gpu="5") == 500


async def test_a_pending_page_retirement_on_a_t4(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "t4"))
    try:
        node.daemon.session.nvml.sim_set_retired_pages_pending(0)
        await node.daemon.health.check_once()
        (reason,) = (await gpu_health(node, 0))["reasons"]
        assert (reason["kind"], reason["code"], reason["action"]) == ("retired-pages", "pending", "reset-gpu")
    finally:
        await stop_daemon(node)


async def test_request_latency_is_in_the_metrics(node):
    before = node.daemon.latency.requests
    for _ in range(40):
        await node.get("/v1/gpus")
    async with node.http.get("http://localhost/metrics") as response:
        text = await response.text()
    assert metric(text, "gpud_http_requests_total") >= before + 40
    count = metric(text, "gpud_http_request_duration_seconds_count", method="GET", route="/v1/gpus")
    assert count is not None and count >= 40 // 8 - 1  # one request in eight is timed
    assert metric(text, "gpud_http_request_duration_seconds_bucket", method="GET", route="/v1/gpus",
                  le="+Inf") == count


async def test_the_watch_stream_carries_mig_inventory_and_sharing_events(short_tmp):
    node = await start_daemon(sharing_config(short_tmp, "A100-SXM4-40GB:1", SHARED_MIG))
    try:
        start = node.daemon.bus.sequence
        assert (await put_layout(node, "all-3g.20gb"))[0] == 200
        events = await read_events(node, f"/v1/watch?since={start}&types=mig,inventory,sharing", 3)
        kinds = {e["type"] for e in events}
        assert {"mig", "inventory"} <= kinds
        everything, _ = node.daemon.bus.backlog_after(start)
        seen = [json.loads(event.line) for event in everything]
        assert any(e["type"] == "mig" and e["data"]["state"] == "success" for e in seen)
        assert any(e["type"] == "inventory" and e["data"]["mig_devices"] == 2 for e in seen)
        assert any(e["type"] == "sharing" and e["data"]["resources"].get("nvidia.com/mig-3g.20gb") == 6
                   for e in seen)
    finally:
        await stop_daemon(node)
