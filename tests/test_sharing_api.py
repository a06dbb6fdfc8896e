"""Shared resources served by gpud: /v1/sharing, live with MIG changes and reloads, MPS replicas, CLI."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from helpers import REPO, cli, put_layout, read_back, running_daemons, sharing_config, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi

TIME_SLICED_GPU = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: {replicas}
"""

MIXED = """version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/mig-1g.5gb
      replicas: 4
    - name: nvidia.com/mig-3g.20gb
      replicas: 2
      devices: ["0:0", "1:0"]
"""


async def test_a_time_sliced_rtx_2080ti(short_tmp):
    node = await start_daemon(sharing_config(short_tmp, "rtx-2080ti", TIME_SLICED_GPU.format(replicas=6)))
    try:
        status, view = await node.get("/v1/sharing")
        assert status == 200
        assert_matches_openapi("GET", "/v1/sharing", 200, view)
        _, gpu = await node.get("/v1/gpus/0")
        (resource,) = view["resources"]
        assert resource["name"] == "nvidia.com/gpu" and resource["strategy"] == "time-slicing"
        assert resource["count"] == 6 and resource["replicas"] == 6
        assert [d["id"] for d in resource["devices"]] == [f"{gpu['uuid']}::{n}" for n in range(6)]
        assert view["labels"]["nvidia.com/gpu.product"].endswith("-SHARED")
        assert view["labels"]["nvidia.com/gpu.replicas"] == "6"
    finally:
        await stop_daemon(node)


async def test_mixed_mig_resources_follow_a_mig_change(short_tmp):
    node = await start_daemon(sharing_config(short_tmp, "dgx-a100", MIXED))
    try:
        assert (await put_layout(node, "all-balanced"))[0] == 200
        _, view = await node.get("/v1/sharing")
        counts = {r["name"]: r["count"] for r in view["resources"]}
        # 8 GPUs × (2× 1g.5gb ×4 replicas); 3g.20gb shared only on GPUs 0 and 1 (×2), plain on the other 6
        assert counts["nvidia.com/mig-1g.5gb"] == 8 * 2 * 4
        assert counts["nvidia.com/mig-2g.10gb"] == 8
        assert counts["nvidia.com/mig-3g.20gb"] == 2 * 2 + 6
        assert (await put_layout(node, "all-1g.5gb"))[0] == 200  # no restart: resources follow
        _, view = await node.get("/v1/sharing")
        assert {r["name"]: r["count"] for r in view["resources"]} == {"nvidia.com/mig-1g.5gb": 8 * 7 * 4}
        assert view["labels"]["nvidia.com/mig-1g.5gb.count"] == "56"
    finally:
        await stop_daemon(node)


def test_invalid_sharing_file_stops_start_and_is_refused_on_reload(run_gpud, short_tmp):
    sharing = short_tmp / "sharing.yaml"
    sharing.write_text(TIME_SLICED_GPU.format(replicas=1))
    config = short_tmp / "gpud.yaml"
    config.write_text(f"sharing:\n  file: {sharing}\n")
    refused = subprocess.run([sys.executable, "-m", "gpud", "serve", "--simulate", "t4", "--config", str(config),
                              "--socket", str(short_tmp / "r.sock"), "--sim-state", str(short_tmp / "sim.json"),
                              "--state-dir", str(short_tmp / "state")],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
    assert refused.returncode == 2 and "replicas" in refused.stdout + refused.stderr

    sharing.write_text(TIME_SLICED_GPU.format(replicas=3))
    gpud = run_gpud("--simulate", "t4", "--sim-state", str(short_tmp / "sim.json"), "--config", str(config))
    gpud.wait_healthy()
    assert gpud.client.get("/v1/sharing")["resources"][0]["count"] == 3
    sharing.write_text(TIME_SLICED_GPU.format(replicas=5))
    gpud.proc.send_signal(signal.SIGHUP)
    gpud.wait_for(lambda: gpud.client.get("/v1/sharing")["resources"][0]["count"] == 5, what="reloaded sharing")
    sharing.write_text("version: v1\nsharing: [oops\n")
    gpud.proc.send_signal(signal.SIGHUP)
    gpud.wait_for(lambda: any(e.get("event") == "reload_refused" for e in gpud.log_events()), what="refusal")
    assert gpud.client.get("/v1/sharing")["resources"][0]["count"] == 5  # the running config stays

    table = cli("sharing", socket=gpud.socket)
    assert table.returncode == 0 and "nvidia.com/gpu" in table.stdout and "time-slicing" in table.stdout
    assert gpud.stop() == 0
    assert cli("sharing", "validate", str(sharing)).returncode == 2
    sharing.write_text(TIME_SLICED_GPU.format(replicas=2))
    assert cli("sharing", "validate", str(sharing)).returncode == 0


@pytest.mark.usefixtures("mps_tmp")
def test_mps_replicas_set_the_daemons_limits(run_gpud, short_tmp):
    sharing = short_tmp / "sharing.yaml"
    sharing.write_text("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n")
    config = short_tmp / "gpud.yaml"
    config.write_text(f"sharing:\n  file: {sharing}\nmps:\n  enabled: true\n  pipe_root: {short_tmp / 'mps'}\n"
                      f"  log_root: {short_tmp / 'mpslog'}\n")
    gpud = run_gpud("--simulate", "t4", "--sim-state", str(short_tmp / "sim.json"), "--config", str(config))
    gpud.wait_healthy()
    (daemon,) = running_daemons(gpud, 1)
    memory = gpud.client.get("/v1/gpus/0")["memory_total_mib"]
    assert daemon["active_thread_percentage"] == 25 and daemon["pinned_memory_limit_mib"] == [memory // 4]
    threads, pinned = read_back(daemon)
    assert threads == 25.0
    view = gpud.client.get("/v1/sharing")
    assert view["strategy"] == "mps" and view["labels"]["nvidia.com/mps.capable"] == "true"
    assert gpud.stop() == 0


def test_time_slice_interval_is_applied_with_nvidia_smi_or_reported(run_gpud, short_tmp):
    sharing = short_tmp / "sharing.yaml"
    sharing.write_text(TIME_SLICED_GPU.format(replicas=2).replace("  timeSlicing:\n", "  timeSlicing:\n    interval: long\n"))
    config = short_tmp / "gpud.yaml"
    config.write_text(f"sharing:\n  file: {sharing}\n")
    args = ("--simulate", "A100-SXM4-40GB:2", "--sim-state", str(short_tmp / "sim.json"), "--config", str(config))

    bare_path = "/usr/bin:/bin"  # no nvidia-smi on this machine: gpud says so
    gpud = run_gpud(*args, env={"PATH": bare_path})
    gpud.wait_healthy()
    view = gpud.wait_for(lambda: gpud.client.get("/v1/sharing")["time_slice"], what="a time-slice report")
    assert view == {"interval": "long", "applied": False, "reason": "nvidia-smi is not installed", "gpus": []}
    assert gpud.stop() == 0

    # A stand-in for nvidia-smi (none exists here) that records what gpud asks of it.
    bin_dir = short_tmp / "bin"
    bin_dir.mkdir()
    record = short_tmp / "smi.log"
    (bin_dir / "nvidia-smi").write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    gpud = run_gpud(*args, env={"PATH": f"{bin_dir}:{bare_path}"})
    gpud.wait_healthy()
    view = gpud.wait_for(lambda: gpud.client.get("/v1/sharing")["time_slice"], what="a time-slice report")
    assert view["applied"] is True and [g["index"] for g in view["gpus"]] == [0, 1]
    assert record.read_text().splitlines() == ["compute-policy -i 0 --set-timeslice 3",
                                               "compute-policy -i 1 --set-timeslice 3"]
    assert gpud.stop() == 0
