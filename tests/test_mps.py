"""gpud running NVIDIA's real MPS control daemon (Debian's nvidia-cuda-mps) on a simulated node."""

from __future__ import annotations

import os
import pwd
import signal
import time
from pathlib import Path

import pytest
from helpers import cli, read_back, running_daemons
from openapi_check import assert_matches_openapi

from gpud.mps.control import process_alive


def write_config(tmp: Path, **mps) -> Path:
    lines = ["mps:", "  enabled: true", f"  pipe_root: {tmp / 'mps'}", f"  log_root: {tmp / 'mpslog'}",
             "  check_interval_s: 0.2"]
    lines += [f"  {key}: {value}" for key, value in mps.items()]
    lines += ["mig:", f"  layouts_file: {tmp / 'absent.yaml'}"]
    path = tmp / "gpud.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start(run_gpud, tmp: Path, preset="A100-SXM4-40GB:2", **mps):
    gpud = run_gpud("--simulate", preset, "--sim-state", str(tmp / "sim.json"),
                    "--config", str(write_config(tmp, **mps)))
    gpud.wait_healthy()
    return gpud


def test_limits_read_back_from_the_real_daemon_equal_the_config(run_gpud, mps_tmp):
    gpud = start(run_gpud, mps_tmp, active_thread_percentage=40, pinned_memory_limit_mib=2048)
    daemons = running_daemons(gpud, 2)
    view = gpud.client.get("/v1/mps")
    assert_matches_openapi("GET", "/v1/mps", 200, view)
    gpus = gpud.client.get("/v1/gpus")["gpus"]
    assert [d["devices"] for d in daemons] == [[g["uuid"]] for g in gpus]
    for daemon in daemons:
        threads, pinned = read_back(daemon)
        assert threads == 40.0 and pinned == {0: "2G"}
        assert process_alive(daemon["pid"])
        assert Path(daemon["pipe_directory"], "control").exists()
    assert {g["compute_mode"] for g in gpus} == {"exclusive_process"}  # set through NVML
    assert gpud.stop() == 0


def test_restart_and_sighup_keep_the_daemon_and_limits_change_live(run_gpud, mps_tmp):
    first = start(run_gpud, mps_tmp, active_thread_percentage=40)
    pids = [d["pid"] for d in running_daemons(first, 2)]
    assert first.stop() == 0
    assert all(process_alive(pid) for pid in pids)  # gpud stopped; MPS did not

    second = start(run_gpud, mps_tmp, active_thread_percentage=40)
    adopted = running_daemons(second, 2)
    assert [d["pid"] for d in adopted] == pids and all(d["restarts"] == 0 for d in adopted)
    assert any(e.get("event") == "mps_daemon_adopted" for e in second.log_events())

    write_config(mps_tmp, active_thread_percentage=25)
    second.proc.send_signal(signal.SIGHUP)
    second.wait_for(lambda: all(d["active_thread_percentage"] == 25 for d in second.client.get("/v1/mps")["daemons"]),
                    what="limits reloaded")
    after = second.client.get("/v1/mps")["daemons"]
    assert [d["pid"] for d in after] == pids
    assert all(read_back(d)[0] == 25.0 for d in after)  # live in the running daemon, no restart
    assert second.stop() == 0


def test_a_killed_daemon_is_restarted_within_5_seconds(run_gpud, mps_tmp):
    gpud = start(run_gpud, mps_tmp, preset="t4", active_thread_percentage=30)
    (daemon,) = running_daemons(gpud, 1)
    os.kill(daemon["pid"], signal.SIGKILL)
    killed_at = time.monotonic()

    def restarted():
        (now,) = gpud.client.get("/v1/mps")["daemons"]
        return now if now["state"] == "running" and now["pid"] != daemon["pid"] else None

    now = gpud.wait_for(restarted, 5.0, "a restarted MPS daemon")
    assert time.monotonic() - killed_at < 5.0
    assert now["restarts"] == 1 and read_back(now)[0] == 30.0
    assert any(e.get("event") == "mps_daemon_died" for e in gpud.log_events())
    assert gpud.stop() == 0


def test_a_missing_binary_is_a_clear_error_and_the_rest_works(run_gpud, mps_tmp):
    gpud = start(run_gpud, mps_tmp, preset="t4", control_binary="/nonexistent/nvidia-cuda-mps-control")
    view = gpud.wait_for(lambda: (lambda v: v if v["error"] else None)(gpud.client.get("/v1/mps")),
                         what="an MPS error")
    assert "/nonexistent/nvidia-cuda-mps-control" in view["error"] and "not installed" in view["error"]
    assert view["daemons"][0]["state"] == "failed"
    assert gpud.client.get("/v1/gpus")["gpus"][0]["name"] == "Tesla T4"
    assert any(e.get("event") == "mps_daemon_failed" and "not installed" in e["error"] for e in gpud.log_events())
    assert gpud.stop() == 0


def test_client_env_and_explicit_control(run_gpud, mps_tmp):
    gpud = start(run_gpud, mps_tmp, preset="t4", pinned_memory_limit_percent=50)
    (daemon,) = running_daemons(gpud, 1)
    env = gpud.client.get("/v1/mps/gpu0/client-env?memory_mib=1024&threads_percent=20")
    assert_matches_openapi("GET", "/v1/mps/{name}/client-env", 200, env)
    assert env["env"] == {"CUDA_MPS_PIPE_DIRECTORY": daemon["pipe_directory"],
                          "CUDA_VISIBLE_DEVICES": daemon["devices"][0],
                          "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "20"}
    default = gpud.client.get("/v1/mps/gpu0/client-env")["env"]
    assert default["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={daemon['device_memory_mib'][0] // 2}M"
    for query, status in (("memory_mib=999999", 422), ("threads_percent=150", 422), ("memory_mib=lots", 400)):
        code, body = gpud.client.request("GET", f"/v1/mps/gpu0/client-env?{query}", ok_statuses=(status,))
        assert code == status, query
    assert gpud.client.request("GET", "/v1/mps/gpu9/client-env", ok_statuses=(404,))[0] == 404

    stopped = gpud.client.request("POST", "/v1/mps/gpu0/stop", {})[1]
    assert stopped["state"] == "stopped" and not process_alive(daemon["pid"])
    assert gpud.client.get("/v1/gpus/0")["compute_mode"] == "default"
    # fixed time: nothing must happen over three supervision intervals: a daemon stopped on purpose is left alone
    time.sleep(0.6)  # fixed time: (see above)
    assert gpud.client.get("/v1/mps")["daemons"][0]["state"] == "stopped"
    started = gpud.client.request("POST", "/v1/mps/gpu0/start", {})[1]
    assert started["state"] == "running"
    restarted = cli("mps", "restart", "gpu0", socket=gpud.socket)
    assert restarted.returncode == 0 and "gpu0: running" in restarted.stdout
    status = cli("mps", "status", socket=gpud.socket)
    assert status.returncode == 0 and "gpu0" in status.stdout and "running" in status.stdout
    assert gpud.stop() == 0


def test_one_daemon_per_mig_device_and_mps_follows_a_mig_change(run_gpud, mps_tmp):
    gpud = start(run_gpud, mps_tmp, preset="A100-SXM4-40GB:1")
    gpud.client.request("PUT", "/v1/mig?wait=true", {"layout": "all-3g.20gb"})
    daemons = running_daemons(gpud, 2)
    devices = gpud.client.get("/v1/gpus/0")["mig"]["devices"]
    assert sorted(d["devices"][0] for d in daemons) == sorted(d["uuid"] for d in devices)
    old_pids = [d["pid"] for d in daemons]

    gpud.client.request("PUT", "/v1/mig?wait=true", {"layout": "all-balanced"})
    daemons = running_daemons(gpud, 4)
    assert not any(process_alive(pid) for pid in old_pids)  # stopped before the change
    devices = gpud.client.get("/v1/gpus/0")["mig"]["devices"]
    assert sorted(d["devices"][0] for d in daemons) == sorted(d["uuid"] for d in devices)
    events = [e["event"] for e in gpud.log_events()]
    assert events.index("mps_daemon_stopped") < events.index("mig_gpu_applied")
    assert gpud.stop() == 0


def test_a_daemon_for_mps_user_runs_with_that_users_groups_only(run_gpud, mps_tmp):
    """mps.user: the control daemon (and so its servers) get the user's uid, primary gid and no
    supplementary group, not root's gid 0 and groups, which setting the uid alone would leave."""
    if os.geteuid() != 0:
        pytest.skip("only root can run the daemon as another user")
    nobody = pwd.getpwnam("nobody")
    mps_tmp.chmod(0o755)  # the daemon, as nobody, reaches its pipe and log directories through it
    gpud = start(run_gpud, mps_tmp, preset="A100-SXM4-40GB:1", user="nobody")
    (daemon,) = running_daemons(gpud, 1)
    status = dict(line.split(":", 1) for line in Path(f"/proc/{daemon['pid']}/status").read_text().splitlines())
    assert status["Uid"].split()[:2] == [str(nobody.pw_uid)] * 2
    assert status["Gid"].split()[:2] == [str(nobody.pw_gid)] * 2
    assert status["Groups"].split() == []
    assert gpud.stop() == 0
