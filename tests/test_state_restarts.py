"""What gpud knows survives a restart (issue 12): health, the watch stream's numbering, MPS restart
counts; a persisted file that cannot be read back is set aside loudly; absurd ?since= values are a 400."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from helpers import REPO, GpudProcess, Lines, mig_config, running_daemons, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi

from gpud.health.persistence import SAVE_DELAY_S


def first_events(gpud: GpudProcess, query: str, count: int) -> list[dict]:
    """The first `count` lines of a watch stream (heartbeats aside): the backlog comes at once."""
    events = []
    for event in gpud.client.stream(f"/v1/watch?{query}"):
        if event["type"] != "heartbeat":
            events.append(event)
        if len(events) == count:
            return events
    raise AssertionError(f"the stream ended after {events}")


def health_of(gpud: GpudProcess, index: int) -> dict:
    return gpud.client.get(f"/v1/gpus/{index}/health")


# Guards item 1: before, health lived only in memory (a GPU unhealthy before a crash came back
# healthy) and every run numbered its events from 1, so a watcher's ?since= from the previous run
# silently skipped the new run's first events.
def test_health_and_the_watch_stream_survive_a_crash(short_tmp):
    args = ("--simulate", "A100-SXM4-40GB:2", "--sim-state", str(short_tmp / "sim.json"))
    first = GpudProcess(short_tmp, *args)
    try:
        first.wait_healthy()
        for xid in (79, 79, 48):
            first.client.request("POST", "/v1/sim/xid", {"gpu": 1, "xid": xid})
        first.client.request("POST", "/v1/sim/xid", {"gpu": 0, "xid": 79})
        first.wait_for(lambda: health_of(first, 0)["state"] == "unhealthy", what="GPU 0 unhealthy")
        first.client.request("POST", "/v1/health/0/clear", {})  # what a clear clears stays cleared

        def counted():
            health = health_of(first, 1)
            return health if {r["code"]: r["count"] for r in health["reasons"]} == {"79": 2, "48": 1} else None
        before = first.wait_for(counted, what="XID counts of GPU 1")
        # GPU 1 with XID 79, then 48; GPU 0 with XID 79, then cleared
        last = first_events(first, "since=0&types=health", 4)[-1]
        assert last["data"]["cause"] == "cleared by an administrator"
        epoch = last["epoch"]

        def saved() -> bool:  # the crash comes once the health file holds what gpud serves
            try:
                (reasons,) = json.loads((short_tmp / "state" / "health.json").read_text())["reasons"].values()
            except (OSError, ValueError):  # not written yet, or more than GPU 1's reasons
                return False
            return {r["code"]: r["count"] for r in reasons} == {"79": 2, "48": 1}
        first.wait_for(saved, timeout=SAVE_DELAY_S + 10, what="the health state saved")
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
    finally:
        first.stop()

    second = GpudProcess(short_tmp, *args)
    try:
        second.wait_healthy()
        after = health_of(second, 1)
        assert after["state"] == "unhealthy" and after["reasons"] == before["reasons"]  # counts, first_seen and all
        assert health_of(second, 0)["state"] == "healthy"
        metrics = second.client.request_text("GET", "/metrics")[1].splitlines()
        (xid_79,) = [line for line in metrics if line.startswith("gpud_xid_errors_total{") and 'gpu="1"' in line
                     and 'xid="79"' in line]
        assert float(xid_79.rsplit(" ", 1)[1]) == 2

        # A watcher of the first run, with or without its epoch, is told the stream was reset and then
        # gets every event of the new run: the restored GPU 1 among them.
        for query in (f"since={last['seq']}&epoch={epoch}", f"since={last['seq']}"):
            gap, *rest = first_events(second, query + "&types=health", 2)
            assert gap["type"] == "gap" and gap["data"]["reason"] == "reset" and gap["epoch"] != epoch
            assert rest[0]["type"] == "health" and rest[0]["seq"] > last["seq"]

        # gpud watch says which run it follows and passes the epoch on.
        watcher = subprocess.Popen([sys.executable, "-m", "gpud", "watch", "--since", str(last["seq"]), "--epoch",
                                    epoch, "--json", "--socket", str(second.socket)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert json.loads(Lines(watcher.stdout, "gpud watch").next("gap"))["data"]["reason"] == "reset"
            run = Lines(watcher.stderr, "gpud watch's stderr").next("run line")
            assert run.startswith(f"gpud run {gap['epoch']}: resume with --since")
        finally:
            watcher.kill()
            watcher.wait(10)
    finally:
        second.stop()


@pytest.fixture
async def node(short_tmp):
    running = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    yield running
    await stop_daemon(running)


# Guards item 8: `since` went to int() after str.isdigit(), which lets through digits int() refuses
# ("²": a 500) or takes ("١٢"), numbers too long to convert (a 500) and numbers no client can hold
# (a stream that silently never sends anything).
@pytest.mark.parametrize("since", ["-1", "+1", " 1", "1.0", "1e3", "0x10", "abc", "²", "١٢", "9" * 20,
                                   str(1 << 63), "9" * 5000])
async def test_absurd_since_values_are_a_json_400(node, since):
    status, body = await node.get(f"/v1/watch?since={since}")
    assert status == 400 and body["error"]["code"] == "invalid-query"
    assert_matches_openapi("GET", "/v1/watch", 400, body)


async def test_a_since_beyond_this_runs_last_event_is_a_400(node):
    bus = node.daemon.bus
    status, body = await node.get(f"/v1/watch?since={bus.sequence + 1}&epoch={bus.epoch}")
    assert status == 400 and "after this run's last event" in body["error"]["message"]


# Guards item 4 for the files gpud keeps besides the MIG layout: before, a corrupt nvlinks file was
# a warning and the others did not exist. Now each is set aside as <name>.corrupt, logged and
# reported in /healthz, and gpud starts without it.
@pytest.mark.parametrize("name, owner", [("health.json", "health"), ("nvlinks-seen-up.json", "health"),
                                         ("watch-sequence.json", "bus"), ("mps-restarts.json", "mps")])
@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]", b'{"reasons": {"GPU-x": [{"kind": 1}]}}'])
async def test_a_corrupt_state_file_is_set_aside_and_reported(short_tmp, name, owner, content):
    state = short_tmp / "state"
    state.mkdir()
    (state / name).write_bytes(content)
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        (corrupt,) = getattr(node.daemon, owner).corrupt_files
        assert corrupt.path == state / name and (state / f"{name}.corrupt").read_bytes() == content
        assert f"{state / name} is corrupt" in corrupt.message()
        status, healthz = await node.get("/healthz")
        assert status == 200 and healthz["status"] == "degraded" and healthz["problems"] == [corrupt.message()]
        assert_matches_openapi("GET", "/healthz", 200, healthz)
        assert (await node.get("/v1/health"))[1]["status"] == "healthy"  # started empty
    finally:
        await stop_daemon(node)


# Guards item 1 for MPS: restart counts lived in memory, so a daemon that kept dying showed 0
# restarts after every gpud restart.
def test_mps_restart_counts_survive_a_gpud_restart(run_gpud, mps_tmp):
    config = mps_tmp / "gpud.yaml"
    config.write_text(f"mps:\n  enabled: true\n  pipe_root: {mps_tmp / 'mps'}\n  log_root: {mps_tmp / 'mpslog'}\n"
                      f"  check_interval_s: 0.2\nmig:\n  layouts_file: {mps_tmp / 'absent.yaml'}\n")
    args = ("--simulate", "t4", "--sim-state", str(mps_tmp / "sim.json"), "--config", str(config))
    first = run_gpud(*args)
    first.wait_healthy()
    (daemon,) = running_daemons(first, 1)
    first.client.request("POST", f"/v1/mps/{daemon['name']}/restart")
    assert first.client.get("/v1/mps")["daemons"][0]["restarts"] == 1
    assert first.stop() == 0

    second = run_gpud(*args)
    second.wait_healthy()
    (adopted,) = running_daemons(second, 1)
    assert adopted["restarts"] == 1
    assert second.stop() == 0
