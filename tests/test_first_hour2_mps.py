"""MPS in a new operator's first hour (issue 39): a node without nvidia-cuda-mps-control says so and how
Debian installs it, `gpud reload` and `gpud status` never call it healthy while its MPS daemons are
down, `gpud mps status` fits an 80-column terminal, and `gpud mps quit-all` ends what a gpud left
running, passing over pipe directories whose daemon is gone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, MPS_CONTROL, running_daemons

from gpud.cli import main

# A MIG device's UUID is the widest cell of the table (the README's four daemons on GPU 0's MIG devices).
MIG_UUIDS = ("MIG-ea6d3555-b997-58e0-9b83-3c2e2c83925d", "MIG-d424eacc-a9ea-567e-994d-d20de6bef4a9",
             "MIG-3f9a2a17-771a-5583-b265-3887ca816222", "MIG-d4425d44-21d6-583e-9cd3-02f48d5a4146")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def config_text(tmp: Path, mps_enabled: bool) -> str:
    """The README's root gpud: MPS off at first, then enabled and reloaded. Health's periodic checks
    are an hour apart, so that only what follows MPS itself can tell health a daemon is down."""
    mps = "  enabled: true\n" if mps_enabled else ""
    return (f"mig:\n  layouts_file: {tmp / 'absent.yaml'}\nhealth:\n  check_interval_s: 3600\n"
            f"mps:\n  pipe_root: {tmp / 'mps'}\n  log_root: {tmp / 'mpslog'}\n{mps}")


@pytest.fixture
def without_mps_binary(run_gpud, short_tmp):
    """A simulated 4-GPU node whose PATH has no nvidia-cuda-mps-control (a fresh Debian 12), MPS not yet
    enabled."""
    empty = short_tmp / "bin"
    empty.mkdir()
    config = short_tmp / "gpud.yaml"
    config.write_text(config_text(short_tmp, mps_enabled=False))
    gpud = run_gpud("--simulate", "a30", "--sim-state", str(short_tmp / "sim.json"), "--config", str(config),
                    env={"PATH": str(empty)})
    gpud.wait_healthy()
    gpud.wait_for(lambda: gpud.client.get("/v1/health")["status"] == "healthy", what="a healthy node")
    return gpud, config


def test_reload_and_status_say_mps_is_down_and_why_never_healthy(without_mps_binary, short_tmp, capsys,
                                                                  monkeypatch):
    gpud, config = without_mps_binary
    config.write_text(config_text(short_tmp, mps_enabled=True))
    code, out, _ = run(capsys, "reload", "--socket", str(gpud.socket))
    assert code == 0 and out.startswith("reloaded: 4 GPUs · 0/4 MPS daemons"), out
    assert "healthy" not in out.replace("unhealthy", ""), out  # the verdict is not "healthy"
    assert out.rstrip().endswith("· degraded"), out
    assert "nvidia-cuda-mps-control' is not installed" in out, out  # the reason, on the line

    code, out, _ = run(capsys, "status", "--socket", str(gpud.socket))
    health = next(line for line in out.splitlines() if line.startswith("health:"))
    assert code == 1 and not health.startswith("health:  ok"), out
    assert "MPS daemon gpu0 failed" in out and "not installed" in out, out

    # no MPS, so no exclusive compute mode: other processes keep the GPUs (nvidia-smi(1), -c)
    assert {gpu["compute_mode"] for gpu in gpud.client.get("/v1/gpus")["gpus"]} == {"default"}

    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(capsys, "mps", "status", "--socket", str(gpud.socket))
    assert code == 1
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), out
    assert len(lines) <= 12, out  # a header, four rows, the reason they share (five lines at most), a note
    assert_no_word_broken(out, gpud.client.get("/v1/mps")["error"])
    assert gpud.stop() == 0


def assert_no_word_broken(text: str, *sentences: str) -> None:
    """Every word of each sentence is whole on one line of text."""
    words = {word for line in text.splitlines() for word in line.split()}
    for sentence in sentences:
        missing = [word for word in sentence.split() if word not in words]
        assert not missing, f"broken across lines: {missing}\n{text}"


def test_the_hint_says_how_debian_gets_the_binary_in_both_sources_forms():
    from gpud.mps.control import MpsBinaryMissing, MpsControl, MpsDirectories

    control = MpsControl("/nonexistent/nvidia-cuda-mps-control", MpsDirectories(Path("/p"), Path("/l")), ())
    with pytest.raises(MpsBinaryMissing) as missing:
        control.resolve_binary()
    hint = str(missing.value)
    assert "apt-get install nvidia-cuda-mps" in hint
    assert "Components:" in hint and "/etc/apt/sources.list.d/debian.sources" in hint  # deb822
    assert "deb line" in hint and "/etc/apt/sources.list" in hint  # one-line form
    assert "non-free" in hint and "apt-get update" in hint and "mps.control_binary" in hint
    assert len(hint) <= 300  # two lines of a terminal, at most three


def failed_view(reason: str) -> dict:
    return {"enabled": True, "error": reason, "daemons": [
        {"name": f"gpu0-gi{gi}-ci0", "state": "failed", "pid": None, "restarts": 3,
         "active_thread_percentage": 50.0, "pinned_memory_limit_mib": [8192], "devices": [uuid],
         "last_error": reason} for gi, uuid in zip((2, 3, 9, 10), MIG_UUIDS)]}


def test_the_table_fits_80_columns_with_its_reasons_below_and_whole_words():
    from gpud.cli.mps import status_text

    reason = ("the MPS control binary 'nvidia-cuda-mps-control' is not installed or not on PATH "
              "(/a/path/longer/than/the/why/column/would/be/if/it/stayed/in/the/table)")
    text = status_text(failed_view(reason), 80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    assert len(lines) <= 10, text
    assert lines[0].split() == ["NAME", "STATE", "PID", "RESTARTS", "THREADS", "%", "PINNED", "MiB", "WHY"]
    assert [line.split()[-1] for line in lines[1:5]] == ["1"] * 4  # each row points at its reason
    assert text.count("is not installed") == 1  # the reason four daemons share, once
    assert_no_word_broken(text, reason)
    assert "DEVICES" in text and "--json" in text  # where the devices left out are


def test_a_wide_terminal_keeps_every_column_and_each_reason_on_its_row():
    from gpud.cli.mps import status_text

    reason = "the MPS control binary 'x' is not installed"
    text = status_text(failed_view(reason), 400)
    header, *rows = text.splitlines()
    assert header.split()[-2:] == ["DEVICES", "WHY"] and len(rows) == 4
    assert all(row.endswith(reason) and MIG_UUIDS[0][:8] in text for row in rows)


def test_running_daemons_fill_no_why_column_and_drop_devices_only_where_they_do_not_fit():
    from gpud.cli.mps import status_text

    view = failed_view("")
    for daemon, pid in zip(view["daemons"], (19804, 19818, 19832, 19846)):
        daemon.update(state="running", pid=pid, restarts=0, last_error=None)
    view["error"] = None
    wide = status_text(view, 120).splitlines()
    assert len(wide) == 5 and wide[1].split()[-1] == MIG_UUIDS[0]
    narrow = status_text(view, 80).splitlines()
    assert len(narrow) == 6 and all(len(line) <= 80 for line in narrow)
    assert narrow[1].split() == ["gpu0-gi2-ci0", "running", "19804", "0", "50", "8192"]


# -- gpud mps quit-all ------------------------------------------------------------------------------


@pytest.mark.skipif(MPS_CONTROL is None, reason="nvidia-cuda-mps-control is not installed")
def test_quit_all_ends_what_gpud_left_and_passes_over_daemons_already_gone(run_gpud, mps_tmp, capsys):
    config = mps_tmp / "gpud.yaml"
    config.write_text(config_text(mps_tmp, mps_enabled=True))
    gpud = run_gpud("--simulate", "a30", "--sim-state", str(mps_tmp / "sim.json"), "--config", str(config))
    gpud.wait_healthy()
    daemons = running_daemons(gpud, 4)
    assert gpud.stop() == 0
    gone = daemons[3]  # quit before quit-all: its pipe directory stays, with its control socket
    subprocess.run([MPS_CONTROL], input=b"quit\n", env={"CUDA_MPS_PIPE_DIRECTORY": gone["pipe_directory"]},
                   check=True, timeout=30)
    assert Path(gone["pipe_directory"], "control").exists()

    code, out, err = run(capsys, "mps", "quit-all", "--config", str(config))
    assert code == 0, err
    assert out.splitlines() == [f"quit: {d['name']}" for d in daemons[:3]] + [f"not running: {gone['name']}"]
    assert "Cannot find MPS control daemon process" not in out + err
    code, out, err = run(capsys, "mps", "quit-all", "--config", str(config))  # again: nothing left to end
    assert code == 0 and out.splitlines() == [f"not running: {d['name']}" for d in daemons], out + err


def test_the_readme_ends_the_root_gpuds_mps_daemons_with_quit_all():
    readme = (REPO / "README.md").read_text()
    assert "echo quit | CUDA_MPS_PIPE_DIRECTORY" not in readme
    assert re.search(r"^# gpud mps quit-all --config \$D/gpud\.yaml$", readme, re.M)
    assert re.search(r"^  pipe_root: \$D/mps$", readme, re.M)  # where quit-all looks, from the config

