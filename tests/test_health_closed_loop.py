"""Closed-loop health on a running gpud: the driver's recovery action, the kernel log as a second XID
source, the NVLink fabric and Fabric Manager, driver mismatch, InfiniBand ports, `gpud check` and
health.auto_reset, on the simulator (which models the driver per branch) and on NVIDIA's mock NVML."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pynvml
import pytest
import yaml

from gpud.config import Config, HealthConfig, HostConfig
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim._fabric_calls import HEALTHY_MASK
from helpers import (MOCK_NVML_CONFIGS, REPO, GpudProcess, cli, mock_nvml_library, need, sim_config, start_daemon,
                     stop_daemon, until_async)

DRIVER_WITH_ACTION = "580.65.06"  # R565 and later keep the recovery action (field 230)
DRIVER_WITHOUT_ACTION = "550.90.07"
IB_FIXTURE = REPO / "tests" / "fixtures" / "infiniband" / "ndr-connectx7" / "sys"
STAND_IN_DCGMI = REPO / "tests" / "dcgmi_stand_in.py"


def node_config(tmp: Path, preset: str, driver: str = DRIVER_WITH_ACTION, **health) -> Config:
    config = sim_config(tmp, preset).with_overrides(sim_driver=driver)
    return dataclasses.replace(config, health=dataclasses.replace(HealthConfig(), check_interval_s=3600.0, **health))


async def health_view(node) -> dict:
    async with node.http.get("http://localhost/v1/health") as response:
        assert response.status == 200
        return await response.json()


async def metrics_text(node) -> str:
    async with node.http.get("http://localhost/metrics") as response:
        return await response.text()


def sim(node):
    return node.daemon.session.nvml


def gpu_of(view: dict, index: int) -> dict:
    return next(gpu for gpu in view["gpus"] if gpu["index"] == index)


def watched(node, after: int) -> list[dict]:
    events, _ = node.daemon.bus.backlog_after(after)
    return [json.loads(event.line)["data"] for event in events if event.type == "health"]


async def test_the_drivers_action_is_in_health_metrics_and_the_watch_stream_and_a_recovery_clears_the_xid(short_tmp):
    node = await start_daemon(node_config(short_tmp, "A100-SXM4-80GB:2"))
    try:
        health = node.daemon.health
        await health.check_once()
        assert gpu_of(await health_view(node), 0)["driver_action"] == "none"
        since = node.daemon.bus.sequence
        await node.daemon.session.call(lambda nvml: nvml.sim_inject_xid(0, 48))  # the driver asks for a reset
        await until_async(lambda: _has_reason(node, 0, "xid"), what="the XID's reason")
        await health.check_once()
        gpu = gpu_of(await health_view(node), 0)
        assert gpu["driver_action"] == "gpu-reset" and gpu["state"] == "unhealthy"
        assert {(r["kind"], r["code"]) for r in gpu["reasons"]} == {("xid", "48"), ("recovery-action", "gpu-reset")}
        text = await metrics_text(node)
        assert 'action="gpu-reset"' in text and "gpud_gpu_recovery_action{" in text
        # The GPU recovered without gpud (a reset by another tool): the driver says none, the XID goes.
        await node.daemon.session.call(lambda nvml: nvml.sim_set_recovery_action(0, 0))
        await health.check_once()
        gpu = gpu_of(await health_view(node), 0)
        assert gpu["state"] == "healthy" and gpu["driver_action"] == "none" and gpu["suggested_action"] == "none"
        transitions = [(e["device"], e["state"], e["driver_action"]) for e in watched(node, since) if "state" in e]
        assert transitions[-1] == (gpu["uuid"], "healthy", "none")
        out = await asyncio.to_thread(cli, "health", socket=node.daemon.config.socket_path)
        assert out.returncode == 0 and "ACTION (DRIVER)" in out.stdout and "none (none)" in out.stdout
    finally:
        await stop_daemon(node)


async def _has_reason(node, index: int, kind: str) -> bool:
    return any(r["kind"] == kind for r in gpu_of(await health_view(node), index)["reasons"])


async def test_a_branch_without_the_field_keeps_todays_behaviour(short_tmp):
    node = await start_daemon(node_config(short_tmp, "A100-SXM4-80GB:1", driver=DRIVER_WITHOUT_ACTION))
    try:
        await node.daemon.session.call(lambda nvml: nvml.sim_inject_xid(0, 48))
        await until_async(lambda: _has_reason(node, 0, "xid"), what="the XID's reason")
        await node.daemon.health.check_once()
        gpu = gpu_of(await health_view(node), 0)
        assert gpu["driver_action"] is None and [r["kind"] for r in gpu["reasons"]] == ["xid"]
        assert "gpud_gpu_recovery_action{" not in await metrics_text(node)
    finally:
        await stop_daemon(node)


async def test_an_xid_nvml_missed_comes_from_the_kernel_log_and_one_both_report_counts_once(short_tmp):
    node = await start_daemon(node_config(short_tmp, "A100-SXM4-80GB:2"))
    try:
        health = node.daemon.health
        await node.daemon.session.call(lambda nvml: nvml.sim_inject_xid(1, 31, nvml_event=False))
        await until_async(lambda: health.xids.by_source["kernel-log"] == 1, what="the kernel log's XID")
        uuid1 = gpu_of(await health_view(node), 1)["uuid"]
        assert health.xids.counts[(uuid1, 31)] == 1
        await node.daemon.session.call(lambda nvml: nvml.sim_inject_xid(0, 48))  # NVML and the kernel log
        await until_async(lambda: health.xids.by_source["both"] == 1, what="the second report of XID 48 matched")
        uuid0 = gpu_of(await health_view(node), 0)["uuid"]
        assert health.xids.counts[(uuid0, 48)] == 1 and health.xids.by_source["nvml"] == 0
        text = await metrics_text(node)
        assert 'gpud_xids_by_source_total{source="both"} 1' in text
    finally:
        await stop_daemon(node)


async def test_kernel_log_xids_are_not_counted_again_after_a_restart(short_tmp):
    config = node_config(short_tmp, "A100-SXM4-80GB:1")
    node = await start_daemon(config)
    try:
        await node.daemon.session.call(lambda nvml: nvml.sim_inject_xid(0, 31, nvml_event=False))
        await until_async(lambda: node.daemon.health.xids.by_source["kernel-log"] == 1, what="the XID")
    finally:
        await stop_daemon(node)
    driver = SimulatedNvml(config.simulate, config.sim_state_path, driver=config.sim_driver)
    driver.nvmlInit()  # while gpud is stopped, the driver logs an XID that no NVML client hears
    driver.sim_inject_xid(0, 13, nvml_event=False)
    driver.nvmlShutdown()
    node = await start_daemon(config)
    try:
        await until_async(lambda: node.daemon.health.xids.by_source["kernel-log"] == 1, what="the XID while stopped")
        await node.daemon.session.call(lambda nvml: nvml.sim_inject_xid(0, 43, nvml_event=False))
        await until_async(lambda: node.daemon.health.xids.by_source["kernel-log"] == 2, what="the new XID")
        counts = node.daemon.health.xids.counts
        assert sorted(xid for _, xid in counts) == [13, 31, 43] and set(counts.values()) == {1}
    finally:
        await stop_daemon(node)


async def test_fabric_not_trained_and_fabric_manager_down_on_an_nvswitch_node(short_tmp):
    node = await start_daemon(node_config(short_tmp, "hgx-h100"))
    try:
        health = node.daemon.health
        await health.check_once()
        await health.check_node_once()
        view = await health_view(node)
        assert view["status"] == "healthy" and all(gpu["state"] == "healthy" for gpu in view["gpus"])
        await node.daemon.session.call(lambda nvml: nvml.sim_set_fabric(3, health_mask=_degraded_bandwidth_mask()))
        await health.check_once()
        gpu = gpu_of(await health_view(node), 3)
        assert gpu["state"] == "degraded" and [r["code"] for r in gpu["reasons"]] == ["health"]
        assert "degraded bandwidth" in gpu["reasons"][0]["message"]
        assert "gpud_gpu_fabric_health_mask{" in await metrics_text(node)
        await node.daemon.session.call(lambda nvml: nvml.sim_set_fabric(3, state=1))  # not started
        await node.daemon.session.call(lambda nvml: nvml.sim_set_fabric_manager(False))
        health.node_checks._fabric_manager_checked = 0.0  # systemctl is asked every 30 s: now
        await health.check_once()
        await health.check_node_once()
        view = await health_view(node)
        assert gpu_of(view, 3)["state"] == "unhealthy"
        assert "not started" in next(r["message"] for r in gpu_of(view, 3)["reasons"] if r["code"] == "not-ready")
        assert view["node"]["state"] == "unhealthy"
        assert [r["kind"] for r in view["node"]["reasons"]] == ["fabric-manager"]
        assert "nvidia-fabricmanager.service is inactive/dead" in view["node"]["reasons"][0]["message"]
    finally:
        await stop_daemon(node)


def _degraded_bandwidth_mask() -> int:
    """The healthy mask with its degraded-bandwidth field TRUE (nvml.h NVML_GPU_FABRIC_HEALTH_MASK_*)."""
    shift = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW
    width = (1 << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW) - 1
    return (HEALTHY_MASK & ~(width << shift)) | (pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE << shift)


async def test_a_pcie_node_has_no_fabric_and_no_fabric_manager_to_run(short_tmp):
    node = await start_daemon(node_config(short_tmp, "A100-PCIE-80GB:2"))
    try:
        await node.daemon.session.call(lambda nvml: nvml.sim_set_fabric_manager(False))
        await node.daemon.health.check_once()
        await node.daemon.health.check_node_once()
        assert (await health_view(node))["status"] == "healthy"
    finally:
        await stop_daemon(node)


async def test_an_unfinished_driver_upgrade_is_one_node_reason_with_both_versions(short_tmp):
    node = await start_daemon(node_config(short_tmp, "A100-SXM4-80GB:1"))
    try:
        await node.daemon.session.call(lambda nvml: nvml.sim_set_kernel_module("570.86.15"))
        await node.daemon.health.check_node_once()
        view = await health_view(node)
        assert view["status"] == "unhealthy" and view["node"]["state"] == "unhealthy"
        message = view["node"]["reasons"][0]["message"]
        assert "570.86.15" in message and DRIVER_WITH_ACTION in message and "Reboot" in message
        assert 'gpud_driver_info{kernel_module="570.86.15",library="580.65.06"} 1' in await metrics_text(node)
    finally:
        await stop_daemon(node)


async def test_gpud_started_after_an_unfinished_upgrade_says_so_while_nvml_refuses(short_tmp):
    def mismatched(daemon):
        daemon.session.nvml.sim_set_kernel_module("570.86.15")

    node = await start_daemon(node_config(short_tmp, "A100-SXM4-80GB:1"), healthy=False, prepare=mismatched)
    try:
        await until_async(lambda: node.daemon.session.error is not None, what="NVML's refusal")
        await node.daemon.health.check_node_once()
        view = await health_view(node)
        assert view["gpus"] == [] and view["node"]["state"] == "unhealthy"
        assert "570.86.15" in view["node"]["reasons"][0]["message"]
        assert "unfinished driver upgrade" in node.daemon.session.error
    finally:
        await stop_daemon(node)


def ib_tree(tmp: Path) -> Path:
    sysfs = tmp / "sys"
    shutil.copytree(IB_FIXTURE, sysfs, symlinks=True)
    return sysfs


async def test_infiniband_ports_are_subjects_with_node_exporters_metrics(short_tmp):
    sysfs = ib_tree(short_tmp)
    config = node_config(short_tmp, "A100-SXM4-80GB:1")
    config = dataclasses.replace(config, host=HostConfig(sysfs=str(sysfs)))
    node = await start_daemon(config)
    try:
        health = node.daemon.health
        await health.check_node_once()
        view = await health_view(node)
        names = [subject["name"] for subject in view["subjects"]]
        assert names and all(name.startswith("ib:mlx5_") for name in names)
        assert all(subject["state"] == "healthy" for subject in view["subjects"])
        assert "node_infiniband_state_id{" in await metrics_text(node)
        port = sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
        (port / "state").write_text("1: DOWN\n")
        (port / "phys_state").write_text("2: Polling\n")
        # two passes at once (as a check_node_once beside the loop's own): they share one reading
        await asyncio.gather(health.check_node_once(), health.check_node_once())
        subject = next(s for s in (await health_view(node))["subjects"] if s["name"] == "ib:mlx5_0/1")
        assert subject["state"] == "unhealthy" and subject["reasons"][0]["code"] == "port-down"
        # The node is unhealthy for its port; NFD's GPU health label is the GPUs' (and the node's own)
        assert (await health_view(node))["status"] == "unhealthy"
        assert (await node.daemon._nfd_labels())["nvidia.com/gpu.health"] == "healthy"
        shutil.rmtree(sysfs / "class" / "infiniband")  # the HCAs went away (driver unloaded)
        await health.check_node_once()
        view = await health_view(node)
        assert view["subjects"] == [] and view["status"] == "healthy"
    finally:
        await stop_daemon(node)


def stand_in_dcgmi(tmp: Path, mode: str) -> Path:
    """The stand-in as an executable in its mode (gpud passes its own environment to dcgmi)."""
    path = tmp / "dcgmi"
    path.write_text(f"#!/bin/sh\nDCGMI_STAND_IN_MODE={mode} exec {sys.executable} {STAND_IN_DCGMI} \"$@\"\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("mode, outcome, state", [("pass", "pass", "healthy"), ("fail-memory", "fail", "unhealthy")])
async def test_gpud_check_runs_dcgms_diagnostic_and_folds_its_verdict(short_tmp, mode, outcome, state):
    dcgmi = stand_in_dcgmi(short_tmp, mode)
    node = await start_daemon(node_config(short_tmp, "A100-SXM4-80GB:2", dcgmi=str(dcgmi)))
    try:
        socket = node.daemon.config.socket_path
        done = await asyncio.to_thread(cli, "check", "--level", "2", "--json", socket=socket)
        run = json.loads(done.stdout)
        assert run["outcome"] == outcome and run["command"][1:4] == ["diag", "-r", "2"], run
        assert done.returncode == (0 if outcome == "pass" else 1)
        view = await health_view(node)
        failed = {test["gpu_index"] for test in run["tests"] if test["result"] == "fail"}
        assert bool(failed) == (state == "unhealthy")
        for gpu in view["gpus"]:
            assert gpu["state"] == (state if gpu["index"] in failed else "healthy")
            assert [r["kind"] for r in gpu["reasons"]] == (["diag"] if gpu["index"] in failed else [])
        last = await asyncio.to_thread(cli, "check", "--last", "--json", socket=socket)
        assert json.loads(last.stdout)["started_at"] == run["started_at"]
    finally:
        await stop_daemon(node)


async def test_gpud_check_refuses_busy_gpus_unless_forced_and_says_what_it_would_run_without_dcgm(short_tmp):
    node = await start_daemon(node_config(short_tmp, "A100-SXM4-80GB:2", dcgmi=str(short_tmp / "no-dcgmi")))
    try:
        socket = node.daemon.config.socket_path
        await node.daemon.session.call(lambda nvml: nvml.sim_set_processes(1, [4242]))
        refused = await asyncio.to_thread(cli, "check", socket=socket)
        assert refused.returncode == 1 and "GPU 1: PIDs 4242" in refused.stderr and "force" in refused.stderr
        assert "no check has run" in (await asyncio.to_thread(cli, "check", "--last", socket=socket)).stderr
        forced = await asyncio.to_thread(cli, "check", "--force", "--json", socket=socket)
        run = json.loads(forced.stdout)
        assert run["outcome"] == "unavailable" and "dcgmi diag -r 1" in run["error"]
    finally:
        await stop_daemon(node)


async def test_auto_reset_resets_a_gpu_the_driver_asks_for_within_the_hourly_limit(short_tmp):
    node = await start_daemon(node_config(short_tmp, "A100-SXM4-80GB:2", auto_reset=True, auto_reset_max_per_hour=1))
    try:
        health = node.daemon.health
        since = node.daemon.bus.sequence
        await node.daemon.session.call(lambda nvml: nvml.sim_inject_xid(0, 48))
        await health.check_once()
        await until_async(lambda: health.auto_reset.results.get("done") == 1, what="the automatic reset")
        await health.check_once()
        gpu = gpu_of(await health_view(node), 0)
        assert gpu["state"] == "healthy" and gpu["driver_action"] == "none"
        said = [e for e in watched(node, since) if e.get("cause") == "health.auto_reset"]
        assert [(e["gpu_index"], e["auto_reset"]) for e in said] == [(0, "done")]
        # Within the hour a second request is not acted on: said once, whatever the checks that follow.
        await node.daemon.session.call(lambda nvml: nvml.sim_inject_xid(1, 48))
        for _ in range(3):
            await health.check_once()
        assert health.auto_reset.results == {"done": 1, "rate-limited": 1}
        assert 'gpud_gpu_auto_resets_total{result="rate-limited"} 1' in await metrics_text(node)
    finally:
        await stop_daemon(node)


async def test_auto_reset_never_touches_a_gpu_with_processes(short_tmp):
    node = await start_daemon(node_config(short_tmp, "A100-SXM4-80GB:1", auto_reset=True))
    try:
        health = node.daemon.health
        await node.daemon.session.call(lambda nvml: nvml.sim_set_processes(0, [4343]))
        await node.daemon.session.call(lambda nvml: nvml.sim_inject_xid(0, 48))
        await health.check_once()
        await until_async(lambda: health.auto_reset.results.get("refused") == 1, what="the refusal")
        gpu = gpu_of(await health_view(node), 0)
        assert gpu["driver_action"] == "gpu-reset" and gpu["state"] == "unhealthy"
    finally:
        await stop_daemon(node)


def test_gpud_on_nvidias_mock_nvml_reads_a_gb200_fabric_degraded(short_tmp):
    """The second opinion: gpud's real NVML backend on NVIDIA's mock, its GB200 fabric with degraded
    bandwidth injected through the mock's own config."""
    need(MOCK_NVML_CONFIGS.is_dir(), f"NVIDIA's mock NVML is not in {MOCK_NVML_CONFIGS.parent}")
    config = yaml.safe_load((MOCK_NVML_CONFIGS / "mock-nvml-config-gb200.yaml").read_text())
    config["device_defaults"]["fabric"]["health"] = {"degraded_bandwidth": True}
    mock_config = short_tmp / "gb200.yaml"
    mock_config.write_text(yaml.safe_dump(config))
    (short_tmp / "proc").mkdir()
    (short_tmp / "gpud.yaml").write_text(f"host:\n  procfs: {short_tmp / 'proc'}\n  sysfs: {short_tmp / 'sys'}\n"
                                         f"  kmsg: {short_tmp / 'kmsg'}\n")
    gpud = GpudProcess(short_tmp, "--config", str(short_tmp / "gpud.yaml"),
                       env={"LD_LIBRARY_PATH": str(mock_nvml_library()), "MOCK_NVML_CONFIG": str(mock_config)})
    try:
        def all_degraded():
            view = gpud.client.get("/v1/health")
            return view if view["gpus"] and all(gpu["state"] == "degraded" for gpu in view["gpus"]) else None

        view = gpud.wait_for(all_degraded, what="every GPU degraded")
        assert {r["code"] for gpu in view["gpus"] for r in gpu["reasons"]} == {"health"}
        assert all(gpu["driver_action"] is None for gpu in view["gpus"])  # the mock has no field 230
    finally:
        gpud.stop()
