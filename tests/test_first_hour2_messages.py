"""Messages that fit the install: a locked state directory names --state-dir, a missing scontrol names
Debian's package and --scontrol, gres.conf says why a GPU in MIG mode has no shards, and the log says
"no path" as JSON null."""

from __future__ import annotations

import json
import time

import pytest
import structlog
from helpers import (GpudProcess, mig_config, mig_settled, put_layout, sharing_config, start_daemon, stop_daemon,
                     until_async)

from gpud.cdi.spec import parse_mig_minors
from gpud.slurm.gres import build_gres
from gpud.slurm.health import EXIT_SCONTROL, HealthCheckFailed, Scontrol


def test_a_second_gpud_on_a_locked_state_directory_is_told_to_give_another(run_gpud, short_tmp):
    args = ("--simulate", "t4", "--sim-state", str(short_tmp / "sim.json"))
    first = run_gpud(*args)
    first.wait_healthy()
    second = GpudProcess(short_tmp, *args, "--socket", str(short_tmp / "other.sock"))
    try:
        assert second.proc.wait(20) == 1
        refused = [e for e in second.log_events() if e.get("event") == "paths_unavailable"]
        assert refused, second.log_text()
        error = refused[0]["error"]
        assert f"another gpud uses the state directory {short_tmp / 'state'}" in error
        assert "--state-dir DIR" in error and "state_dir" in error, error
    finally:
        second.stop()
        first.stop()


@pytest.mark.parametrize("given, named", [("scontrol", "scontrol on PATH"),
                                          ("/nonexistent/scontrol", "/nonexistent/scontrol")])
def test_a_missing_scontrol_names_debians_package_and_the_option(monkeypatch, tmp_path, given, named):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol here: a node without Slurm's client commands
    with pytest.raises(HealthCheckFailed) as failed:
        Scontrol(given, time.monotonic() + 10, dry_run=True).run("show", "node", "-o", "n1")
    message = str(failed.value)
    assert failed.value.exit_code == EXIT_SCONTROL
    assert message.startswith(f"scontrol not found: {named}"), message
    assert "slurm-client" in message and "--scontrol PATH" in message, message


async def test_shards_of_a_gpu_in_mig_mode_say_why_they_are_left_out(short_tmp):
    """migStrategy none shares a GPU in MIG mode whole (NVIDIA's device plugin does): its replicas are in the
    sharing document, but gres.conf lists it through its MIG devices only."""
    text = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    config = sharing_config(short_tmp, "A100-SXM4-40GB:1", text)
    node = await start_daemon(config)
    try:
        await mig_settled(node)
        assert (await put_layout(node, "all-1g.5gb"))[0] == 200
        daemon = node.daemon
        await until_async(lambda: daemon.sharing.document["resources"][0]["devices"][0]["id"].startswith("GPU-"),
                          what="the whole GPU shared")
        minors = parse_mig_minors(config.mig_minors_path.read_text())
        gres = build_gres(daemon.inventory.current, daemon.sharing.document, minors, lambda cpus: None)
    finally:
        await stop_daemon(node)
    assert gres.node_gres == "gpu:1g.5gb:7" and len(gres.unavailable) == 1
    reason = gres.unavailable[0]["reason"]
    assert "its GPU is unavailable" not in reason
    assert "GPU 0 is in MIG mode" in reason and "MultipleFiles" in reason and "File" in reason, reason


async def test_the_gres_built_log_line_has_a_null_path(short_tmp):
    with structlog.testing.capture_logs() as logged:
        node = await start_daemon(mig_config(short_tmp, "t4"))
        try:
            await until_async(lambda: [e for e in logged if e["event"] == "slurm_gres_built"],
                              what="slurm_gres_built logged")
        finally:
            await stop_daemon(node)
    built = [e for e in logged if e["event"] == "slurm_gres_built"]
    assert built[0]["path"] is None and json.loads(json.dumps(built[0]["path"])) is None
