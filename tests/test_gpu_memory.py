"""GPU memory as a schedulable resource (gpud.yaml gpu_memory): the config's refusals, the units
/v1/sharing advertises per device, the MPS daemons (NVIDIA's real nvidia-cuda-mps-control) serving
them, MIG devices only where listed, and the allocations the device plugin reports."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from helpers import (answer_until, cli, kill_mps_under, mig_config, put_layout, sim_config, start_daemon, stop_daemon,
                     until_async)
from openapi_check import assert_matches_openapi

from gpud.config import ConfigError, parse_config
from gpud.nvml.sim.presets import parse_preset

RESOURCE = "nvidia.com/gpu-memory"


@pytest.mark.parametrize(("text", "key"), [
    ("unit_mib: 0", "gpu_memory.unit_mib"),
    ("unit_mib: -1024", "gpu_memory.unit_mib"),
    ("unit_mib: 1.5", "gpu_memory.unit_mib"),
    ("unit_mib: '1024'", "gpu_memory.unit_mib"),
    ("unit_mib: true", "gpu_memory.unit_mib"),
    ("resource: gpu-memory", "gpu_memory.resource"),  # no domain
    ("resource: kubernetes.io/gpu-memory", "gpu_memory.resource"),
    ("resource: example.kubernetes.io/gpu-memory", "gpu_memory.resource"),
    ("resource: requests.example.com/gpu-memory", "gpu_memory.resource"),
    ("resource: Example.com/gpu-memory", "gpu_memory.resource"),  # a DNS subdomain is lower-case
    ("resource: example.com/gpu/memory", "gpu_memory.resource"),
    ("resource: example.com/-gpu", "gpu_memory.resource"),
    (f"resource: example.com/{'m' * 64}", "gpu_memory.resource"),
    ("resource: ''", "gpu_memory.resource"),
    ("devices: []", "gpu_memory.devices"),
    ("devices:", "gpu_memory.devices"),
    ("devices: [true]", "gpu_memory.devices[0]"),
    ("devices: some", "gpu_memory.devices"),
    ("enabled: yes please", "gpu_memory.enabled"),
    ("proportional_threads: 1", "gpu_memory.proportional_threads"),
    ("units: 3", "gpu_memory.units"),
])
def test_bad_gpu_memory_settings_are_refused_naming_the_key(text, key):
    with pytest.raises(ConfigError) as refused:
        parse_config(f"gpu_memory:\n  {text}\n")
    assert refused.value.key == key


def test_any_extended_resource_name_is_taken_verbatim():
    config = parse_config("gpu_memory:\n  enabled: true\n  resource: aliyun.com/gpu-mem\n  unit_mib: 1\n"
                          "  devices: [0, GPU-8d7bd2d4-1ab2-521a-a26f-3c0a8c889449]\n").gpu_memory
    assert (config.resource, config.unit_mib, config.devices) == (
        "aliyun.com/gpu-mem", 1, (0, "GPU-8d7bd2d4-1ab2-521a-a26f-3c0a8c889449"))
    assert parse_config("").gpu_memory.enabled is False


def expected_units(preset: str, unit_mib: int) -> int:
    """floor((memory - what the driver reserves, in whole MiB rounded up) / unit) for the preset's GPU model."""
    model = parse_preset(preset)[0]
    return (model.memory_mib - math.ceil(model.reserved_mib)) // unit_mib


def gpu_memory_config(tmp, preset, **settings):
    config = mig_config(tmp, preset).with_overrides(**{"mps.log_root": str(tmp / "mpslog"),
                                                       "mps.check_interval_s": 0.2, "gpu_memory.enabled": True})
    return config.with_overrides(**{f"gpu_memory.{key}": value for key, value in settings.items()})


def gpu_memory_resource(view: dict) -> dict:
    (resource,) = [r for r in view["resources"] if r["strategy"] == "gpu-memory"]
    return resource


async def running_daemon_names(node, count: int) -> list[str]:
    for _ in range(1000):  # MPS daemons start in the background after the first inventory
        _, view = await node.get("/v1/mps")
        if len(view["daemons"]) == count and all(d["state"] == "running" for d in view["daemons"]):
            return sorted(d["name"] for d in view["daemons"])
        await asyncio.sleep(0.02)
    raise AssertionError(f"never {count} running MPS daemons: {view}")


async def test_two_a100_80gb_offer_their_memory_in_1_gib_units_served_by_mps(mps_tmp):
    node = await start_daemon(gpu_memory_config(mps_tmp, "A100-SXM4-80GB:2"))
    try:
        assert await running_daemon_names(node, 2) == ["gpu0", "gpu1"]
        _, view = await node.get("/v1/sharing")
        assert_matches_openapi("GET", "/v1/sharing", 200, view)
        _, gpus = await node.get("/v1/gpus")
        resource = gpu_memory_resource(view)
        units = expected_units("A100-SXM4-80GB:1", 1024)
        assert units == 79  # 80 GiB less the driver's reserve: not a whole 80th GiB
        assert {k: resource[k] for k in ("name", "unit_mib", "proportional_threads", "count",
                                         "fail_requests_greater_than_one")} == {
            "name": RESOURCE, "unit_mib": 1024, "proportional_threads": False, "count": 2 * units,
            "fail_requests_greater_than_one": False}
        for index, gpu in enumerate(gpus["gpus"]):
            mine = [d for d in resource["devices"] if d["device"] == gpu["uuid"]]
            assert [d["id"] for d in mine] == [f"{gpu['uuid']}::{n}" for n in range(units)]
            assert {(d["parent"], d["gpu_index"], d["units"], d["mps_daemon"], d["healthy"]) for d in mine} == {
                (gpu["uuid"], index, units, f"gpu{index}", True)}
        assert view["labels"][f"{RESOURCE}.total-mib"] == str(2 * units * 1024)
        assert any(r["name"] == "nvidia.com/gpu" for r in view["resources"])  # the plain GPUs stay
        _, mps = await node.get("/v1/mps")
        assert all(d["pinned_memory_limit_mib"] == [None] and d["active_thread_percentage"] is None
                   for d in mps["daemons"])  # limits are per client
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize(("preset", "model", "gpus"), [("hgx-h100", "H100-SXM5-80GB:1", 8),
                                                      ("hgx-h200", "H200-SXM5-141GB:1", 8)])
async def test_eight_gpu_boards_advertise_every_gpus_units_and_never_more_than_they_offer(short_tmp, preset, model,
                                                                                       gpus):
    config = gpu_memory_config(short_tmp, preset, unit_mib=1000)
    node = await start_daemon(config.with_overrides(**{"mps.control_binary": str(short_tmp / "absent")}))
    try:
        _, view = await node.get("/v1/sharing")
        resource = gpu_memory_resource(view)
        units = expected_units(model, 1000)
        assert resource["count"] == gpus * units and {d["units"] for d in resource["devices"]} == {units}
        _, allocations = await node.get("/v1/allocations")
        for device in allocations["devices"]:
            assert device["allocatable_mib"] <= device["offered_mib"] < device["total_mib"]
    finally:
        await stop_daemon(node)


async def test_a_unit_larger_than_a_device_and_a_selector_matching_nothing_are_reported(short_tmp):
    config = gpu_memory_config(short_tmp, "t4", unit_mib=1 << 20, devices=(0, "GPU-00000000-0000-0000-0000-000000000000"))
    node = await start_daemon(config.with_overrides(**{"mps.control_binary": str(short_tmp / "absent")}))
    try:
        _, view = await node.get("/v1/sharing")
        resource = gpu_memory_resource(view)
        assert resource["count"] == 0 and resource["devices"] == []
        warnings = " ".join(view["warnings"])
        assert "gpu_memory.unit_mib" in warnings and "gpu_memory.devices" in warnings
        assert "GPU-00000000-0000-0000-0000-000000000000" in warnings
    finally:
        await stop_daemon(node)


async def test_mig_devices_are_covered_only_where_listed_and_a_mig_change_re_advertises(mps_tmp):
    node = await start_daemon(gpu_memory_config(mps_tmp, "A100-SXM4-40GB:2", devices=(1,)))
    try:
        assert await running_daemon_names(node, 1) == ["gpu1"]
        assert (await put_layout(node, "all-1g.5gb"))[0] == 200
        _, gpus = await node.get("/v1/gpus")
        names = await running_daemon_names(node, 7)  # GPU 1 listed: its 7 MIG devices; GPU 0 not
        assert all(name.startswith("gpu1-gi") for name in names)
        _, view = await node.get("/v1/sharing")
        assert_matches_openapi("GET", "/v1/sharing", 200, view)
        resource = gpu_memory_resource(view)
        gpu1 = gpus["gpus"][1]
        migs = {m["uuid"]: m for m in gpu1["mig"]["devices"]}
        assert {d["device"] for d in resource["devices"]} == set(migs)
        for uuid, mig in migs.items():
            mine = [d for d in resource["devices"] if d["device"] == uuid]
            assert len(mine) == mig["memory_total_mib"] // 1024 == mine[0]["units"]
            assert mine[0]["parent"] == gpu1["uuid"] and mine[0]["mps_daemon"].startswith("gpu1-gi")
        assert (await put_layout(node, "all-disabled"))[0] == 200
        _, view = await node.get("/v1/sharing")
        assert {d["device"] for d in gpu_memory_resource(view)["devices"]} == {gpu1["uuid"]}
        assert await running_daemon_names(node, 1) == ["gpu1"]
    finally:
        await stop_daemon(node)


# -- allocations -----------------------------------------------------------------------------------


async def put_allocations(node, body, raw: bytes | None = None):
    kwargs = {"data": raw, "headers": {"Content-Type": "application/json"}} if raw is not None else {"json": body}
    async with node.http.put("http://localhost/v1/allocations", **kwargs) as response:
        return response.status, await response.json()


async def test_allocations_round_trip_with_metrics_labels_and_a_watch_event(short_tmp):
    config = gpu_memory_config(short_tmp, "A100-SXM4-80GB:2", resource="aliyun.com/gpu-mem")
    node = await start_daemon(config.with_overrides(**{"mps.control_binary": str(short_tmp / "absent")}))
    try:
        status, before = await node.get("/v1/allocations")
        assert status == 200
        assert_matches_openapi("GET", "/v1/allocations", 200, before)
        assert before["reported_at"] is None and all(d["holders"] == [] for d in before["devices"])
        units = expected_units("A100-SXM4-80GB:1", 1024)
        assert [d["allocatable_units"] for d in before["devices"]] == [units, units]
        _, sharing = await node.get("/v1/sharing")
        ids = [d["id"] for d in gpu_memory_resource(sharing)["devices"]]
        gpu0 = before["devices"][0]["device"]
        report = {"resource": "aliyun.com/gpu-mem", "read_at": 1_790_000_000.5, "pods": [
            {"namespace": "ml", "pod": "train-0", "container": "main", "device_ids": ids[:7]},
            {"namespace": "ml", "pod": "infer-1", "container": "main", "device_ids": [*ids[7:9], "GPU-gone::3"]}]}
        status, after = await put_allocations(node, report)
        assert status == 200, after
        assert_matches_openapi("PUT", "/v1/allocations", 200, after)
        _, got = await node.get("/v1/allocations")
        assert got == after and got["read_at"] == 1_790_000_000.5 and got["reported_at"] is not None
        first = got["devices"][0]
        assert first["device"] == gpu0 and first["allocated_units"] == 9 and first["allocated_mib"] == 9 * 1024
        assert first["holders"] == [
            {"namespace": "ml", "pod": "infer-1", "container": "main", "units": 2, "mib": 2048},
            {"namespace": "ml", "pod": "train-0", "container": "main", "units": 7, "mib": 7 * 1024}]
        assert got["node"] == {"allocatable_mib": 2 * units * 1024, "allocated_mib": 9 * 1024, "pods": 2}
        assert got["unknown_ids"] == ["GPU-gone::3"] and got["unknown_id_count"] == 1
        assert any("1 reported device IDs" in p for p in got["problems"])

        async with node.http.get("http://localhost/metrics") as response:
            metrics = await response.text()
        allocated = [line for line in metrics.splitlines() if line.startswith("gpud_gpu_memory_allocated_bytes{")]
        assert len(allocated) == 2
        assert any(f'UUID="{gpu0}"' in line and line.endswith(f" {9 * 1024 << 20}") for line in allocated)
        assert 'modelName="NVIDIA A100-SXM4-80GB"' in allocated[0] and 'gpu="0"' in allocated[0]
        assert metrics.count("gpud_gpu_memory_allocatable_bytes{") == 2

        async with node.http.get("http://localhost/v1/watch?since=0&types=allocations") as response:
            line = await asyncio.wait_for(response.content.readline(), 5)
        event = json.loads(line)
        assert event["type"] == "allocations" and event["data"]["pods"] == 2

        shown = await asyncio.to_thread(cli, "sharing", "allocations", socket=config.socket_path)
        lines = shown.stdout.splitlines()
        assert lines[1].split() == ["DEVICE", "ALLOCATED/TOTAL", "(GiB)", "PODS"], shown.stdout
        assert lines[2].split() == ["GPU", "0", f"9/{units}", "2"] and lines[3].split() == ["GPU", "1", f"0/{units}", "0"]
        assert lines[4].split() == ["node", f"9/{2 * units}", "2"]
        assert shown.returncode == 1 and "GPU-gone" not in shown.stdout  # the unknown ID is a problem, counted
        as_json = await asyncio.to_thread(cli, "sharing", "allocations", "--json", socket=config.socket_path)
        assert json.loads(as_json.stdout)["node"] == got["node"]
        sharing_table = await asyncio.to_thread(cli, "sharing", socket=config.socket_path)
        assert ["aliyun.com/gpu-mem", "gpu-memory", "1024", "MiB", "units", str(2 * units), str(2 * units)] in [
            line.split() for line in sharing_table.stdout.splitlines()], sharing_table.stdout + sharing_table.stderr

        label = "aliyun.com/gpu-mem.total-mib"
        _, nfd = await answer_until(node, "/v1/nfd", lambda _, body: label in body["labels"])
        assert nfd["labels"][label] == str(2 * units * 1024)
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize(("body", "code"), [
    ({"resource": RESOURCE, "read_at": "now", "pods": []}, "invalid-field"),
    ({"resource": RESOURCE, "read_at": 1, "pods": {}}, "invalid-field"),
    ({"resource": RESOURCE, "read_at": 1}, "missing-field"),
    ({"resource": RESOURCE, "read_at": 1, "pods": [], "extra": 1}, "unknown-field"),
    ({"resource": RESOURCE, "read_at": -5, "pods": []}, "invalid-field"),
    ({"resource": RESOURCE, "read_at": 1, "pods": ["ml/train"]}, "invalid-field"),
    ({"resource": RESOURCE, "read_at": 1, "pods": [{"namespace": "ml", "pod": "p", "container": "c"}]},
     "invalid-field"),
    ({"resource": RESOURCE, "read_at": 1, "pods": [{"namespace": "ml", "pod": "p", "container": "c",
                                                    "device_ids": [7]}]}, "invalid-field"),
    ({"resource": RESOURCE, "read_at": 1, "pods": [{"namespace": "", "pod": "p", "container": "c",
                                                    "device_ids": []}]}, "invalid-field"),
    ({"resource": RESOURCE, "read_at": 1, "pods": [{"namespace": "n" * 254, "pod": "p", "container": "c",
                                                    "device_ids": []}]}, "invalid-field"),
    ({"resource": RESOURCE, "read_at": 1, "pods": [{"namespace": "ml", "pod": "p", "container": "c",
                                                    "device_ids": [], "uid": "x"}]}, "unknown-field"),
    ({"resource": "nvidia.com/gpu", "read_at": 1, "pods": []}, "wrong-resource"),
])
async def test_hostile_allocation_reports_are_refused_and_change_nothing(short_tmp, body, code):
    config = gpu_memory_config(short_tmp, "t4").with_overrides(**{"mps.control_binary": str(short_tmp / "absent")})
    node = await start_daemon(config)
    try:
        status, answer = await put_allocations(node, body)
        assert status in (400, 409) and answer["error"]["code"] == code, answer
        _, view = await node.get("/v1/allocations")
        assert view["reported_at"] is None
    finally:
        await stop_daemon(node)


async def test_huge_allocation_reports_are_refused(short_tmp):
    config = gpu_memory_config(short_tmp, "t4").with_overrides(**{"mps.control_binary": str(short_tmp / "absent")})
    node = await start_daemon(config)
    try:
        pod = {"namespace": "ml", "pod": "p", "container": "c", "device_ids": ["x"] * 60_000}
        status, answer = await put_allocations(node, {"resource": RESOURCE, "read_at": 1, "pods": [pod, pod]})
        assert status == 400 and answer["error"]["code"] in ("too-many-ids", "body-too-complex"), answer
        many = {"resource": RESOURCE, "read_at": 1, "pods": [{"namespace": "n", "pod": f"p{i}", "container": "c",
                                                              "device_ids": []} for i in range(10_001)]}
        status, answer = await put_allocations(node, many)
        assert status == 400 and answer["error"]["code"] in ("too-many-pods", "body-too-complex"), answer
        status, answer = await put_allocations(node, None, raw=b'{"pods": [' + b"[]," * 300_000 + b"[]]}")
        assert status in (400, 413), answer
        _, view = await node.get("/v1/allocations")
        assert view["reported_at"] is None
    finally:
        await stop_daemon(node)


async def test_the_cdi_spec_is_written_with_gpu_memory_and_names_whole_devices_only(short_tmp):
    """Units of GPU memory are not CDI devices: a container gets its device's own (the spec builder
    once stopped at the gpu-memory entry, and gpud never wrote its spec)."""
    config = sim_config(short_tmp, "A100-SXM4-80GB:2").with_overrides(**{
        "gpu_memory.enabled": True, "mps.pipe_root": str(short_tmp / "mps"), "mps.log_root": str(short_tmp / "ml")})
    node = await start_daemon(config)
    try:
        _, cdi = await until_async(lambda: _written(node), 10, "the CDI spec written")
        _, gpus = await node.get("/v1/gpus")
        assert {g["uuid"] for g in gpus["gpus"]} <= set(cdi["devices"])
        assert not any("::" in name for name in cdi["devices"])
    finally:
        await stop_daemon(node)
        kill_mps_under(short_tmp)


async def _written(node):
    status, cdi = await node.get("/v1/cdi")
    return (status, cdi) if cdi["written_at"] is not None else None


async def test_a_background_task_that_raises_is_said_in_healthz(short_tmp):
    node = await start_daemon(sim_config(short_tmp, "A100-SXM4-40GB:1"))

    async def broken():
        raise RuntimeError("probe")

    try:
        node.daemon.lifecycle.tasks.spawn(broken(), "probe")
        status, health = await until_async(lambda: _degraded(node), 5, "/healthz degraded")
        assert "gpud's probe task stopped (RuntimeError: probe)" in json.dumps(health)
    finally:
        await stop_daemon(node)


async def _degraded(node):
    status, health = await node.get("/healthz")
    return (status, health) if "probe" in json.dumps(health) else None
