"""Benchmark: how long the `gpud` commands an operator types (and Slurm runs before each job) take, as
ratios against `python -c pass` run by the same interpreter in the same run.

Usage: python bench/cli_startup.py [--runs N]

Each command is a fresh process, as typed: the `gpud` script installed beside this interpreter (the
console script of `pip install`), or `python -m gpud` where there is none. The client commands ask a
`gpud serve` on a simulated DGX A100 (8 GPUs, MIG off); `gpud slurm health` runs against it with a
stand-in scontrol (a /bin/sh script printing one `scontrol show node -o` line of Slurm 22.05, node IDLE,
so nothing is drained). Each round runs the baseline, the floor (`python -c "import argparse, json,
socket"`: what any command line asking a socket for JSON imports) and every command once, in turn; the
figure is the median of N rounds. Goal (issue 39): each client command and `slurm health` <= 2x the baseline,
`gpud --help` <= 3x. The machine is shared and noisy: the ratios are what count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.simulated_gpud import simulated_gpud  # noqa: E402

NODE = "n1"
SHOW_NODE = ("NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=2 Gres=gpu:8 NodeAddr=127.0.0.1 "
             "NodeHostName=n1 Version=22.05.8 State=IDLE Partitions=gpu Reason=(null)")
GOALS = {"--help": 3.0}  # every other command: 2.0
# What any Python command line that asks gpud's socket for JSON imports, gpud or not: a floor, printed
# beside the baseline to tell the interpreter's share from gpud's.
FLOOR = "import argparse, json, socket"
COMMAND_LIMIT_S = 60  # each command takes well under a second: one that hangs ends the benchmark, saying so


def gpud_command() -> list[str]:
    script = Path(sys.executable).parent / "gpud"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpud"]


def commands(sock: Path, scontrol: Path) -> dict[str, list[str]]:
    health = ["slurm", "health", "--socket", str(sock), "--node-name", NODE, "--scontrol", str(scontrol)]
    return {"status": ["status", "--socket", str(sock)], "gpus": ["gpus", "--socket", str(sock)],
            "health": ["health", "--socket", str(sock)], "slurm health --dry-run": [*health, "--dry-run"],
            "slurm health --prolog": [*health, "--prolog"], "--help": ["--help"]}


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd="/",
                              timeout=COMMAND_LIMIT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{' '.join(argv)} did not finish within {COMMAND_LIMIT_S} s") from None
    elapsed = time.perf_counter() - started
    if done.returncode not in (0, 1):  # 1: a problem reported (a command's answer), not a failure to run
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="rounds; each figure is their median")
    options = parser.parse_args()
    gpud = gpud_command()
    with tempfile.TemporaryDirectory(prefix="gc", dir="/tmp") as scratch, simulated_gpud() as (_, sock):
        scontrol = Path(scratch) / "scontrol"
        scontrol.write_text(f"#!/bin/sh\necho '{SHOW_NODE}'\n")
        scontrol.chmod(0o755)
        # SLURM_JOB_GPUS: the job's GPUs as slurmd gives a Prolog; -I-less: the interpreter starts as a user's does
        env = {**os.environ, "SLURM_JOB_GPUS": "0,1", "COLUMNS": "100"}
        runs: dict[str, list[float]] = {"python -c pass": [], FLOOR: []}
        todo = commands(sock, scontrol)
        for argv in todo.values():  # once each, unmeasured: the answer is known good and bytecode is written
            timed([*gpud, *argv], env)
        for _ in range(options.runs):
            runs["python -c pass"].append(timed([sys.executable, "-c", "pass"], env))
            runs[FLOOR].append(timed([sys.executable, "-c", FLOOR], env))
            for name, argv in todo.items():
                runs.setdefault(name, []).append(timed([*gpud, *argv], env))
    baseline = statistics.median(runs["python -c pass"])
    print(f"gpud run as: {' '.join(gpud)}; {options.runs} rounds, medians")
    print(f"{'command':<32}{'median ms':>10}{'max ms':>9}{'ratio':>8}{'goal':>7}")
    for name, times in runs.items():
        ratio = statistics.median(times) / baseline
        goal = "" if name in ("python -c pass", FLOOR) else f"{GOALS.get(name, 2.0):.0f}x"
        print(f"{name:<32}{statistics.median(times) * 1000:>10.1f}{max(times) * 1000:>9.1f}{ratio:>7.2f}x{goal:>7}")


if __name__ == "__main__":
    main()
