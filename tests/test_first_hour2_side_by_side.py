"""Two simulated nodes of one user, side by side: each gpud (its own --state-dir, sockets in one directory)
keeps its own CDI spec and NFD feature file, under its state directory, and neither rewrites the other's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import REPO, json_lines, until

from gpud.client import Client, DaemonUnreachable
from gpud.config import parse_config
from gpud.kept_writer import RECHECK_S


def serve(tmp: Path, name: str, preset: str) -> tuple[subprocess.Popen, Path]:
    """`gpud serve --simulate PRESET --state-dir tmp/NAME --socket tmp/NAME.sock`, its JSON log in tmp/NAME.log:
    both sockets in tmp, the runtime directory the two share."""
    log = tmp / f"{name}.log"
    command = [sys.executable, "-m", "gpud", "serve", "--simulate", preset, "--state-dir", str(tmp / name),
               "--socket", str(tmp / f"{name}.sock"), "--sim-state", str(tmp / f"{name}-sim.json"),
               "--log-format", "json"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    return process, log


def events(log: Path) -> list[dict]:
    return json_lines(log.read_text())


def written_paths(log: Path, event: str) -> set[str]:
    return {e["path"] for e in events(log) if e.get("event") == event}


def test_a_simulated_nodes_files_follow_its_state_directory():
    config = parse_config("simulate: dgx-a100\nstate_dir: /srv/a\napi:\n  socket: /run/x/a.sock\n")
    assert (config.cdi_spec_path, config.nfd_features_path) == (Path("/srv/a/cdi"), Path("/srv/a/nfd/gpud"))
    explicit = config.with_overrides(**{"cdi.spec_dir": "/srv/cdi", "nfd.features_file": "/srv/nfd"})
    assert (explicit.cdi_spec_path, explicit.nfd_features_path) == (Path("/srv/cdi"), Path("/srv/nfd"))
    real = parse_config("state_dir: /srv/a\n")  # a real node's defaults are the host's, for its runtimes and NFD
    assert (str(real.cdi_spec_path), str(real.nfd_features_path)) == (
        "/var/run/cdi", "/etc/kubernetes/node-feature-discovery/features.d/gpud")


def test_two_simulated_nodes_of_one_user_keep_their_own_files(short_tmp):
    started = [serve(short_tmp, "a", "A100-SXM4-40GB:2"), serve(short_tmp, "b", "t4")]
    try:
        for name in ("a", "b"):
            client = Client(short_tmp / f"{name}.sock", timeout=10)
            until(lambda: _healthy(client), timeout=60, what=f"gpud {name} healthy")
        files = {name: (short_tmp / name / "cdi" / "gpud-gpu.json", short_tmp / name / "nfd" / "gpud")
                 for name in ("a", "b")}
        until(lambda: all(path.exists() for pair in files.values() for path in pair), timeout=20,
              what="both gpuds' CDI specs and NFD files written")
        before = {path: path.stat().st_ino for pair in files.values() for path in pair}
        time.sleep(3 * RECHECK_S + 1)  # fixed time: three recheck periods, in which a clobbered file is noticed
        for (_, log), name in zip(started, ("a", "b")):
            said = [e for e in events(log) if "changed_behind_gpud" in e.get("event", "")]
            assert said == [], said
            assert written_paths(log, "cdi_spec_written") == {str(files[name][0])}
            assert written_paths(log, "nfd_file_written") == {str(files[name][1])}
        assert {path: path.stat().st_ino for path in before} == before  # no file rewritten since
        assert not (short_tmp / "cdi").exists() and not (short_tmp / "nfd").exists()
        specs = {name: json.loads(files[name][0].read_text()) for name in files}
        assert len(specs["a"]["devices"]) != len(specs["b"]["devices"])  # two nodes, each its own spec
    finally:
        for process, _ in started:
            process.send_signal(signal.SIGTERM)
        for process, _ in started:
            process.wait(30)


def _healthy(client: Client) -> bool:
    try:
        return client.request("GET", "/healthz", ok_statuses=(503,))[0] == 200
    except DaemonUnreachable:  # not listening yet
        return False
