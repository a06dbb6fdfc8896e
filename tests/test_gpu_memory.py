"""GPU memory as a schedulable resource (gpud.yaml gpu_memory): the config's refusals, the units
/v1/sharing advertises per device, the MPS daemons (NVIDIA's real nvidia-cuda-mps-control) serving
them, MIG devices only where listed, and the allocations the device plugin reports."""

from __future__ import annotations

import asyncio
import math

import pytest
from helpers import mig_config, put_layout, start_daemon, stop_daemon
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
