"""Benchmark: what a lost GPU costs gpud, against the same daemon with every GPU answering.

Usage: python bench/lost_gpu.py [--seconds 10] [--preset dgx-a100] [--how unknown|is-lost]

Runs `gpud serve --simulate PRESET` twice, one after the other: once as is, once with GPU 0 lost
(POST /v1/sim/gpu-lost). A real driver answers every event wait at once with GPU_IS_LOST while a
lost GPU stays registered in the event set, so a listener that only loops spins a core; gpud
rebuilds the set without the lost GPU. The figure is gpud's CPU time (user + system, from /proc)
over --seconds, in percent of one core. Target with the lost GPU: < 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.simulated_gpud import wait, wait_until_listening  # noqa: E402
from gpud.client import Client  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_percent(pid: int, seconds: float) -> float:
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - started) * 100


def measure(preset: str, seconds: float, lose: str | None) -> float:
    """gpud's CPU use in percent of one core, with GPU 0 lost the `lose` way (None: not lost)."""
    workdir = Path(tempfile.mkdtemp(prefix="gl", dir="/tmp"))
    sock = workdir / "g.sock"
    gpud = subprocess.Popen([sys.executable, "-m", "gpud", "serve", "--simulate", preset, "--sim-state",
                             str(workdir / "sim.json"), "--state-dir", str(workdir / "state"), "--socket", str(sock),
                             "--log-level", "error"], cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        client = Client(sock, timeout=10)
        wait_until_listening(sock, gpud)
        wait(lambda: client.request("GET", "/healthz", ok_statuses=(503,))[0] == 200, 30, "gpud healthy")
        if lose:
            client.request("POST", "/v1/sim/gpu-lost", {"gpu": 0, "how": lose})
        time.sleep(2.0)  # past the loss: the inventory refresh, the event set rebuilt
        return cpu_percent(gpud.pid, seconds)
    finally:
        gpud.terminate()
        gpud.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--preset", default="dgx-a100")
    parser.add_argument("--how", default="unknown", choices=("unknown", "is-lost"))
    args = parser.parse_args()
    healthy = measure(args.preset, args.seconds, None)
    lost = measure(args.preset, args.seconds, args.how)
    print(json.dumps({"preset": args.preset, "seconds": args.seconds, "how": args.how,
                      "cpu_percent_all_gpus_answer": round(healthy, 2),
                      "cpu_percent_gpu0_lost": round(lost, 2), "target_percent": 5}))
    print(f"gpud on {args.preset} over {args.seconds:g} s: CPU {healthy:.2f}% of one core with every GPU "
          f"answering, {lost:.2f}% with GPU 0 lost ({args.how}) (target < 5%)")


if __name__ == "__main__":
    main()
