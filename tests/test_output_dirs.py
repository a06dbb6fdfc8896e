"""The CDI spec directory and NFD's feature directory get the state directory's checks (issue 20,
item 5). Root gpud followed a symlink another user planted in /tmp, wrote into a directory another
user owned or could write, and never noticed a spec swapped behind its back, whose hook a container
runtime then ran as root. Real users (gpudt-other), real planted symlinks, the real CDI library."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
import structlog
from cdi_library import assert_cdi_library_accepts
from helpers import SYSTEM_PATH, sharing_config, stand_in_nodes, start_daemon, stop_daemon, until_async
from openapi_check import assert_matches_openapi

from gpud.cdi.writer import RECHECK_S as CDI_RECHECK_S
from gpud.nfd.writer import RECHECK_S as NFD_RECHECK_S

OTHER = "gpudt-other"
NO_SHARING = "version: v1\n"
EVIL_HOOK = "/tmp/gpudt-evil-hook"  # what a swapped spec has the runtime run as root


def as_other(*command: str, text: str | None = None) -> None:
    """Runs command as the real user gpudt-other, none of root's groups; text: its standard input."""
    setpriv = shutil.which("setpriv", path=SYSTEM_PATH)
    subprocess.run([setpriv, f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *command], check=True,
                   input=text, text=True, capture_output=True, timeout=30)


def write_as_other(path: Path, text: str) -> None:
    as_other("tee", str(path), text=text)


@pytest.fixture
def in_tmp(users):
    """Fresh names directly in /tmp (sticky, everyone writes there: where another user plants things);
    removed after the test."""
    made: list[Path] = []

    def name() -> Path:
        made.append(Path(f"/tmp/gpudt-{secrets.token_hex(6)}"))
        return made[-1]

    yield name
    for path in made:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)


def cdi_config(tmp: Path, spec_dir: Path):
    root = stand_in_nodes(tmp / "root", gpus=1)
    return sharing_config(tmp, "A100-SXM4-40GB:1", NO_SHARING).with_overrides(
        **{"cdi.dev_root": str(root), "cdi.spec_dir": str(spec_dir)})


def nfd_config(tmp: Path, features_file: Path):
    return sharing_config(tmp, "A100-SXM4-40GB:1", NO_SHARING).with_overrides(
        **{"nfd.features_file": str(features_file)})


async def view_until(node, route: str, wanted, timeout: float) -> dict:
    """GET route until wanted(view) holds: the last view."""
    seen = {}

    async def check() -> bool:
        nonlocal seen
        _, seen = await node.get(route)
        return bool(wanted(seen))

    await until_async(check, timeout=timeout, what=f"{route} as wanted (last: {seen})")
    return seen


async def healthz_problems(node) -> list[str]:
    _, health = await node.get("/healthz")
    return health.get("problems", []) if health["status"] == "degraded" else []


def swapped(spec: dict) -> dict:
    """gpud's spec with every hook pointing at EVIL_HOOK: the runtime would run that as root."""
    hooks = spec["containerEdits"]["hooks"]
    assert hooks, "the spec has hooks to swap"
    return {**spec, "containerEdits": {**spec["containerEdits"],
                                       "hooks": [{**hook, "path": EVIL_HOOK} for hook in hooks]}}


def refusal_checks(error: str, refused: Path, owner: str, what_to_do: str) -> None:
    assert str(refused) in error and owner in error and what_to_do in error, error
    assert "tries again every" in error, error


# -- the CDI spec directory -----------------------------------------------------------------------


async def test_cdi_a_symlink_another_user_planted_in_tmp_is_not_followed(short_tmp, in_tmp):
    # Guards against following a link another user planted where the spec directory is to be made:
    # root gpud made the spec in the link's target (/etc, here a root-only directory standing in for it).
    target = short_tmp / "etc"
    target.mkdir(mode=0o755)
    spec_dir = in_tmp()
    as_other("ln", "-s", str(target), str(spec_dir))
    with structlog.testing.capture_logs() as logged:
        node = await start_daemon(cdi_config(short_tmp, spec_dir), healthy=False)
        try:
            view = await view_until(node, "/v1/cdi", lambda v: v["error"], timeout=5)
            refusal_checks(view["error"], spec_dir, f"({OTHER})", "remove it")
            assert "symlink" in view["error"] and view["spec"] is None
            assert view["error"] in await healthz_problems(node)
            assert list(target.iterdir()) == []  # nothing written through the link
            assert any(entry["event"] == "cdi_spec_not_written" and str(spec_dir) in entry["error"]
                       for entry in logged)

            spec_dir.unlink()  # the operator removes the link: gpud makes the directory, writes the spec
            view = await view_until(node, "/v1/cdi", lambda v: v["spec"], timeout=CDI_RECHECK_S + 3)
            assert view["error"] is None and await healthz_problems(node) == []
            written = json.loads((spec_dir / "gpud-gpu.json").read_text())
            assert written == view["spec"]
            assert_cdi_library_accepts(written)
            info = spec_dir.stat()
            assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o755)
        finally:
            await stop_daemon(node)
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("spoil", ["owned-by-another-user", "writable-by-another-user"])
async def test_cdi_a_directory_another_user_controls_is_refused_until_fixed(short_tmp, in_tmp, spoil):
    # Guards against writing the spec where another user can swap it: gpud wrote into a directory
    # gpudt-other owned (or could write), and the spec gpudt-other had left there stayed or came back.
    spec_dir = in_tmp()
    if spoil == "owned-by-another-user":
        as_other("mkdir", "-m", "0755", str(spec_dir))
        owner, mode, what_to_do = f"uid {pwd.getpwnam(OTHER).pw_uid} ({OTHER})", "0755", "chown root:"
    else:
        spec_dir.mkdir()
        spec_dir.chmod(0o777)
        owner, mode, what_to_do = "uid 0 (root)", "0777", "chmod go-w"
    planted = {"cdiVersion": "0.5.0", "kind": "gpud/gpu",
               "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/null"}]}}],
               "containerEdits": {"hooks": [{"hookName": "createContainer", "path": EVIL_HOOK}]}}
    write_as_other(spec_dir / "gpud-gpu.json", json.dumps(planted))
    before = (spec_dir / "gpud-gpu.json").read_bytes()
    node = await start_daemon(cdi_config(short_tmp, spec_dir), healthy=False)
    try:
        view = await view_until(node, "/v1/cdi", lambda v: v["error"], timeout=5)
        refusal_checks(view["error"], spec_dir, owner, what_to_do)
        assert f"mode {mode}" in view["error"]
        assert_matches_openapi("GET", "/v1/cdi", 200, view)
        assert view["error"] in await healthz_problems(node)
        await asyncio.sleep(CDI_RECHECK_S + 0.5)  # fixed time: a recheck passes and still writes nothing
        assert sorted(p.name for p in spec_dir.iterdir()) == ["gpud-gpu.json"]
        assert (spec_dir / "gpud-gpu.json").read_bytes() == before

        os.chown(spec_dir, 0, 0)  # the operator fixes the directory: the spec is written at the next recheck
        spec_dir.chmod(0o755)
        fixed_at = time.monotonic()
        view = await view_until(node, "/v1/cdi", lambda v: v["spec"], timeout=CDI_RECHECK_S + 3)
        assert time.monotonic() - fixed_at < CDI_RECHECK_S + 1
        written = json.loads((spec_dir / "gpud-gpu.json").read_text())
        assert written == view["spec"] and EVIL_HOOK not in json.dumps(written)
        assert (spec_dir / "gpud-gpu.json").stat().st_uid == 0
        assert_cdi_library_accepts(written)
        assert await healthz_problems(node) == []
    finally:
        await stop_daemon(node)


def _replace_by_rename(spec_file: Path, spec: dict) -> None:
    temporary = spec_file.with_name("swap.tmp")
    temporary.write_text(json.dumps(spec))
    temporary.chmod(0o644)
    os.replace(temporary, spec_file)


@pytest.mark.parametrize("change", ["swapped", "edited-in-place", "symlink", "chmod", "given-to-another-user"])
async def test_cdi_a_spec_changed_behind_gpuds_back_is_reported_and_rewritten(short_tmp, users, change):
    # Guards against trusting the file once written: a spec swapped for one whose hook points
    # elsewhere (run as root by the runtime) stayed until the devices changed, which may be never.
    spec_dir = short_tmp / "cdi"
    spec_file = spec_dir / "gpud-gpu.json"
    elsewhere = short_tmp / "elsewhere.json"
    with structlog.testing.capture_logs() as logged:
        node = await start_daemon(cdi_config(short_tmp, spec_dir))
        try:
            original = (await view_until(node, "/v1/cdi", lambda v: v["spec"], timeout=5))["spec"]
            evil = swapped(original)
            if change == "swapped":  # another root process renames its own spec over gpud's
                _replace_by_rename(spec_file, evil)
            elif change == "edited-in-place":
                spec_file.write_text(json.dumps(evil, indent=2) + "\n")
            elif change == "symlink":
                elsewhere.write_text(json.dumps(evil))
                spec_file.unlink()
                spec_file.symlink_to(elsewhere)
            elif change == "chmod":
                spec_file.chmod(0o666)
            else:  # root gave the file away by mistake; the other user edits it
                os.chown(spec_file, pwd.getpwnam(OTHER).pw_uid, -1)
                short_tmp.chmod(0o711)  # gpudt-other reaches the file, and can change nothing else
                write_as_other(spec_file, json.dumps(evil))
            noticed = await view_until(node, "/v1/cdi", lambda v: v["changed_behind_gpud"]["count"] == 1,
                                       timeout=CDI_RECHECK_S + 2)
            assert_matches_openapi("GET", "/v1/cdi", 200, noticed)
            words = {"swapped": "replaced by another file", "edited-in-place": "content was changed",
                     "symlink": f"replaced by a symlink to {elsewhere}", "chmod": "mode changed from 0644 to 0666",
                     "given-to-another-user": "owner changed"}[change]
            assert words in noticed["changed_behind_gpud"]["last"], noticed["changed_behind_gpud"]
            # The whole file is the condition: after a chmod alone the content already matches, and
            # the report is visible before the rewrite lands.
            await until_async(lambda: _holds(spec_file, original), timeout=2, what="the spec rewritten")
            assert_cdi_library_accepts(json.loads(spec_file.read_text()))
            assert [e for e in logged if e["event"] == "cdi_spec_changed_behind_gpud" and words in e["change"]]
            await asyncio.sleep(CDI_RECHECK_S + 0.5)  # fixed time: once rewritten, the next recheck finds it gpud's
            _, view = await node.get("/v1/cdi")
            assert view["changed_behind_gpud"]["count"] == 1 and view["error"] is None
        finally:
            await stop_daemon(node)
    if change == "symlink":
        assert json.loads(elsewhere.read_text()) == evil  # the link was replaced, its target left alone


async def _holds(path: Path, spec: dict) -> bool:
    """The spec is gpud's again: a regular file of root's, mode 0644, with this content."""
    try:
        info = os.lstat(path)
        return (stat.S_ISREG(info.st_mode) and info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o644
                and json.loads(path.read_text()) == spec)
    except (OSError, ValueError):
        return False


# -- NFD's feature directory ----------------------------------------------------------------------


async def test_nfd_a_symlink_another_user_planted_in_tmp_is_not_followed(short_tmp, in_tmp):
    target = short_tmp / "etc"
    target.mkdir(mode=0o755)
    features_dir = in_tmp()
    as_other("ln", "-s", str(target), str(features_dir))
    node = await start_daemon(nfd_config(short_tmp, features_dir / "gpud"), healthy=False)
    try:
        view = await view_until(node, "/v1/nfd", lambda v: v["error"], timeout=5)
        refusal_checks(view["error"], features_dir, f"({OTHER})", "remove it")
        assert view["written_at"] is None
        assert any(str(features_dir) in problem for problem in await healthz_problems(node))
        assert list(target.iterdir()) == []

        features_dir.unlink()
        await view_until(node, "/v1/nfd", lambda v: v["written_at"], timeout=3)
        assert "nvidia.com/gpu.count=1" in (features_dir / "gpud").read_text()
        assert await healthz_problems(node) == []
    finally:
        await stop_daemon(node)
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("spoil", ["owned-by-another-user", "writable-by-another-user"])
async def test_nfd_a_directory_another_user_controls_is_refused_until_fixed(short_tmp, in_tmp, spoil):
    features_dir = in_tmp()
    if spoil == "owned-by-another-user":
        as_other("mkdir", "-m", "0755", str(features_dir))
        owner, what_to_do = f"({OTHER})", "chown root:"
    else:
        features_dir.mkdir()
        features_dir.chmod(0o775)
        os.chown(features_dir, 0, pwd.getpwnam(OTHER).pw_gid)  # gpudt-other's group may write it
        owner, what_to_do = "uid 0 (root)", "chmod go-w"
    write_as_other(features_dir / "gpud", "nvidia.com/gpu.health=healthy\n")
    node = await start_daemon(nfd_config(short_tmp, features_dir / "gpud"), healthy=False)
    try:
        view = await view_until(node, "/v1/nfd", lambda v: v["error"], timeout=5)
        refusal_checks(view["error"], features_dir, owner, what_to_do)
        assert_matches_openapi("GET", "/v1/nfd", 200, view)
        assert any(str(features_dir) in problem for problem in await healthz_problems(node))
        await asyncio.sleep(1.5)  # fixed time: a retry (every second) passes and still writes nothing
        assert (features_dir / "gpud").read_text() == "nvidia.com/gpu.health=healthy\n"
        assert sorted(p.name for p in features_dir.iterdir()) == ["gpud"]

        os.chown(features_dir, 0, 0)
        features_dir.chmod(0o755)
        await view_until(node, "/v1/nfd", lambda v: v["written_at"], timeout=3)
        assert "nvidia.com/gpu.count=1" in (features_dir / "gpud").read_text()
        assert (features_dir / "gpud").stat().st_uid == 0
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("change", ["swapped", "symlink", "chmod"])
async def test_nfd_a_file_changed_behind_gpuds_back_is_reported_and_rewritten(short_tmp, change):
    # Guards against trusting the file until the next label change or refresh (half of nfd.expiry_s,
    # 5 minutes by default): NFD published the labels someone else put there meanwhile.
    features_file = short_tmp / "features.d" / "gpud"
    elsewhere = short_tmp / "elsewhere"
    node = await start_daemon(nfd_config(short_tmp, features_file))
    try:
        await view_until(node, "/v1/nfd", lambda v: v["written_at"], timeout=5)
        original = features_file.read_text()
        forged = original.replace("nvidia.com/gpu.count=1", "nvidia.com/gpu.count=64")
        assert forged != original
        if change == "swapped":
            temporary = features_file.with_name(".swap")
            temporary.write_text(forged)
            os.replace(temporary, features_file)
        elif change == "symlink":
            elsewhere.write_text(forged)
            features_file.unlink()
            features_file.symlink_to(elsewhere)
        else:
            features_file.chmod(0o666)
        noticed = await view_until(node, "/v1/nfd", lambda v: v["changed_behind_gpud"]["count"] == 1,
                                   timeout=NFD_RECHECK_S + 2)
        assert_matches_openapi("GET", "/v1/nfd", 200, noticed)
        # gpud counts the change, then rewrites the file on a thread: wait for the rewrite itself (a
        # chmod leaves the labels as they were, so only the mode shows it)
        await until_async(lambda: _regular_with(features_file, "nvidia.com/gpu.count=1\n", mode=0o644), timeout=2,
                          what="the feature file rewritten")
    finally:
        await stop_daemon(node)
    if change == "symlink":
        assert elsewhere.read_text() == forged


async def _regular_with(path: Path, line: str, mode: int | None = None) -> bool:
    return (not path.is_symlink() and path.exists() and line in path.read_text()
            and (mode is None or stat.S_IMODE(path.stat().st_mode) == mode))
