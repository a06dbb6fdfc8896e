"""Resource exhaustion: connection caps per peer and overall with room kept for admins and /healthz;
a full descriptor table never taken for a dead MPS daemon. And the MIG apply history, kept across
restarts in a bounded file."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import resource
import signal
import subprocess
import time
import pytest
from helpers import (ADMINS, READERS, mig_config, mig_settled, put_layout, running_daemons, sim_config,
                     start_daemon, stop_daemon, until_async)
from openapi_check import assert_matches_openapi

from gpud.api.connections import EXCESS_GRACE_S, FairTurns
from gpud.mig.history import HISTORY_KEPT
from gpud.mps.control import process_alive

SYSTEM_PYTHON = "/usr/bin/python3"  # the test users cannot reach the virtual environment's interpreter
# A local user's process: holds `hold` raw connections to gpud (sending nothing), then sends each
# of the routes on a connection of its own, and reports the answers and how many held ones gpud
# has not closed settle_s later. It keeps its connections until its stdin closes.
HOG = r"""
import json, socket, sys, time
path, hold, settle_s, routes = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
def connect():
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)
    return sock
held = [connect() for _ in range(hold)]
answers = []
for route in routes:
    sock, started = connect(), time.monotonic()
    sock.sendall(f"GET {route} HTTP/1.1\r\nHost: gpud\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    answers.append({"route": route, "status": int(head.split()[1]), "body": json.loads(body),
                    "retry_after": b"Retry-After" in head, "seconds": time.monotonic() - started})
time.sleep(settle_s)
still_open = 0
for sock in held:
    sock.setblocking(False)
    try:
        still_open += sock.recv(1) != b""
    except BlockingIOError:
        still_open += 1
print(json.dumps({"answers": answers, "still_open": still_open}), flush=True)
sys.stdin.read()
"""


class Hog:
    """HOG as a process of a local user that may read but not change the node (uid without an account)."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, socket_path, uid: int, hold: int, *routes: str, settle_s: float = 0.0) -> "Hog":
        proc = await asyncio.create_subprocess_exec(
            SYSTEM_PYTHON, "-c", HOG, str(socket_path), str(hold), str(settle_s), *routes, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, user=uid, group=grp.getgrnam(READERS).gr_gid, extra_groups=[])
        return cls(proc)

    async def report(self) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), 20)
        assert line, "the hog process died"
        return json.loads(line)

    async def stop(self) -> None:
        self.proc.stdin.close()
        await asyncio.wait_for(self.proc.wait(), 20)


@pytest.fixture
async def capped(short_tmp, users):
    """gpud with small caps: 8 connections in all, 3 per reader, 2 of the 8 kept for admins."""
    short_tmp.chmod(0o755)  # the test users reach the socket; its mode and group decide the rest
    config = sim_config(short_tmp, "A100-SXM4-40GB:1").with_overrides(**{
        "api.group": READERS, "api.admin_group": ADMINS, "api.max_connections": 8,
        "api.max_connections_per_peer": 3, "api.admin_reserved_connections": 2})
    running = await start_daemon(config)
    yield running
    await stop_daemon(running)


# Guards the per-peer cap: before it, one reader could hold every connection gpud would take
# (and every descriptor it had); now its excess gets a quick JSON 429 except for /healthz, the
# excess connections are closed, and an admin (root, this test) is answered throughout.
async def test_one_reader_holding_many_connections_gets_429_and_admins_and_healthz_are_answered(capped):
    hog = await Hog.start(capped.daemon.config.socket_path, 60001, 40, "/v1/gpus", "/healthz",
                         settle_s=EXCESS_GRACE_S + 0.5)
    try:
        report = await hog.report()
        refused, health = report["answers"]
        assert refused["status"] == 429 and refused["body"]["error"]["code"] == "too-many-connections"
        assert "uid 60001" in refused["body"]["error"]["message"] and refused["retry_after"]
        assert refused["seconds"] < EXCESS_GRACE_S  # refused when asked, not when its grace ran out
        assert health["status"] == 200 and health["body"]["status"] == "ok"
        assert report["still_open"] == 3  # its cap; gpud closed the other 37
        for _ in range(5):  # while the reader holds its 3
            assert (await capped.get("/v1/gpus"))[0] == 200
    finally:
        await hog.stop()


# Guards the overall cap and the admins' reserve: readers of different uids together fill what
# non-admins may use (8 - 2); the next reader gets 503 (and /healthz), an admin still gets answers.
async def test_readers_filling_gpud_get_503_while_admins_keep_their_reserve(capped):
    socket_path = capped.daemon.config.socket_path
    hogs = [await Hog.start(socket_path, 60011, 3), await Hog.start(socket_path, 60012, 3)]
    try:
        for hog in hogs:
            await hog.report()  # its 3 connections are made
        late = await Hog.start(socket_path, 60013, 0, "/v1/node", "/healthz")
        hogs.append(late)
        refused, health = (await late.report())["answers"]
        assert refused["status"] == 503 and refused["body"]["error"]["code"] == "too-many-connections"
        assert health["status"] == 200
        assert (await capped.get("/v1/node"))[0] == 200
    finally:
        for hog in hogs:
            await hog.stop()


# Guards the release of a peer's share: once its connections close, the same reader is served again.
async def test_a_reader_is_served_again_once_its_connections_close(capped):
    hog = await Hog.start(capped.daemon.config.socket_path, 60021, 3, "/v1/node")
    assert (await hog.report())["answers"][0]["status"] == 429
    await hog.stop()

    async def served() -> bool:  # once gpud has seen the hog's connections close
        again = await Hog.start(capped.daemon.config.socket_path, 60021, 0, "/v1/node")
        try:
            return (await again.report())["answers"][0]["status"] == 200
        finally:
            await again.stop()
    assert await until_async(served, timeout=10, what="uid 60021 served again")


# Guards MPS supervision against a full descriptor table: before, process_alive opened
# /proc/<pid>/stat, took EMFILE for "the daemon died", counted a restart and tried to start a
# second daemon on the pipe of the one still running. Now liveness comes from a pidfd and a check
# that cannot look is logged as inconclusive: the running daemon keeps its PID and no restart is counted.
def test_a_full_descriptor_table_is_not_taken_for_a_dead_mps_daemon(run_gpud, mps_tmp):
    config = mps_tmp / "gpud.yaml"
    config.write_text(f"mps:\n  enabled: true\n  pipe_root: {mps_tmp / 'mps'}\n  log_root: {mps_tmp / 'mpslog'}\n"
                      f"  check_interval_s: 0.1\nmig:\n  layouts_file: {mps_tmp / 'absent.yaml'}\n")
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:1", "--sim-state", str(mps_tmp / "sim.json"),
                    "--config", str(config))
    gpud.wait_healthy()
    [daemon] = running_daemons(gpud, 1)
    pid = gpud.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    in_use = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    lowest_free = min(set(range(len(in_use) + 1)) - in_use)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, hard))  # not one descriptor more
    gpud.wait_for(lambda: any(e.get("event") == "mps_check_inconclusive" for e in gpud.log_events()),
                  what="a check that ran out of descriptors")
    # fixed time: the shortage lasts over more checks than HEALTH_PROBE_EVERY, a full probe among them
    time.sleep(1.5)  # fixed time: (see above)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    [after] = gpud.client.get("/v1/mps")["daemons"]
    assert (after["pid"], after["state"], after["restarts"]) == (daemon["pid"], "running", 0)
    assert process_alive(daemon["pid"])
    events = [event.get("event") for event in gpud.log_events()]
    assert "mps_check_inconclusive" in events  # the checks did run out of descriptors
    assert "mps_daemon_died" not in events and "mps_daemon_failed" not in events

    os.kill(daemon["pid"], signal.SIGKILL)  # supervision outlived the shortage: a real death is seen
    [restarted] = gpud.wait_for(lambda: [d for d in gpud.client.get("/v1/mps")["daemons"]
                                         if d["state"] == "running" and d["pid"] != daemon["pid"]],
                                what="the killed MPS daemon restarted")
    assert restarted["restarts"] == 1


# Guards process_alive itself: a zombie (exited, not yet reaped) is dead, a reaped PID is dead, a
# running process (of another user too: PID 1) is alive; none of it read from /proc.
def test_process_alive_sees_running_exited_and_reaped_processes():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_alive(child.pid) and process_alive(1)
        child.kill()
        for _ in range(100):  # until the kernel has it as a zombie
            if not process_alive(child.pid):
                break
            time.sleep(0.01)
        assert not process_alive(child.pid) and child.poll() == -9
        assert not process_alive(child.pid)  # reaped
    finally:
        child.kill()
        child.wait(10)


# Guards the MIG apply history across restarts: it used to live in memory only (the last status),
# so after a restart nothing said which layouts had been applied and how they ended.
async def test_the_mig_apply_history_survives_a_restart_newest_first_and_bounded(short_tmp):
    config = mig_config(short_tmp, "A100-SXM4-40GB:1")
    older = [{"layout": f"old-{n}", "state": "success", "error": None, "started_at": float(n),
              "finished_at": float(n), "gpus": []} for n in range(HISTORY_KEPT)]
    (short_tmp / "state").mkdir()
    (short_tmp / "state" / "mig-history.json").write_text(json.dumps(older))
    node = await start_daemon(config)
    try:
        await mig_settled(node)
        assert (await put_layout(node, "all-1g.5gb"))[0] == 200
        assert (await put_layout(node, "all-balanced"))[0] == 200
    finally:
        await stop_daemon(node)
    node = await start_daemon(config)
    try:
        mig = await mig_settled(node)
        assert_matches_openapi("GET", "/v1/mig", 200, mig)
        history = mig["history"]
        assert len(history) == HISTORY_KEPT  # bounded: the two oldest went
        assert [entry["layout"] for entry in history[:3]] == ["all-balanced", "all-1g.5gb", "old-0"]
        newest = history[0]
        assert newest["state"] == "success" and newest["error"] is None
        assert newest["finished_at"] >= newest["started_at"] > history[1]["started_at"]
        assert [gpu["state"] for gpu in newest["gpus"]] == ["done"]
    finally:
        await stop_daemon(node)


# Guards a corrupt history file: said in /healthz and kept aside for the operator, never read as empty
# in silence, and applies still run and are recorded.
@pytest.mark.parametrize("content", ["{not json", '{"layout": "a dict, not a list"}', '[{"layout": "no state"}]'])
async def test_a_corrupt_mig_history_is_loud_and_kept_aside(short_tmp, content):
    (short_tmp / "state").mkdir()
    history_file = short_tmp / "state" / "mig-history.json"
    history_file.write_text(content)
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1"))
    try:
        _, health = await node.get("/healthz")
        assert health["status"] == "degraded" and "mig-history.json" in health["reason"]
        assert (short_tmp / "state" / "mig-history.json.corrupt").read_text() == content
        assert (await put_layout(node, "all-1g.5gb"))[0] == 200
        assert [entry["layout"] for entry in (await node.get("/v1/mig"))[1]["history"]] == ["all-1g.5gb"]
        assert json.loads(history_file.read_text())[0]["layout"] == "all-1g.5gb"
    finally:
        await stop_daemon(node)


# Guards fair turns (issue 20 item 4): a read handler that never awaits ends within one step, so
# without care a reader's 64 requests, woken together, all ran in one turn of the event loop and
# root's /healthz waited for every one of them (p50 18 ms under a /v1/health flood, bench/read_flood.py).
# Each peer now gets at most one request per turn of the loop, and another peer's run beside it.
async def test_a_flooding_peer_gets_one_request_per_turn_of_the_loop_and_others_run_beside_it():
    loop, turns, ran = asyncio.get_running_loop(), FairTurns(), []
    iteration = [0]

    def tick() -> None:  # counts the turns of the loop
        iteration[0] += 1
        loop.call_soon(tick)
    loop.call_soon(tick)

    async def handle(request):  # a read route's handler: no await
        ran.append((request, iteration[0]))
        return request

    flood = [turns.take("reader", handle, ("reader", n)) for n in range(64)]
    other = [turns.take("admin-or-other", handle, ("other", n)) for n in range(4)]
    assert len(await asyncio.wait_for(asyncio.gather(*flood, *other), 10)) == 68
    reader_turns = [at for (peer, _), at in ran if peer == "reader"]
    assert len(set(reader_turns)) == 64, "two of one peer's requests ran in one turn of the loop"
    first_reader, last_reader = reader_turns[0], reader_turns[-1]
    assert all(first_reader <= at < last_reader for (peer, _), at in ran if peer == "other")  # served beside it
