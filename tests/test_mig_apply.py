"""MIG layouts applied through the API on simulated nodes: exact, incremental, refusals, hooks."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import mig_config, mig_settled, put_layout, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi

from gpud.config import MigHooksConfig
from gpud.mig.layouts import parse_layouts

# Per model, what NVIDIA's tables give (shared/reference/mig-profiles.md §3): layout -> {profile: (count, MiB)}.
A100_40GB = {
    "all-1g.5gb": {"1g.5gb": (7, 4864)},
    "all-1g.5gb.me": {"1g.5gb+me": (1, 4864)},
    "all-1g.10gb": {"1g.10gb": (4, 9856)},
    "all-2g.10gb": {"2g.10gb": (3, 9856)},
    "all-3g.20gb": {"3g.20gb": (2, 19968)},
    "all-4g.20gb": {"4g.20gb": (1, 19968)},
    "all-7g.40gb": {"7g.40gb": (1, 40192)},
    "all-balanced": {"1g.5gb": (2, 4864), "2g.10gb": (1, 9856), "3g.20gb": (1, 19968)},
}
H100_80GB = {
    "all-1g.10gb": {"1g.10gb": (7, 9984)},
    "all-1g.20gb": {"1g.20gb": (4, 20096)},
    "all-2g.20gb": {"2g.20gb": (3, 20096)},
    "all-3g.40gb": {"3g.40gb": (2, 40448)},
    "all-4g.40gb": {"4g.40gb": (1, 40448)},
    "all-7g.80gb": {"7g.80gb": (1, 81152)},
    "all-balanced": {"1g.10gb": (2, 9984), "2g.20gb": (1, 20096), "3g.40gb": (1, 40448)},
}
A30 = {
    "all-1g.6gb": {"1g.6gb": (4, 5952)},
    "all-2g.12gb": {"2g.12gb": (2, 11968)},
    "all-4g.24gb": {"4g.24gb": (1, 24064)},
    "all-balanced": {"1g.6gb": (2, 5952), "2g.12gb": (1, 11968)},
}


def device_summary(gpu) -> dict:
    counts = Counter(d["profile"] for d in gpu["mig"]["devices"])
    memory = {d["profile"]: d["memory_total_mib"] for d in gpu["mig"]["devices"]}
    return {name: (count, memory[name]) for name, count in counts.items()}


@pytest.mark.parametrize("preset, gpus, table", [
    ("dgx-a100", 8, A100_40GB), ("hgx-h100", 8, H100_80GB), ("a30", 4, A30)])
async def test_standard_layouts_give_nvidias_counts_and_sizes(short_tmp, preset, gpus, table):
    node = await start_daemon(mig_config(short_tmp, preset))
    try:
        for layout, expected in table.items():
            status, body = await put_layout(node, layout)
            assert status == 200, body
            assert body["state"] == "success" and body["in_sync"] is True
            assert_matches_openapi("PUT", "/v1/mig", 200, body)
            _, listing = await node.get("/v1/gpus")
            assert len(listing["gpus"]) == gpus
            for gpu in listing["gpus"]:
                assert gpu["mig"]["mode"] == "enabled"
                assert device_summary(gpu) == expected, (layout, gpu["index"])
            total = sum(len(g["mig"]["devices"]) for g in listing["gpus"])
            assert total == gpus * sum(count for count, _ in expected.values())
        status, body = await put_layout(node, "all-disabled")
        assert status == 200
        _, listing = await node.get("/v1/gpus")
        assert all(g["mig"]["mode"] == "disabled" and not g["mig"]["devices"] for g in listing["gpus"])
    finally:
        await stop_daemon(node)


TWO_LAYOUTS = """
version: v1
mig-configs:
  base:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.5gb": 7}
  gpu7-changed:
    - devices: [0, 1, 2, 3, 4, 5, 6]
      mig-enabled: true
      mig-devices: {"1g.5gb": 7}
    - devices: [7]
      mig-enabled: true
      mig-devices: {"1g.5gb": 5, "2g.10gb": 1}
  too-much:
    - devices: [3]
      mig-enabled: true
      mig-devices: {"4g.20gb": 2}
"""


def uuids(listing) -> list[list[str]]:
    return [sorted(d["uuid"] for d in g["mig"]["devices"]) for g in listing["gpus"]]


async def test_a_change_touches_only_what_must_change(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100", TWO_LAYOUTS))
    try:
        assert (await put_layout(node, "base"))[0] == 200
        _, before = await node.get("/v1/gpus")
        status, body = await put_layout(node, "gpu7-changed")
        assert status == 200, body
        plan = {p["index"]: p for p in body["plan"]}
        assert list(plan) == [7]  # only GPU 7 is planned at all
        assert plan[7]["keep"] == 5
        _, after = await node.get("/v1/gpus")
        assert uuids(after)[:7] == uuids(before)[:7]
        kept = set(uuids(after)[7]) & set(uuids(before)[7])
        assert len(kept) == 5  # five 1g.5gb kept their MIG UUIDs
        assert device_summary(after["gpus"][7]) == {"1g.5gb": (5, 4864), "2g.10gb": (1, 9856)}
    finally:
        await stop_daemon(node)


async def test_a_layout_that_does_not_fit_is_refused_with_no_change(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100", TWO_LAYOUTS))
    try:
        assert (await put_layout(node, "base"))[0] == 200
        state_file = short_tmp / "sim.json"
        before = state_file.read_bytes(), state_file.stat().st_mtime_ns
        status, body = await put_layout(node, "too-much")
        assert status == 422 and body["error"]["code"] == "layout-does-not-fit"
        assert_matches_openapi("PUT", "/v1/mig", 422, body)
        assert "GPU 3" in body["error"]["message"] and "4g.20gb" in body["error"]["message"]
        status, body = await put_layout(node, "gpu7-changed", dry_run=True)
        assert status == 200 and body["dry_run"] is True and body["plan"][0]["index"] == 7
        assert (state_file.read_bytes(), state_file.stat().st_mtime_ns) == before  # zero NVML mutations
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] == "base" and mig["in_sync"] is True
    finally:
        await stop_daemon(node)


async def test_running_processes_block_destruction_unless_forced(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100", TWO_LAYOUTS))
    try:
        assert (await put_layout(node, "base"))[0] == 200
        _, gpu7 = await node.get("/v1/gpus/7")
        busy = sorted(gpu7["mig"]["devices"], key=lambda d: d["placement"]["start"])
        for device in busy:  # every instance busy: whatever the planner picks, it hits one
            await node.post("/v1/sim/processes", {"gpu": device["uuid"], "pids": [4242]})
        status, body = await put_layout(node, "gpu7-changed")
        assert status == 409 and body["error"]["code"] == "instances-in-use"
        assert "GPU 7" in body["error"]["message"] and "4242" in body["error"]["message"]
        assert body["error"]["busy"][0]["pids"] == [4242]
        _, unchanged = await node.get("/v1/gpus/7")
        assert sorted(d["uuid"] for d in unchanged["mig"]["devices"]) == sorted(d["uuid"] for d in busy)
        status, body = await put_layout(node, "gpu7-changed", force=True)
        assert status == 200, body
        _, changed = await node.get("/v1/gpus/7")
        assert device_summary(changed) == {"1g.5gb": (5, 4864), "2g.10gb": (1, 9856)}
    finally:
        await stop_daemon(node)


async def test_ampere_reset_can_be_left_to_the_operator(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2", allow_gpu_reset=False))
    try:
        # An idle A100 switches MIG mode by itself (the driver resets it); one another process holds
        # stays pending until a reset (reference migparted.md §3, gpu-operator#351).
        for gpu in (0, 1):
            node.daemon.session.nvml.sim_add_holder(gpu, "nvidia-persistenced", 900)
        status, body = await put_layout(node, "all-1g.5gb")
        assert status == 409 and body["error"]["code"] == "reset-required"
        _, mig = await node.get("/v1/mig")
        assert mig["state"] == "reset-required" and not mig["in_sync"]
        _, gpu = await node.get("/v1/gpus/0")
        assert gpu["mig"]["mode"] == "disabled" and gpu["mig"]["pending_mode"] == "enabled"
    finally:
        await stop_daemon(node)


async def test_hooks_run_around_a_change_and_a_failing_pre_hook_cancels(short_tmp):
    record = short_tmp / "hooks.log"
    node = await start_daemon(mig_config(
        short_tmp, "A100-SXM4-40GB:2",
        hooks=MigHooksConfig(pre_apply=(f'echo "pre $GPUD_MIG_LAYOUT $GPUD_MIG_GPUS" >> {record}',),
                                           post_apply=(f'echo "post $GPUD_MIG_LAYOUT" >> {record}',))))
    try:
        assert (await put_layout(node, "all-1g.5gb"))[0] == 200
        assert (await put_layout(node, "all-1g.5gb"))[0] == 200  # nothing changes: no hooks
        assert record.read_text().splitlines() == ["pre all-1g.5gb 0,1", "post all-1g.5gb"]
    finally:
        await stop_daemon(node)
    failing = await start_daemon(mig_config(
        short_tmp, "A100-SXM4-40GB:2", hooks=MigHooksConfig(pre_apply=("exit 3",))))
    try:
        await mig_settled(failing)  # the restarted gpud first converges on the layout it persisted
        before = (short_tmp / "sim.json").read_bytes()
        status, body = await put_layout(failing, "all-balanced")
        assert status == 409 and "pre_apply" in body["error"]["message"]
        assert (short_tmp / "sim.json").read_bytes() == before
    finally:
        await stop_daemon(failing)


async def test_layouts_listing_export_and_status(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100"))
    try:
        _, listing = await node.get("/v1/mig/layouts")
        assert_matches_openapi("GET", "/v1/mig/layouts", 200, listing)
        fits = {entry["name"]: entry["fits"] for entry in listing["layouts"]}
        assert listing["source"] == "builtin"
        assert fits["all-balanced"] and fits["all-1g.5gb"] and fits["all-disabled"]
        assert (await put_layout(node, "all-balanced"))[0] == 200
        async with node.http.get("http://localhost/v1/mig/export") as response:
            exported = await response.text()
        layout = parse_layouts(exported)["current"]
        (entry,) = layout.entries
        assert entry.mig_enabled and entry.mig_devices == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
        _, status = await node.get("/v1/mig")
        assert_matches_openapi("GET", "/v1/mig", 200, status)
        assert status["layout"] == "all-balanced" and status["state"] == "success" and status["in_sync"]
        assert all(g["desired"] == g["actual"] for g in status["gpus"])
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("body, status, code", [
    ({"layout": "no-such"}, 404, "layout-not-found"),
    ({"layout": 5}, 400, "invalid-field"),
    ({"layout": "all-balanced", "force": "yes"}, 400, "invalid-field"),
    ({"layout": "all-balanced", "extra": 1}, 400, "unknown-field"),
    ({}, 400, "missing-field"),
])
async def test_bad_apply_requests(short_tmp, body, status, code):
    node = await start_daemon(mig_config(short_tmp, "t4"))
    try:
        async with node.http.put("http://localhost/v1/mig", json=body) as response:
            assert response.status == status
            assert (await response.json())["error"]["code"] == code
    finally:
        await stop_daemon(node)


async def test_a_broken_layouts_file_is_a_clear_error(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100", "version: v2\nmig-configs: {}\n"))
    try:
        status, body = await node.get("/v1/mig/layouts")
        assert status == 422 and body["error"]["code"] == "layouts-file-invalid"
        assert "layouts.yaml" in body["error"]["message"]
    finally:
        await stop_daemon(node)


async def test_a_failure_midway_rolls_that_gpu_back_and_is_reported(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "dgx-a100", TWO_LAYOUTS))
    try:
        assert (await put_layout(node, "base"))[0] == 200
        _, before = await node.get("/v1/gpus")
        status, dry = await put_layout(node, "gpu7-changed", dry_run=True)
        steps = dry["plan"][0]["mutations"]
        assert steps == 6  # destroy 2 CIs and 2 GIs, create one 2g.10gb GI and its CI
        node.daemon.session.nvml.sim_fail_mig_call(after=steps - 1)  # the GI create fails
        status, body = await put_layout(node, "gpu7-changed")
        assert status == 409 and body["error"]["code"] == "apply-failed"
        assert "GPU 7" in body["error"]["message"] and "Unknown" in body["error"]["message"]
        assert_matches_openapi("GET", "/v1/mig", 200, body["error"]["mig"])
        _, after = await node.get("/v1/gpus")
        assert uuids(after) == uuids(before)  # GPU 7 back as it was, same MIG UUIDs; the others untouched
        _, mig = await node.get("/v1/mig")
        assert mig["state"] == "failed" and not mig["in_sync"]
        assert [g["state"] for g in mig["gpus"]] == ["unchanged"] * 7 + ["failed"]
    finally:
        await stop_daemon(node)


async def test_default_layout_is_applied_at_start_and_an_api_choice_outlives_restarts(short_tmp):
    config = mig_config(short_tmp, "A100-SXM4-40GB:2", default_layout="all-3g.20gb")
    node = await start_daemon(config)
    try:
        mig = await mig_settled(node)
        assert mig["layout"] == "all-3g.20gb" and mig["state"] == "success" and mig["in_sync"]
        assert (await put_layout(node, "all-balanced"))[0] == 200
    finally:
        await stop_daemon(node)
    node = await start_daemon(config)  # the operator's API choice stands; the default does not return
    try:
        mig = await mig_settled(node)
        assert mig["layout"] == "all-balanced" and mig["in_sync"]
    finally:
        await stop_daemon(node)


async def test_a_gpud_that_is_not_root_says_so_before_an_apply_that_needs_root(short_tmp, monkeypatch):
    """nvml.h, nvmlDeviceSetMigMode: "Requires root user". gpud and the simulated driver both read the
    uid per call, so with uid 1000 the node behaves as a driver does for an ordinary user's gpud: the
    dry run and the layouts name what needs root, and the apply itself is refused before the driver is asked."""
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        status, as_root = await put_layout(node, "all-balanced", dry_run=True)
        assert status == 200 and as_root["needs_root"] is None
        monkeypatch.setattr("os.geteuid", lambda: 1000)
        status, dry = await put_layout(node, "all-balanced", dry_run=True)
        assert status == 200, dry
        assert_matches_openapi("PUT", "/v1/mig", 200, dry)
        assert dry["needs_root"].startswith("gpud runs as uid 1000, not root")
        assert "change GPU 0, 1" in dry["needs_root"] and "Insufficient Permissions" in dry["needs_root"]
        _, layouts = await node.get("/v1/mig/layouts")
        assert_matches_openapi("GET", "/v1/mig/layouts", 200, layouts)
        by_name = {layout["name"]: layout for layout in layouts["layouts"]}
        assert by_name["all-balanced"]["fits"] is True
        assert by_name["all-balanced"]["needs_root"] == dry["needs_root"]
        assert by_name["all-disabled"]["needs_root"] is None  # changes nothing on this node
        status, body = await put_layout(node, "all-balanced")  # refused before the driver is asked
        assert status == 501 and body["error"]["code"] == "needs-root", body
    finally:
        monkeypatch.undo()
        await stop_daemon(node)
