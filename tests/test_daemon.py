"""gpud as operators run it: a real process, its CLI, its socket, restarts."""

from __future__ import annotations

import json
import signal

from helpers import cli

from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim.scenarios import fill_with_gpu_instances


def test_cli_tables_and_json(run_gpud, short_tmp):
    gpud = run_gpud("--simulate", "dgx-a100", "--sim-state", str(short_tmp / "sim.json"))
    gpud.wait_healthy()

    table = cli("gpus", socket=gpud.socket)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["IDX", "NAME", "UUID"]
    assert sum("NVIDIA A100-SXM4-40GB" in line for line in lines) == 8

    as_json = cli("gpus", "--json", socket=gpud.socket)
    assert [g["name"] for g in json.loads(as_json.stdout)["gpus"]] == ["NVIDIA A100-SXM4-40GB"] * 8

    status = cli("status", socket=gpud.socket)
    assert status.returncode == 0 and "health:  ok" in status.stdout and "GPUs:    8" in status.stdout
    assert json.loads(cli("status", "--json", socket=gpud.socket).stdout)["node"]["gpu_count"] == 8
    assert gpud.stop() == 0


def test_cli_says_when_the_daemon_is_not_running(short_tmp):
    for command in ("status", "gpus"):
        result = cli(command, socket=short_tmp / "absent.sock")
        assert result.returncode == 3  # the documented exit code of an unreachable daemon
        assert "gpud is not running" in result.stderr and "absent.sock" in result.stderr


def test_restart_keeps_the_simulated_gpu_state(run_gpud, short_tmp):
    sim_state = short_tmp / "sim.json"
    sim = SimulatedNvml("hgx-h100", sim_state)
    sim.nvmlInit()
    fill_with_gpu_instances(sim, sim.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    sim.nvmlShutdown()
    args = ("--simulate", "hgx-h100", "--sim-state", str(sim_state))

    first = run_gpud(*args)
    first.wait_healthy()
    before = first.client.get("/v1/gpus")["gpus"]
    assert all(len(g["mig"]["devices"]) == 2 for g in before)  # two 3g.40gb per H100
    first.client.request("POST", "/v1/sim/gpu-lost", {"gpu": 6, "how": "is-lost"})
    assert first.stop() == 0
    assert not first.socket.exists()

    second = run_gpud(*args)
    second.wait_healthy()
    after = second.client.get("/v1/gpus")["gpus"]
    mig_uuids = lambda gpus: [[d["uuid"] for d in g["mig"]["devices"]] for g in gpus]  # noqa: E731
    assert mig_uuids(after)[:6] == mig_uuids(before)[:6]
    assert after[6]["lost"] is True and "GPU is lost" in after[6]["error"]
    # NVML gives no handle for a lost GPU: gpud names it from what it persisted before
    assert [g["uuid"] for g in after] == [g["uuid"] for g in before]
    assert after[6]["pci_bus_id"] == before[6]["pci_bus_id"] and after[6]["name"] == before[6]["name"]
    assert second.stop() == 0


def test_a_second_gpud_refuses_the_socket(run_gpud, short_tmp):
    args = ("--simulate", "t4", "--sim-state", str(short_tmp / "sim.json"))
    first = run_gpud(*args)
    first.wait_healthy()
    second = run_gpud(*args)
    assert second.proc.wait(20) == 1
    refused = [e for e in second.log_events() if e.get("event") == "socket_unavailable"]
    assert refused and "another gpud" in refused[0]["error"]
    assert first.client.get("/v1/gpus")["gpus"][0]["name"] == "Tesla T4"
    assert first.stop() == 0


def test_a_stale_socket_from_a_killed_gpud_is_replaced(run_gpud, short_tmp):
    args = ("--simulate", "t4", "--sim-state", str(short_tmp / "sim.json"))
    first = run_gpud(*args)
    first.wait_healthy()
    first.stop(signal.SIGKILL)
    assert first.socket.exists()
    second = run_gpud(*args)
    second.wait_healthy()
    assert any(e.get("event") == "stale_socket_removed" for e in second.log_events())
    assert second.stop() == 0


def test_logs_are_json_lines_saying_what_happened(run_gpud, short_tmp):
    gpud = run_gpud("--simulate", "a30", "--sim-state", str(short_tmp / "sim.json"))
    gpud.wait_healthy()
    gpud.stop()
    events = gpud.log_events()
    lines = [line for line in gpud.log_text().splitlines() if line.strip()]
    assert len(events) == len(lines), "every log line is one JSON object"
    by_name = {e["event"]: e for e in events}
    assert by_name["listening"]["socket"] == str(gpud.socket) and by_name["listening"]["backend"] == "simulated"
    assert by_name["inventory_changed"]["gpus"] == 4
    assert {"nvml_ready", "stopping", "stopped"} <= set(by_name)
    assert all("timestamp" in e and "level" in e for e in events)
