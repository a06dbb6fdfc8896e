"""MIG hardening (issue 12): one apply at a time, refused hooks not resumed, busy whole GPUs, mode
changes rolled back, a corrupt desired-state file said loudly, a full disk refused cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest
from helpers import IN_CI, mig_config, mig_settled, put_layout, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi

from gpud.config import MigHooksConfig


async def test_concurrent_applies_one_is_accepted_the_others_are_told_which_runs(short_tmp):
    # Guards the atomic decision: the old check ("is the apply lock held?") ran before the awaits
    # of planning, so several PUTs sent together were all accepted, and a waiting answer could
    # describe another request's layout.
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        layouts = ["all-1g.5gb", "all-2g.10gb", "all-3g.20gb", "all-balanced"]
        answers = await asyncio.gather(*(put_layout(node, name) for name in layouts))
        accepted = [(name, body) for name, (status, body) in zip(layouts, answers) if status == 200]
        refused = [body for status, body in answers if status == 409]
        assert len(accepted) == 1 and len(refused) == 3, answers
        winner, body = accepted[0]
        assert body["layout"] == winner and body["state"] == "success"  # its own layout, no other
        for refusal in refused:
            assert refusal["error"]["code"] == "apply-in-progress"
            assert refusal["error"]["running"]["layout"] == winner and winner in refusal["error"]["message"]
            assert_matches_openapi("PUT", "/v1/mig", 409, refusal)
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] == winner and mig["in_sync"]
    finally:
        await stop_daemon(node)


async def test_a_put_while_an_apply_runs_is_refused_naming_it(short_tmp):
    gate = short_tmp / "gate"
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2", hooks=MigHooksConfig(
        pre_apply=(f"while [ ! -e {gate} ]; do sleep 0.02; done",))))
    try:
        async with node.http.put("http://localhost/v1/mig", json={"layout": "all-1g.5gb"}) as response:
            assert response.status == 202
        status, body = await put_layout(node, "all-balanced")
        assert status == 409 and body["error"]["running"]["layout"] == "all-1g.5gb"
        status, body = await node.post("/v1/gpus/0/reset", {})
        assert status == 409 and body["error"]["code"] == "apply-in-progress"
        gate.touch()
        mig = await mig_settled(node)
        assert mig["layout"] == "all-1g.5gb" and mig["state"] == "success"
        assert (await put_layout(node, "all-balanced"))[0] == 200  # done: the next one is accepted
    finally:
        await stop_daemon(node)


async def test_a_layout_its_pre_apply_hook_refused_is_not_resumed_at_the_next_start(short_tmp):
    # Guards "cancelled for good": the refused layout used to stay in mig-desired.json, and the
    # next start applied it.
    refuse = short_tmp / "refuse"
    desired_file = short_tmp / "state" / "mig-desired.json"
    config = mig_config(short_tmp, "A100-SXM4-40GB:2", hooks=MigHooksConfig(pre_apply=(f"test ! -e {refuse}",)))
    refuse.touch()
    node = await start_daemon(config)
    try:
        status, body = await put_layout(node, "all-balanced")
        assert status == 409 and "pre_apply" in body["error"]["message"]
        assert not desired_file.exists()  # nothing was desired before it: nothing is now
        refuse.unlink()
        assert (await put_layout(node, "all-1g.5gb"))[0] == 200
        refuse.touch()
        status, body = await put_layout(node, "all-balanced")
        assert status == 409 and "cancelled" in body["error"]["message"]
        assert json.loads(desired_file.read_text())["layout"] == "all-1g.5gb"
    finally:
        await stop_daemon(node)
    refuse.unlink()  # the hook would pass now: only a resumed apply could change the GPUs
    node = await start_daemon(config)
    try:
        mig = await mig_settled(node)
        assert mig["layout"] == "all-1g.5gb" and mig["in_sync"] and mig["state"] == "success"
        assert all(g["actual"]["devices"] == {"1g.5gb": 7} for g in mig["gpus"])
    finally:
        await stop_daemon(node)


async def test_a_mode_change_of_a_busy_whole_gpu_is_refused_unless_forced(short_tmp):
    # Guards item 3: on a Hopper GPU out of MIG mode, processes used to make the apply fail midway
    # (SetMigMode IN_USE) instead of being refused before any change.
    node = await start_daemon(mig_config(short_tmp, "H100-SXM5-80GB:2"))
    try:
        assert (await node.post("/v1/sim/processes", {"gpu": 1, "pids": [4242, 4343]}))[0] == 200
        before = (short_tmp / "sim.json").read_bytes()
        status, body = await put_layout(node, "all-1g.10gb")
        assert status == 409 and body["error"]["code"] == "gpu-in-use", body
        assert "GPU 1" in body["error"]["message"] and "4242, 4343" in body["error"]["message"]
        assert body["error"]["busy"] == [{"gpu": 1, "uuid": body["error"]["busy"][0]["uuid"], "pids": [4242, 4343]}]
        assert_matches_openapi("PUT", "/v1/mig", 409, body)
        assert (short_tmp / "sim.json").read_bytes() == before  # nothing was changed
        status, body = await put_layout(node, "all-1g.10gb", force=True)
        assert status == 200 and body["in_sync"], body
        _, gpu = await node.get("/v1/gpus/1")
        assert gpu["mig"]["mode"] == "enabled" and len(gpu["mig"]["devices"]) == 7
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("preset", ["H100-SXM5-80GB:1", "A100-SXM4-40GB:1"])
async def test_a_mode_change_that_fails_midway_is_rolled_back(short_tmp, preset):
    # Guards item 3: after MIG was switched on and the first GPU instance failed, the GPU used to be
    # left in MIG mode with no instances instead of as it was.
    node = await start_daemon(mig_config(short_tmp, preset))
    try:
        node.daemon.session.nvml.sim_fail_mig_call(after=2)  # SetMigMode passes, the first GI create fails
        status, body = await put_layout(node, "all-balanced")
        assert status == 409 and body["error"]["code"] == "apply-failed", body
        _, gpu = await node.get("/v1/gpus/0")
        assert (gpu["mig"]["mode"], gpu["mig"]["pending_mode"], gpu["mig"]["devices"]) == ("disabled", "disabled", [])
        _, mig = await node.get("/v1/mig")
        assert mig["state"] == "failed" and "rollback failed" not in mig["error"]
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"gpus": 5}', b"\xff\xfe"])
async def test_a_corrupt_desired_state_is_loud_kept_aside_and_never_replaced_by_the_default(short_tmp, content):
    # Guards item 4: a corrupt mig-desired.json used to be logged and dropped, and mig.default_layout
    # applied in its place: the operator's layout was lost in silence.
    state = short_tmp / "state"
    state.mkdir()
    (state / "mig-desired.json").write_bytes(content)
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2", default_layout="all-3g.20gb"))
    try:
        mig = await mig_settled(node)
        assert mig["state"] == "failed" and "mig-desired.json" in mig["error"] and "corrupt" in mig["error"]
        assert all(g["actual"] == {"mig_enabled": False, "devices": {}} for g in mig["gpus"])  # no default
        assert (state / "mig-desired.json.corrupt").read_bytes() == content
        status, health = await node.get("/healthz")
        assert status == 200 and health["status"] == "degraded" and "mig-desired.json" in health["reason"]
        assert_matches_openapi("GET", "/healthz", 200, health)
        assert "mig-desired.json" in node.daemon.status_line()
        assert (await put_layout(node, "all-balanced"))[0] == 200  # the operator chooses again: all clear
        assert (await node.get("/healthz"))[1] == {"status": "ok"}
        assert "lost" not in node.daemon.status_line()
    finally:
        await stop_daemon(node)


@pytest.fixture
def full_state_dir(short_tmp):
    """The state directory on a 256 KiB tmpfs, for filling the disk."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root")
        pytest.skip("needs root to mount a small tmpfs")
    state = short_tmp / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(state)], check=True, timeout=120)
    yield state
    subprocess.run(["umount", "-l", str(state)], check=False, timeout=120)


def fill(directory) -> None:
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass  # ENOSPC: the disk is full
    finally:
        os.close(fd)


async def test_a_full_disk_refuses_the_apply_with_507_and_changes_nothing(short_tmp, full_state_dir):
    # Guards item 4: the write error used to escape as a bare 500 (not the API's JSON).
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2"))
    try:
        assert (await put_layout(node, "all-1g.5gb"))[0] == 200
        desired = (full_state_dir / "mig-desired.json").read_bytes()
        machine = (short_tmp / "sim.json").read_bytes()
        fill(full_state_dir)
        status, body = await put_layout(node, "all-balanced")
        assert status == 507 and body["error"]["code"] == "state-not-saved", body
        assert "disk is full" in body["error"]["message"] and "nothing was changed" in body["error"]["message"]
        assert_matches_openapi("PUT", "/v1/mig", 507, body)
        assert (full_state_dir / "mig-desired.json").read_bytes() == desired
        assert (short_tmp / "sim.json").read_bytes() == machine
        _, mig = await node.get("/v1/mig")
        assert mig["layout"] == "all-1g.5gb" and mig["in_sync"]
        (full_state_dir / "filler").unlink()
        assert (await put_layout(node, "all-balanced"))[0] == 200  # and it is not stuck "in progress"
    finally:
        await stop_daemon(node)
