"""Benchmark: what GPM's profiling metrics add to a health pass, on a simulated HGX H100 (8 GPUs).

Usage: python bench/profiling.py [--rounds 30] [--mig]

gpud runs in this process on a simulated HGX H100 (its own loops slowed down so they do not interfere).
Each round times one health pass as the health loop takes it (health.check_once: every GPU's readings)
and the same pass followed by one GPM pass (one nvmlGpmSampleGet and one nvmlGpmMetricsGet per GPU, and
per GPU instance), both through the NVML thread as gpud runs them. Prints the medians over the rounds
and the ratio with / without. With --mig every GPU is in MIG mode with seven 1g.10gb instances first
(8 GPUs + 56 instances to sample).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pynvml  # noqa: E402

from gpud.base.logs import configure_log_level  # noqa: E402
from gpud.config import Config  # noqa: E402
from gpud.daemon import Daemon  # noqa: E402
from gpud.nvml.sim import SimulatedNvml  # noqa: E402
from gpud.nvml.sim.scenarios import fill_with_gpu_instances  # noqa: E402


async def measure(workdir: Path, rounds: int) -> tuple[list[float], list[float], int]:
    config = Config().with_overrides(**{
        "api.socket": str(workdir / "g.sock"), "simulate": "hgx-h100", "sim_state": str(workdir / "sim.json"),
        "state_dir": str(workdir / "state"), "inventory.refresh_interval_s": 3600.0,
        "health.check_interval_s": 3600.0, "health.profiling_interval_s": 3600.0})
    daemon = Daemon(config)
    await daemon.start()
    try:
        health = daemon.health
        while health.inventory.current is None:
            await asyncio.sleep(0.05)
        await health.profiling.sample_once()  # the first samples: from here on each pass gives metrics
        without, with_gpm = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            await health.check_once()
            without.append(time.perf_counter() - started)
            started = time.perf_counter()
            await health.check_once()
            await health.profiling.sample_once()
            with_gpm.append(time.perf_counter() - started)
        return without, with_gpm, len(health.profiling.profiles)
    finally:
        await daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--mig", action="store_true", help="every GPU in MIG mode, seven 1g.10gb instances each")
    args = parser.parse_args()
    configure_log_level("error")
    with tempfile.TemporaryDirectory(prefix="gbp", dir="/tmp") as directory:
        workdir = Path(directory)
        if args.mig:
            sim = SimulatedNvml("hgx-h100", workdir / "sim.json")
            sim.nvmlInit()
            fill_with_gpu_instances(sim, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
            sim.nvmlShutdown()
        without, with_gpm, devices = asyncio.run(measure(workdir, args.rounds))
    plain, profiled = statistics.median(without) * 1000, statistics.median(with_gpm) * 1000
    print(f"health pass on a simulated HGX H100 ({devices} devices profiled), {args.rounds} rounds:")
    print(f"without GPM: median {plain:.2f} ms; with GPM: median {profiled:.2f} ms; "
          f"ratio with/without {profiled / plain:.2f}")


if __name__ == "__main__":
    main()
