"""The API served in-process on a Unix socket, over a simulated node."""

from __future__ import annotations

import asyncio
import json
import socket

import pynvml
import pytest
from helpers import sim_config, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi

from gpud.config import Config
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim.scenarios import fill_with_gpu_instances

# From shared/reference/mig-profiles.md §2 / §3.1 (A100-SXM4-40GB).
A100_40GB_PCI_ID = "0x20B010DE"
A100_1G5GB = {"memory_mib": 4864, "sms": 14}


def make_config(tmp, preset="dgx-a100", **api) -> Config:
    config = sim_config(tmp, preset)
    for key, value in api.items():
        config = config.with_overrides(**{f"api.{key}": value})
    return config


@pytest.fixture
async def node(short_tmp):
    running = await start_daemon(make_config(short_tmp, idle_timeout_s=1.0, body_timeout_s=0.5))
    yield running
    await stop_daemon(running)


def stage_mig(tmp, preset: str, profile_constant: int) -> int:
    """Puts MIG devices on the simulated GPUs before gpud starts, as an admin would with nvidia-smi."""
    sim = SimulatedNvml(preset, tmp / "sim.json")
    sim.nvmlInit()
    try:
        return fill_with_gpu_instances(sim, profile_constant)
    finally:
        sim.nvmlShutdown()


async def test_gpus_on_a_simulated_dgx_a100(node):
    status, body = await node.get("/v1/gpus")
    assert status == 200
    assert_matches_openapi("GET", "/v1/gpus", 200, body)
    gpus = body["gpus"]
    assert [g["index"] for g in gpus] == list(range(8))
    assert {g["name"] for g in gpus} == {"NVIDIA A100-SXM4-40GB"}
    assert {g["pci_device_id"] for g in gpus} == {A100_40GB_PCI_ID}
    assert all(40000 < g["memory_total_mib"] <= 40960 for g in gpus)
    assert len({g["uuid"] for g in gpus}) == 8 and all(g["uuid"].startswith("GPU-") for g in gpus)
    assert len({g["pci_bus_id"] for g in gpus}) == 8
    assert all(g["mig"]["capable"] and g["mig"]["mode"] == "disabled" and g["mig"]["devices"] == [] for g in gpus)
    assert {g["architecture"] for g in gpus} == {"ampere"}
    assert {g["brand"] for g in gpus} == {"Nvidia"}  # go-nvlib's word for NVML_BRAND_NVIDIA
    assert {g["compute_mode"] for g in gpus} == {"default"}


async def test_one_gpu_by_index_uuid_and_bus_id(node):
    _, body = await node.get("/v1/gpus")
    third = body["gpus"][3]
    short_bus = third["pci_bus_id"][4:]  # "0000:4E:00.0" form
    for ident in ("3", third["uuid"], third["pci_bus_id"], short_bus, short_bus.lower()):
        status, gpu = await node.get(f"/v1/gpus/{ident}")
        assert status == 200, ident
        assert gpu == third
    assert_matches_openapi("GET", "/v1/gpus/{id}", 200, third)


@pytest.mark.parametrize("ident", ["8", "-1", "GPU-nope", "zz:zz:zz", "%00", "a" * 500, "3.0"])
async def test_unknown_gpu_is_a_404(node, ident):
    status, body = await node.get(f"/v1/gpus/{ident}")
    assert status == 404 and body["error"]["code"] == "gpu-not-found"
    assert_matches_openapi("GET", "/v1/gpus/{id}", 404, body)


async def test_healthz_and_node(node):
    status, body = await node.get("/healthz")
    assert (status, body) == (200, {"status": "ok"})
    assert_matches_openapi("GET", "/healthz", 200, body)
    status, body = await node.get("/v1/node")
    assert status == 200
    assert_matches_openapi("GET", "/v1/node", 200, body)
    assert body["backend"] == "simulated" and body["gpu_count"] == 8 and body["simulated_preset"] == "dgx-a100"
    assert body["hostname"] == socket.gethostname()
    assert body["driver_version"].count(".") >= 1 and body["cuda_version"].count(".") == 1


async def test_openapi_document_is_served_and_covers_every_route(node):
    status, document = await node.get("/v1/openapi.json")
    assert status == 200 and document["openapi"].startswith("3.")
    app_routes = {(r.method, r.resource.canonical) for r in node.daemon.api.app().router.routes()}
    documented = {(m.upper(), path) for path, ops in document["paths"].items() for m in ops}
    assert {r for r in app_routes if r[0] not in ("HEAD", "*")} == documented


async def test_unknown_route_and_wrong_method_are_json_errors(node):
    status, body = await node.get("/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not-found"
    status, body = await node.post("/v1/gpus", {})
    assert status == 405 and body["error"]["code"] == "method-not-allowed" and "GET" in body["error"]["message"]
    assert body["error"]["allowed"] == ["GET", "HEAD"]
    async with node.http.delete("http://localhost/v1/sim/xid") as response:
        assert response.status == 405 and (await response.json())["error"]["allowed"] == ["POST"]
    status, body = await node.get("/")
    assert status == 404 and body["error"]["code"] == "not-found"


async def test_oversize_bodies_get_413_and_nothing_changes(node):
    _, before = await node.get("/v1/gpus")
    big = json.dumps({"gpu": 0, "pids": [1] * 400_000})
    assert len(big) > 1 << 20
    status, body = await node.post("/v1/sim/processes", data=big)
    assert status == 413 and body["error"]["code"] == "body-too-large"
    async with node.http.get("http://localhost/v1/gpus", data=b"x" * (2 << 20)) as response:
        assert response.status == 200  # read routes take no body: it is discarded, never buffered
    _, after = await node.get("/v1/gpus")
    assert before["gpus"] == after["gpus"]


@pytest.mark.parametrize("payload, code", [
    (b"{not json", "invalid-json"),
    (b"[1, 2]", "invalid-body"),
    (b"", "invalid-body"),
    (json.dumps({"gpu": 0}).encode(), "missing-field"),
    (json.dumps({"gpu": 0, "xid": "79"}).encode(), "invalid-field"),
    (json.dumps({"gpu": 0, "xid": True}).encode(), "invalid-field"),
    (json.dumps({"gpu": [0], "xid": 79}).encode(), "invalid-field"),
    (json.dumps({"gpu": 0, "xid": 0}).encode(), "invalid-field"),
    (json.dumps({"gpu": 0, "xid": 79, "gpuu": 1}).encode(), "unknown-field"),
    (b"\xff\xfe", "invalid-json"),
])
async def test_malformed_request_bodies_get_400(node, payload, code):
    status, body = await node.post("/v1/sim/xid", data=payload)
    assert status == 400 and body["error"]["code"] == code, body
    assert_matches_openapi("POST", "/v1/sim/xid", 400, body)


async def test_sim_xid_validates_its_target(node):
    status, body = await node.post("/v1/sim/xid", {"gpu": 2, "xid": 79})
    assert status == 200 and body["injected"] == "xid"
    assert_matches_openapi("POST", "/v1/sim/xid", 200, body)
    for target in ({"gpu": 9, "xid": 79}, {"gpu": "GPU-unknown", "xid": 79}, {"gpu": 0, "xid": 79, "gi_id": 3}):
        status, body = await node.post("/v1/sim/xid", target)
        assert status == 422 and body["error"]["code"] == "invalid-target", target
        assert_matches_openapi("POST", "/v1/sim/xid", 422, body)


async def test_lost_gpu_is_reported_and_the_rest_still_answers(node):
    _, before = await node.get("/v1/gpus")
    status, _ = await node.post("/v1/sim/gpu-lost", {"gpu": 5})
    assert status == 200
    _, after = await node.get("/v1/gpus")
    assert_matches_openapi("GET", "/v1/gpus", 200, after)
    lost = after["gpus"][5]
    # What a GPU that fell off the bus mostly answers (the simulator cites its sources)
    assert lost["lost"] is True and "Unknown Error" in lost["error"]
    assert lost["uuid"] == before["gpus"][5]["uuid"]  # last known identity is kept
    assert lost["brand"] == before["gpus"][5]["brand"] == "Nvidia"
    assert [g["lost"] for g in after["gpus"]].count(True) == 1
    for ident in ("0", "5", before["gpus"][7]["uuid"]):
        assert (await node.get(f"/v1/gpus/{ident}"))[0] == 200
    assert (await node.get("/healthz"))[0] == 200


async def test_processes_target_checks(node):
    status, body = await node.post("/v1/sim/processes", {"gpu": 1, "pids": [4242, 4243]})
    assert status == 200 and body["pids"] == [4242, 4243]
    for pids in ([0], [-5], ["1"], [True], [1 << 30]):
        status, body = await node.post("/v1/sim/processes", {"gpu": 1, "pids": pids})
        assert status == 400 and body["error"]["code"] == "invalid-field", pids


async def test_requests_never_call_nvml(node):
    calls = []
    real = node.daemon.session.nvml

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    node.daemon.session.nvml = Counting()
    try:
        for path in ("/v1/gpus", "/v1/gpus/3", "/v1/node", "/healthz", "/v1/openapi.json") * 20:
            assert (await node.get(path))[0] == 200
    finally:
        node.daemon.session.nvml = real
    assert calls == []


async def test_garbage_http_gets_400_and_the_server_lives_on(node):
    path = str(node.daemon.config.socket_path)
    for garbage in (b"\x00\x01\x02 garbage\r\n\r\n", b"GET /v1/gpus HTTP/9.9\r\n\r\n",
                    b"GET /v1/gpus HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                    b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * 20000 + b"\r\n\r\n"):
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(garbage)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        status = int(response.split(b" ", 2)[1])
        assert 400 <= status < 500, response[:200]
    assert (await node.get("/v1/gpus"))[0] == 200


async def test_idle_and_silent_connections_are_closed(node):
    reader, writer = await asyncio.open_unix_connection(str(node.daemon.config.socket_path))
    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by gpud, without a request
    assert asyncio.get_running_loop().time() - started < 4
    writer.close()


async def test_a_body_that_never_arrives_times_out(node):
    reader, writer = await asyncio.open_unix_connection(str(node.daemon.config.socket_path))
    writer.write(b"POST /v1/sim/xid HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"gpu\"")
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)
    writer.close()
    assert b" 408 " in status_line
    assert (await node.get("/v1/gpus"))[0] == 200


async def test_56_mig_devices_on_dgx_a100(short_tmp):
    config = make_config(short_tmp)
    assert stage_mig(short_tmp, "dgx-a100", pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE) == 56
    running = await start_daemon(config)
    try:
        _, body = await running.get("/v1/gpus")
    finally:
        await stop_daemon(running)
    assert_matches_openapi("GET", "/v1/gpus", 200, body)
    uuids = set()
    for gpu in body["gpus"]:
        assert gpu["mig"]["mode"] == "enabled"
        devices = gpu["mig"]["devices"]
        assert len(devices) == 7  # seven 1g.5gb fit on an A100-40GB
        assert {d["profile"] for d in devices} == {"1g.5gb"}
        assert {d["memory_total_mib"] for d in devices} == {A100_1G5GB["memory_mib"]}
        assert {d["sm_count"] for d in devices} == {A100_1G5GB["sms"]}
        assert sorted(d["placement"]["start"] for d in devices) == list(range(7))
        assert {d["gi_profile_id"] for d in devices} == {19}
        uuids.update(d["uuid"] for d in devices)
    assert len(uuids) == 56 and all(u.startswith("MIG-") for u in uuids)


async def test_rtx_2080ti_is_not_mig_capable(short_tmp):
    running = await start_daemon(make_config(short_tmp, preset="rtx-2080ti"))
    try:
        _, body = await running.get("/v1/gpus")
    finally:
        await stop_daemon(running)
    (gpu,) = body["gpus"]
    assert gpu["name"] == "NVIDIA GeForce RTX 2080 Ti" and gpu["architecture"] == "turing"
    assert gpu["mig"] == {"capable": False, "mode": None, "pending_mode": None, "devices": []}


async def test_an_unknown_path_of_many_segments_costs_what_a_short_one_does(node):
    """aiohttp's router looked a path up under each of its prefixes in turn: a 404 for an 8 KiB path
    of 4,050 segments cost about 45 short ones. Now the two cost about the same (the fastest of
    several rounds of each, measured alternately), and the answer quotes only the path's start."""
    deep = "/a" * 4050

    async def per_request(path: str, requests: int = 40) -> float:
        reader, writer = await asyncio.open_unix_connection(str(node.daemon.config.socket_path))
        request = f"GET {path} HTTP/1.1\r\nHost: gpud\r\n\r\n".encode()
        started = asyncio.get_running_loop().time()
        for _ in range(requests):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 404")
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        writer.close()
        return (asyncio.get_running_loop().time() - started) / requests

    short, long = [], []
    for _ in range(5):
        short.append(await per_request("/nope"))
        long.append(await per_request(deep))
    assert min(long) < 4 * min(short), (min(long), min(short))
    status, body = await node.get(deep)
    assert status == 404 and body["error"]["message"] == (
        f"no such route: {deep[:100]}... (8100 characters); GET /v1/openapi.json lists the routes")
