"""Local security (issue 12, item 5): a hostile local user cannot borrow admin rights, read the
operator's hook commands, plant a socket, a lock or a symlink where gpud or its client goes, or
run a second gpud on the same state. Real users, real sockets, real planted symlinks."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import pytest
from helpers import ADMINS, READERS, SYSTEM_PATH, gpud_for_users, mig_config, put_layout, start_daemon, stop_daemon

from gpud.base.safefs import InUse, UnsafePath
from gpud.client import Client, DaemonUnreachable
from gpud.config import MigHooksConfig
from gpud.daemon import Daemon
from gpud.mps.control import MpsControl, MpsDirectories, MpsError

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as another user")


def curl_with(user: str, group: str, groups: list[str], socket_path: Path, method: str, path: str,
              body: dict | None = None) -> int:
    """curl as `user` with exactly these primary and supplementary groups, whatever /etc/group says."""
    command = [shutil.which("setpriv", path=SYSTEM_PATH), f"--reuid={user}", f"--regid={group}",
               f"--groups={','.join(groups)}" if groups else "--clear-groups",
               "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--unix-socket", str(socket_path),
               "-X", method, f"http://localhost{path}"]
    if body is not None:
        command += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    return int(subprocess.run(command, capture_output=True, text=True, timeout=30).stdout or 0)


# -- admin rights: the peer's credentials as it connected ----------------------------------------


def test_admin_rights_come_from_the_connecting_process_not_from_etc_group(run_gpud, short_tmp, users):
    # Guards against reading membership from /etc/group after the fact: a process that dropped
    # the admin group (setpriv, a container) kept admin rights; one that holds it was refused.
    gpud = gpud_for_users(run_gpud, short_tmp)
    dry_run = ("PUT", "/v1/mig", {"layout": "all-balanced", "dry_run": True})

    # /etc/group lists gpudt-admin in the admin group, but this process dropped it
    assert curl_with("gpudt-admin", READERS, [], gpud.socket, *dry_run) == 403
    assert curl_with("gpudt-admin", READERS, [READERS, ADMINS], gpud.socket, *dry_run) == 200
    # /etc/group lists gpudt-other in no group, but this process holds the admin group
    assert curl_with("gpudt-other", READERS, [READERS, ADMINS], gpud.socket, *dry_run) == 200
    assert curl_with("gpudt-other", ADMINS, [READERS], gpud.socket, *dry_run) == 200  # as its primary group
    assert curl_with("gpudt-other", READERS, [READERS], gpud.socket, *dry_run) == 403
    assert curl_with("gpudt-other", READERS, [READERS], gpud.socket, "GET", "/v1/mig") == 200  # reading is open
    assert gpud.stop() == 0


def test_a_peer_in_hundreds_of_groups_is_still_read_whole(run_gpud, short_tmp, users):
    # SO_PEERGROUPS answers ERANGE when the buffer is short: the groups are read with the size the
    # kernel asks for (Python's own getsockopt stops at 256 groups), so the admin group is found last.
    gpud = gpud_for_users(run_gpud, short_tmp)
    many = [str(gid) for gid in range(70000, 70400)]  # numeric groups need no /etc/group entry
    assert curl_with("gpudt-other", READERS, [READERS, *many, ADMINS], gpud.socket,
                     "POST", "/v1/reload") == 200
    assert curl_with("gpudt-other", READERS, [READERS, *many], gpud.socket, "POST", "/v1/reload") == 403
    assert gpud.stop() == 0


# -- no secrets in read routes -------------------------------------------------------------------


async def _watched_until(node, wanted) -> str:
    """What /v1/watch replays from this run's start, up to the first event `wanted` accepts."""
    lines = []
    async with node.http.get("http://localhost/v1/watch?since=0") as response:
        deadline = asyncio.get_running_loop().time() + 10
        while not lines or not wanted(json.loads(lines[-1])):
            remaining = deadline - asyncio.get_running_loop().time()
            lines.append((await asyncio.wait_for(response.content.readline(), remaining)).decode())
    return "".join(lines)


async def test_hook_command_lines_and_output_stay_out_of_read_routes(short_tmp):
    # Guards against showing the operator's hook commands (tokens, hosts) and what they printed to
    # any reader: /v1/mig and the watch stream's mig events said "hook 'curl -H token…' failed: …".
    secret = "s3cr3t-T0KEN"
    post_hook = f"echo printed-{secret}; exit 4 # {secret}"
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:1",
                                         hooks=MigHooksConfig(post_apply=(post_hook,))))
    try:
        status, body = await put_layout(node, "all-1g.5gb")
        assert status == 200
        _, mig = await node.get("/v1/mig")
        told = "post_apply hook command 1 of 1 failed (exit status 4); its command line and output are in gpud's log"
        assert told in mig["error"]
        watched = await _watched_until(node, lambda event: event["type"] == "mig" and
                                       told in (event["data"].get("error") or ""))
        for text in (json.dumps(body), json.dumps(mig), watched):
            assert secret not in text
    finally:
        await stop_daemon(node)
    (short_tmp / "second").mkdir()  # a node of its own: no layout left to converge to from the first
    failing = await start_daemon(mig_config(short_tmp / "second", "A100-SXM4-40GB:1",
                                            hooks=MigHooksConfig(pre_apply=(f"echo {secret} >&2; false",))))
    try:
        status, body = await put_layout(failing, "all-balanced")
        assert status == 409 and "pre_apply hook command 1 of 1 failed (exit status 1)" in body["error"]["message"]
        _, mig = await failing.get("/v1/mig")
        assert (await failing.post("/v1/sim/xid", {"gpu": 0, "xid": 79}))[0] == 200  # an event after the apply's
        watched = await _watched_until(failing, lambda event: event["type"] == "health")
        for text in (json.dumps(body), json.dumps(mig), watched):
            assert secret not in text
    finally:
        await stop_daemon(failing)


# -- the runtime directory, the lock beside the socket -------------------------------------------


def _config(tmp: Path, socket_dir: Path, state_dir: Path | None = None):
    config = mig_config(tmp, "A100-SXM4-40GB:1")
    return config.with_overrides(**{"api.socket": str(socket_dir / "g.sock"), "api.group": "no-such-group",
                                    "state_dir": str(state_dir or tmp / "state")})


async def test_gpud_makes_its_runtime_directory_private(short_tmp, users):
    # Guards against a runtime directory made 0755 by default (anyone could list it, and a
    # directory left writable to others would let them plant a socket or a lock).
    node = await start_daemon(_config(short_tmp, short_tmp / "run"))
    try:
        assert stat.S_IMODE((short_tmp / "run").stat().st_mode) == 0o700
        assert stat.S_IMODE((short_tmp / "state").stat().st_mode) == 0o700
        assert stat.S_IMODE((short_tmp / "run" / "g.sock.lock").stat().st_mode) == 0o600
    finally:
        await stop_daemon(node)
    grouped = _config(short_tmp, short_tmp / "grouped", short_tmp / "state2").with_overrides(**{"api.group": READERS})
    node = await start_daemon(grouped)
    try:
        info = (short_tmp / "grouped").stat()  # the group's members traverse it to reach the socket
        assert stat.S_IMODE(info.st_mode) == 0o750 and info.st_uid == 0
        assert info.st_gid == (short_tmp / "grouped" / "g.sock").stat().st_gid != 0
    finally:
        await stop_daemon(node)


@needs_root
async def test_an_existing_socket_directory_keeps_its_owner_and_mode(short_tmp, users):
    # Guards against the reload lock-out (issue 20, item 1): gpud gave the existing /run/gpud (systemd's
    # RuntimeDirectory=, root:root 0755) to the socket's group; at the next ExecReload= systemd found its
    # owner changed and chowned the whole tree back to root, the socket and mps.user's pipes with it.
    run = short_tmp / "run"
    run.mkdir(mode=0o755)  # as systemd makes it: RuntimeDirectoryMode=0755, root:root
    short_tmp.chmod(0o755)
    node = await start_daemon(_config(short_tmp, run).with_overrides(**{"api.group": READERS}))
    try:
        info = run.stat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, 0, 0o755)
        sock = (run / "g.sock").stat()
        assert (sock.st_uid, sock.st_gid, stat.S_IMODE(sock.st_mode)) == (0, grp.getgrnam(READERS).gr_gid, 0o660)
        assert await asyncio.to_thread(curl_with, "gpudt-reader", READERS, [READERS], run / "g.sock",
                                       "GET", "/v1/gpus") == 200
        assert await asyncio.to_thread(curl_with, "gpudt-other", "gpudt-other", [], run / "g.sock",
                                       "GET", "/v1/gpus") == 0  # not in the group: no connection at all
    finally:
        await stop_daemon(node)


@needs_root
@pytest.mark.parametrize("spoil", ["owned-by-another-user", "writable-by-others", "planted-symlink"])
async def test_gpud_refuses_a_runtime_directory_someone_else_controls(short_tmp, spoil):
    # Guards against taking over a socket directory another user made (they could swap the socket
    # or the lock under gpud): gpud used any existing directory, and followed a symlink to it.
    run = short_tmp / "run"
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if spoil == "planted-symlink":
        run.symlink_to(elsewhere)
        os.lchown(run, NOBODY, NOBODY)
    else:
        run.mkdir(mode=0o700)
        if spoil == "owned-by-another-user":
            os.chown(run, NOBODY, NOBODY)
        else:
            run.chmod(0o777)
    with pytest.raises(UnsafePath, match=str(run)):
        await Daemon(_config(short_tmp, run)).start()
    assert not (elsewhere / "g.sock.lock").exists() and not (short_tmp / "state").exists()


async def test_a_lock_file_planted_as_a_symlink_is_not_followed(short_tmp):
    # Guards against opening the lock through a symlink: gpud truncated the file it pointed to
    # (as root: any file) and wrote its PID into it.
    run = short_tmp / "run"
    run.mkdir(mode=0o700)
    victim = short_tmp / "victim"
    victim.write_text("precious\n")
    (run / "g.sock.lock").symlink_to(victim)
    with pytest.raises(UnsafePath, match="symlink"):
        await Daemon(_config(short_tmp, run)).start()
    assert victim.read_text() == "precious\n"


@needs_root
async def test_a_lock_file_owned_by_another_user_is_refused(short_tmp):
    run = short_tmp / "run"
    run.mkdir(mode=0o700)
    lock = run / "g.sock.lock"
    lock.write_text("")
    os.chown(lock, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match="owned by gpud's user"):
        await Daemon(_config(short_tmp, run)).start()


# -- one gpud per state directory -----------------------------------------------------------------


async def test_two_gpuds_cannot_share_a_state_directory(short_tmp):
    # Guards against two daemons (on two sockets) writing the same desired layout, health and
    # sequence files: nothing stopped the second one.
    first = await start_daemon(_config(short_tmp, short_tmp / "one"))
    try:
        with pytest.raises(InUse, match=f"another gpud uses the state directory {short_tmp / 'state'}"):
            await Daemon(_config(short_tmp, short_tmp / "two")).start()
        assert not (short_tmp / "two" / "g.sock").exists()
        assert (await first.get("/healthz"))[0] == 200
    finally:
        await stop_daemon(first)
    second = await start_daemon(_config(short_tmp, short_tmp / "two"))  # released at stop
    await stop_daemon(second)


def test_a_second_gpud_process_on_the_same_state_exits_saying_why(run_gpud, short_tmp):
    args = ("--simulate", "t4", "--sim-state", str(short_tmp / "sim.json"))
    first = run_gpud(*args)
    first.wait_healthy()
    second = run_gpud(*args, "--socket", str(short_tmp / "other.sock"))
    assert second.proc.wait(20) == 1
    refused = [e for e in second.log_events() if e.get("event") == "paths_unavailable"]
    assert refused and "another gpud uses the state directory" in refused[0]["error"]
    assert first.client.get("/healthz")["status"] == "ok"
    assert first.stop() == 0


# -- the client ----------------------------------------------------------------------------------


def _fake_gpud(directory: Path) -> socket.socket:
    """A listening socket in `directory` that answers nobody: a planted fake gpud."""
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(str(directory / "gpud.sock"))
    fake.listen(4)
    fake.setblocking(False)
    return fake


@needs_root
@pytest.mark.parametrize("spoil", ["owned-by-another-user", "writable-by-others"])
def test_the_client_never_connects_to_a_socket_another_user_could_have_planted(short_tmp, spoil):
    # Guards against the CLI sending its requests to (and believing the answers of) a socket in a
    # directory another user controls, such as a /tmp/gpud-UID made before the user's gpud.
    directory = short_tmp / "planted"
    directory.mkdir(mode=0o755)
    fake = _fake_gpud(directory)
    if spoil == "owned-by-another-user":
        os.chown(directory, NOBODY, NOBODY)
    else:
        directory.chmod(0o1777)  # even sticky, like /tmp: another user made the entry
    try:
        with pytest.raises(DaemonUnreachable, match="not connecting to .* so the socket may not be gpud's"):
            Client(directory / "gpud.sock", timeout=2).get("/healthz")
        with pytest.raises(BlockingIOError):
            fake.accept()  # no connection was ever made
    finally:
        fake.close()


async def test_the_client_still_reaches_gpud_through_its_own_directory(short_tmp):
    node = await start_daemon(_config(short_tmp, short_tmp / "run"))
    try:
        client = Client(short_tmp / "run" / "g.sock", timeout=5)
        assert (await asyncio.to_thread(client.get, "/healthz"))["status"] == "ok"
    finally:
        await stop_daemon(node)


# -- MPS directories -----------------------------------------------------------------------------


@needs_root
async def test_root_never_chowns_through_a_symlink_planted_in_the_mps_directories(short_tmp):
    # Guards against root gpud following a symlink the MPS user planted where its log directory
    # goes (a log root that user can write) and chowning the target, here a root directory, to it.
    log_root = short_tmp / "logs"
    log_root.mkdir()
    os.chown(log_root, NOBODY, NOBODY)
    victim = short_tmp / "victim"
    victim.mkdir(mode=0o700)
    (log_root / "mps-0").symlink_to(victim)
    os.lchown(log_root / "mps-0", NOBODY, NOBODY)
    control = MpsControl("true", MpsDirectories(short_tmp / "pipes" / "mps-0" / "pipe", log_root / "mps-0"), ("0",),
                         user="nobody")
    with pytest.raises(MpsError, match="not starting the MPS control daemon"):
        await control.start(wait_s=0.2)
    assert victim.stat().st_uid == 0 and stat.S_IMODE(victim.stat().st_mode) == 0o700


@needs_root
async def test_mps_directories_are_made_and_given_to_the_mps_user(short_tmp):
    pipe, log = short_tmp / "pipes" / "mps-0" / "pipe", short_tmp / "logs" / "mps-0"
    control = MpsControl("true", MpsDirectories(pipe, log), ("0",), user="nobody")
    with pytest.raises(MpsError, match="did not answer"):  # `true` is no MPS daemon: only the directories count
        await control.start(wait_s=0.2)
    for directory in (pipe, log):
        info = directory.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (NOBODY, 0o755)
    assert (short_tmp / "pipes" / "mps-0").stat().st_uid == 0
    # a pipe directory that already exists, made by the previous start, is taken as it is
    with pytest.raises(MpsError, match="did not answer"):
        await control.start(wait_s=0.2)


# -- state files ---------------------------------------------------------------------------------


async def test_a_state_file_planted_as_a_symlink_is_reported_not_read(short_tmp):
    # Guards against reading persisted state through a symlink: gpud took whatever the link
    # pointed to as its desired layout. The state directory is gpud's alone, so a link there is
    # a plant: it is reported and left for the operator, and its target is neither read nor moved.
    state = short_tmp / "state"
    state.mkdir(mode=0o700)
    victim = short_tmp / "victim.json"
    victim.write_text("{}\n")
    (state / "mig-desired.json").symlink_to(victim)
    node = await start_daemon(_config(short_tmp, short_tmp / "run"))
    try:
        _, health = await node.get("/healthz")
        assert health["status"] == "degraded" and "mig-desired.json" in health["reason"]
        assert "symbolic links" in health["reason"]
    finally:
        await stop_daemon(node)
    assert victim.read_text() == "{}\n" and (state / "mig-desired.json").is_symlink()


def test_directories_made_on_the_way_get_their_mode_whatever_the_umask(short_tmp):
    """Under the unit's UMask, directories secure_directory creates on the way (/run/gpud/mps above
    an MPS pipe directory) are still 0755, so an MPS daemon running as mps.user reaches its own."""
    from gpud.base.safefs import secure_directory

    previous = os.umask(0o077)
    try:
        secure_directory(short_tmp / "mps" / "gpu0" / "pipe", 0o755)
    finally:
        os.umask(previous)
    for made in (short_tmp / "mps", short_tmp / "mps" / "gpu0", short_tmp / "mps" / "gpu0" / "pipe"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o755, made
