"""Benchmark: how fast an XID reaches /v1/watch and /v1/health, and what the monitor costs idle.

Usage: python bench/health.py [--events 200] [--idle-seconds 60]

Starts gpud on a simulated DGX A100 (8 GPUs). Latency: for each event, an XID 79 is injected on a
GPU (POST /v1/sim/xid) and the clock runs until the health event arrives on an open /v1/watch
stream, and until GET /v1/health shows the GPU unhealthy; the GPU is then cleared for the next
round. Targets: p99 ≤ 50 ms. Idle cost: gpud's CPU time and RSS over --idle-seconds with nothing
happening, read from /proc. Targets: ≤ 1% of one core, RSS ≤ 80 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import aiohttp
from simulated_gpud import simulated_gpud


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


async def latency(sock: Path, events: int) -> tuple[list[float], list[float]]:
    watch_ms, health_ms = [], []
    connector = aiohttp.UnixConnector(path=str(sock))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        async with http.get("http://localhost/v1/watch?types=health") as stream:
            for n in range(events):
                gpu = n % 8
                started = time.perf_counter()
                async with http.post("http://localhost/v1/sim/xid", json={"gpu": gpu, "xid": 79}) as response:
                    assert response.status == 200
                while True:
                    event = json.loads(await stream.content.readline())
                    if event["type"] == "health" and event["data"]["state"] == "unhealthy":
                        break
                watch_ms.append((time.perf_counter() - started) * 1000)
                while True:
                    async with http.get(f"http://localhost/v1/gpus/{gpu}/health") as response:
                        if (await response.json())["state"] == "unhealthy":
                            break
                health_ms.append((time.perf_counter() - started) * 1000)
                async with http.post(f"http://localhost/v1/health/{gpu}/clear", json={}) as response:
                    assert response.status == 200
                while json.loads(await stream.content.readline())["type"] != "health":
                    pass  # the "healthy again" event of the clear
    return watch_ms, health_ms


def process_cost(pid: int, seconds: float) -> tuple[float, float]:
    """CPU use in percent of one core over `seconds`, and RSS in MB at the end."""
    def cpu_seconds() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    before, started = cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    used = cpu_seconds() - before
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("VmRSS:"))
    return used / (time.monotonic() - started) * 100, rss_kb / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    args = parser.parse_args()
    with simulated_gpud() as (gpud, sock):
        time.sleep(1.0)  # past start-up: the first inventory, the first checks
        cpu, rss = process_cost(gpud.pid, args.idle_seconds)
        print(f"idle on 8 GPUs over {args.idle_seconds:g} s: CPU {cpu:.2f}% of one core (target ≤ 1%), "
              f"RSS {rss:.1f} MB (target ≤ 80 MB)")
        watch_ms, health_ms = asyncio.run(latency(sock, args.events))
        for name, values in (("XID → /v1/watch event", watch_ms), ("XID → /v1/health unhealthy", health_ms)):
            print(f"{name}: n={len(values)} p50 {statistics.median(values):.2f} ms, "
                  f"p99 {percentile(values, 0.99):.2f} ms (target p99 ≤ 50 ms)")

if __name__ == "__main__":
    main()
