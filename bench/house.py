"""Benchmark: gpud before and after a change of its structure, in the same run: idle CPU and RSS, and
GET /v1/gpus against a bare aiohttp app serving the same bytes.

Usage: python bench/house.py [--before REV] [--idle-seconds 20] [--seconds 2] [--rounds 3]

Checks REV (default: the commit before issue 41's first) out into a temporary git worktree and runs
`gpud serve` from it and from this tree, one after the other, on the same simulated DGX A100 with 56 MIG
devices. For each: CPU (percent of one core) and RSS idle over --idle-seconds after start-up, then GET
/v1/gpus at 16 keep-alive connections in alternating rounds with a bare aiohttp app answering the very
same bytes (bench/api.py's client and baseline). Start-up CPU is the process's CPU time until SETTLE_S after
its first answer; idle is measured after it. Prints each figure and the ratios after/before; target: no
regression (throughput ratio ≥ 0.95, RSS and CPU ratios ≤ 1.05, beyond noise).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from api import _fetch_body, measure
from health import process_cost

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.simulated_gpud import wait_until_listening  # noqa: E402
from gpud.nvml.sim import SimulatedNvml  # noqa: E402
from gpud.nvml.sim.scenarios import fill_with_gpu_instances  # noqa: E402

BEFORE = "53f1c3e"  # main before issue 41 (the house, second round)
CONNECTIONS = 16
SETTLE_S = 5.0
GIT_TIMEOUT_S = 120  # a checkout of the whole tree


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far (user and system), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gpud(tree: Path, workdir: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """`gpud serve` from tree (its own gpud package) on a copy of the prepared simulated node, in a directory
    of its own: a simulated node's CDI spec and NFD file go beside its state, and two gpuds would rewrite
    each other's."""
    node = workdir / name
    node.mkdir()
    sim_state, sock = node / "sim.json", node / "g.sock"
    shutil.copy(workdir / "sim.json", sim_state)
    proc = subprocess.Popen([sys.executable, "-m", "gpud", "serve", "--simulate", "dgx-a100", "--sim-state",
                             str(sim_state), "--state-dir", str(node / "state"), "--socket", str(sock),
                             "--log-level", "error"], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                            stdout=subprocess.DEVNULL)
    wait_until_listening(sock, proc)
    return proc, sock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the revision to compare with")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one throughput measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median kept)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gh", dir="/tmp"))  # short: socket paths hold 108 bytes
    before_tree = workdir / "tree"  # REV checked out
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(before_tree), args.before],
                   check=True, timeout=GIT_TIMEOUT_S)
    sim = SimulatedNvml("dgx-a100", workdir / "sim.json")
    sim.nvmlInit()
    mig_devices = fill_with_gpu_instances(sim, sim.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    sim.nvmlShutdown()
    procs: list[subprocess.Popen] = []
    try:
        servers, idle, started = {}, {}, {}
        for name, tree in (("before", before_tree), ("after", REPO)):
            proc, sock = _gpud(tree, workdir, name)
            procs.append(proc)
            body = asyncio.run(_fetch_body(str(sock)))
            time.sleep(SETTLE_S)  # past start-up: the first inventory, checks, CDI spec and NFD file
            started[name] = cpu_seconds(proc.pid)
            idle[name] = process_cost(proc.pid, args.idle_seconds)
            servers[name] = sock
        (workdir / "body.json").write_bytes(body)
        bare = subprocess.Popen([sys.executable, str(REPO / "bench" / "bare_server.py"), str(workdir / "b.sock"),
                                 str(workdir / "body.json")], stdout=subprocess.DEVNULL)
        procs.append(bare)
        wait_until_listening(workdir / "b.sock", bare)
        servers["bare"] = workdir / "b.sock"
        runs: dict[str, list[float]] = {name: [] for name in servers}
        for _ in range(args.rounds):
            for name, sock in servers.items():
                runs[name].append(asyncio.run(measure(str(sock), CONNECTIONS, args.seconds))["rps"])
        rps = {name: statistics.median(values) for name, values in runs.items()}
        print(f"dgx-a100, {mig_devices} MIG devices; before = {args.before}, after = this tree")
        print(f"{'':>8} {'start CPU s':>11} {'idle CPU %':>10} {'RSS MB':>8} {'req/s':>9} {'÷ bare':>7}")
        for name in ("before", "after"):
            cpu, rss = idle[name]
            print(f"{name:>8} {started[name]:>11.2f} {cpu:>10.2f} {rss:>8.1f} {rps[name]:>9.0f} "
                  f"{rps[name] / rps['bare']:>7.3f}")
        print(f"{'bare':>8} {'':>11} {'':>10} {'':>8} {rps['bare']:>9.0f}")
        throughput = (rps["after"] / rps["bare"]) / (rps["before"] / rps["bare"])
        rss_ratio = idle["after"][1] / idle["before"][1]
        cpu_ratio = idle["after"][0] / max(idle["before"][0], 0.01)
        start_ratio = started["after"] / started["before"]
        print(f"after/before: GET /v1/gpus (each ÷ bare) {throughput:.3f}, RSS {rss_ratio:.3f}, "
              f"idle CPU {cpu_ratio:.3f}, start-up CPU {start_ratio:.3f}")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before_tree)], check=False,
                       timeout=GIT_TIMEOUT_S)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
