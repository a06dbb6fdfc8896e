"""`gpud mig …` as an operator types it."""

from __future__ import annotations

import asyncio

import yaml
from helpers import REPO, cli, mig_config, start_daemon, stop_daemon

from gpud.client import Client

from gpud.mig.layouts import parse_layouts


def test_mig_validate(tmp_path):
    good = cli("mig", "validate", str(REPO / "etc" / "gpud" / "mig-layouts.yaml"))
    assert good.returncode == 0 and "all-balanced" in good.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\nmig-configs:\n  broken:\n    - devices: all\n      mig-enabled: yes please\n")
    result = cli("mig", "validate", str(bad))
    assert result.returncode == 2
    assert "bad.yaml" in result.stderr and "broken" in result.stderr and "mig-enabled" in result.stderr
    missing = cli("mig", "validate", str(tmp_path / "absent.yaml"))
    assert missing.returncode == 2 and "absent.yaml" in missing.stderr


def test_mig_apply_status_layouts_export(run_gpud, short_tmp):
    config = short_tmp / "gpud.yaml"
    config.write_text(f"mig:\n  layouts_file: {short_tmp / 'absent.yaml'}\n")
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:2", "--sim-state", str(short_tmp / "sim.json"),
                    "--config", str(config))
    gpud.wait_healthy()

    layouts = cli("mig", "layouts", socket=gpud.socket)
    assert layouts.returncode == 0 and layouts.stdout.startswith("from builtin: ")
    assert any(line.split()[:2] == ["all-balanced", "yes"] for line in layouts.stdout.splitlines())

    dry = cli("mig", "apply", "all-balanced", "--dry-run", socket=gpud.socket)
    assert dry.returncode == 0 and "GPU 0: keep 0" in dry.stdout and "GPU 1" in dry.stdout
    assert cli("mig", "status", socket=gpud.socket).returncode == 0  # nothing asked yet: nothing out of sync

    applied = cli("mig", "apply", "all-balanced", socket=gpud.socket)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "GPU 0: done" in applied.stdout and "GPU 1: done" in applied.stdout
    assert "layout all-balanced: success" in applied.stdout

    status = cli("mig", "status", socket=gpud.socket)
    assert status.returncode == 0 and "in sync: yes" in status.stdout
    assert "2× 1g.5gb, 1× 2g.10gb, 1× 3g.20gb" in status.stdout

    exported = cli("mig", "export", socket=gpud.socket)
    assert exported.returncode == 0
    (entry,) = parse_layouts(exported.stdout)["current"].entries
    assert entry.mig_devices == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    assert yaml.safe_load(exported.stdout)["version"] == "v1"

    _check_layouts_listing(gpud.socket, current="all-balanced")

    unknown = cli("mig", "apply", "all-nothing", socket=gpud.socket)
    assert unknown.returncode == 2 and "no layout 'all-nothing'" in unknown.stderr  # 404: invalid input
    assert gpud.stop() == 0


async def test_layouts_and_dry_run_say_what_needs_root_when_gpud_is_not_root(short_tmp, monkeypatch):
    """gpud and the simulated driver read the uid per call: with uid 1000 the API answers `needs_root`, and the
    text of `mig layouts` and `mig apply --dry-run` says it, the sentence as the API gives it."""
    node = await start_daemon(mig_config(short_tmp, "A100-SXM4-40GB:2"))
    socket = node.daemon.config.socket_path
    try:
        as_root = await asyncio.to_thread(cli, "mig", "apply", "all-balanced", "--dry-run", socket=socket)
        assert as_root.returncode == 0 and "needs root" not in as_root.stdout
        monkeypatch.setattr("os.geteuid", lambda: 1000)
        _, view = await node.get("/v1/mig/layouts")
        sentence = {layout["name"]: layout["needs_root"] for layout in view["layouts"]}["all-balanced"]
        assert sentence.startswith("gpud runs as uid 1000, not root")
        layouts = await asyncio.to_thread(cli, "mig", "layouts", socket=socket)
        rows = {line.removeprefix("* ").split()[0]: line for line in layouts.stdout.splitlines()[2:]
                if line.startswith(("  a", "* a"))}
        assert layouts.returncode == 0 and rows["all-balanced"].endswith("2 GPUs, needs root")
        assert not rows["all-disabled"].endswith("needs root")  # changes nothing: nothing to refuse
        assert f"needs root: {sentence}" in layouts.stdout.splitlines()
        dry = await asyncio.to_thread(cli, "mig", "apply", "all-balanced", "--dry-run", socket=socket)
        assert dry.returncode == 0 and dry.stdout.splitlines()[-1] == f"needs root: {sentence}"
    finally:
        await stop_daemon(node)


def _check_layouts_listing(socket, current: str) -> None:
    """`gpud mig layouts`: the layouts that fit, one line each, the current one marked on its own row;
    then how many do not; --all adds those with why."""
    layouts = Client(socket).get("/v1/mig/layouts")["layouts"]
    fitting = [layout["name"] for layout in layouts if layout["fits"]]
    everyone = [layout["name"] for layout in layouts]
    shown = cli("mig", "layouts", socket=socket)
    title, header, *rows, more = shown.stdout.splitlines()
    assert shown.returncode == 0 and header.split() == ["LAYOUT", "FITS", "CHANGES"]
    assert title == f"from builtin: {len(fitting)} of {len(everyone)} layouts fit this node (* = current)"
    assert [row.removeprefix("* ").split()[0] for row in rows] == fitting  # one line each, nothing else
    assert [row.split()[1] for row in rows if row.startswith("* ")] == [current]
    assert more == f"{len(everyone) - len(fitting)} more do not fit this node: gpud mig layouts --all says why"
    assert all(f"mig-configs.{name}[" not in shown.stderr for name in set(everyone) - set(fitting))  # not shown

    every = cli("mig", "layouts", "--all", socket=socket)
    named = {line.removeprefix("* ").split()[0] for line in every.stdout.splitlines() if line.startswith(("  a", "* a"))}
    assert every.returncode == 0 and named == set(everyone) and "do not fit this node:" in every.stdout
