"""Benchmark: scrapes of the TCP metrics listener from 127.0.0.1 while a local user holds and re-takes
the per-address share of trickling connections from 127.0.0.1-9 (issue 38, defect 1).

Usage: python bench/metrics_lockout.py [--seconds S] [--interval S]   (as root: the flood is another user's)

Starts gpud on a simulated DGX A100 with metrics.listen on 127.0.0.1. A user with no gpud group
(a uid without an account) holds 8 connections from each of 127.0.0.1-9, trickles a byte of a request
head on each every 0.2 s and connects again as soon as one is closed (tests/test_prometheus.py's
TRICKLER). Meanwhile a scraper on 127.0.0.1 scrapes as Prometheus does its first scrape: a new
connection, the request in one write. Prints the scrapes answered and their latency p50/max, unloaded
(the baseline, in the same run) and under the flood, as ratios, and the flood's reconnect rate.
Target: >= 99% of scrapes answered under the flood.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from bench.simulated_gpud import simulated_gpud  # noqa: E402
from test_prometheus import TRICKLER  # noqa: E402

FLOODER_UID = 60071
PER_ADDRESS = 8  # gpud.api.metrics_listener.MAX_CONNECTIONS_PER_ADDRESS
TARGET_ANSWERED = 0.99


async def scrape(host: str, port: int) -> float | None:
    """A first scrape's latency in ms, or None when it was not answered whole."""
    started = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    except (OSError, asyncio.TimeoutError):
        return None
    whole = answer.startswith(b"HTTP/1.1 200") and b"gpud_collector_errors_total" in answer
    return (time.perf_counter() - started) * 1000 if whole else None


async def scrapes(host: str, port: int, seconds: float, interval: float) -> list[float | None]:
    results, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        results.append(await scrape(host, port))
        await asyncio.sleep(interval)
    return results


async def under_flood(host: str, port: int, seconds: float, interval: float) -> tuple[list[float | None], dict, float]:
    flooder = await asyncio.create_subprocess_exec(
        "/usr/bin/python3", "-c", TRICKLER, str(port), str(PER_ADDRESS), "1", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, user=FLOODER_UID, group=FLOODER_UID, extra_groups=[])
    try:
        assert await asyncio.wait_for(flooder.stdout.readline(), 20) == b"started\n"
        await asyncio.sleep(1.0)  # its connections take every slot first
        started = time.monotonic()
        results = await scrapes(host, port, seconds, interval)
        elapsed = time.monotonic() - started
    finally:
        flooder.stdin.close()
        stats = json.loads(await asyncio.wait_for(flooder.stdout.readline(), 20))
        await asyncio.wait_for(flooder.wait(), 20)
    return results, stats, elapsed + 1.0


def summary(results: list[float | None]) -> tuple[int, int, float, float]:
    answered = sorted(latency for latency in results if latency is not None)
    if not answered:
        return 0, len(results), float("nan"), float("nan")
    return len(answered), len(results), answered[len(answered) // 2], answered[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each measurement")
    parser.add_argument("--interval", type=float, default=0.1, help="pause between scrapes")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the flood comes from another user")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="gl", dir="/tmp") as workdir:
        config = Path(workdir) / "gpud.yaml"
        config.write_text(f"metrics:\n  listen: 127.0.0.1:{port}\n")
        with simulated_gpud("dgx-a100", config):
            print(f"first scrapes of 127.0.0.1:{port}/metrics from 127.0.0.1, one every {args.interval:g} s, "
                  f"{args.seconds:g} s each")
            base = summary(asyncio.run(scrapes("127.0.0.1", port, args.seconds, args.interval)))
            print(f"{'unloaded':<10} answered {base[0]}/{base[1]}  p50 {base[2]:7.2f} ms  max {base[3]:7.2f} ms")
            results, stats, elapsed = asyncio.run(under_flood("127.0.0.1", port, args.seconds, args.interval))
    flood = summary(results)
    share = flood[0] / flood[1] if flood[1] else 0.0
    print(f"{'flood':<10} answered {flood[0]}/{flood[1]}  p50 {flood[2]:7.2f} ms  max {flood[3]:7.2f} ms  "
          f"(p50 {flood[2] / base[2]:.1f}× unloaded, max {flood[3] / base[3]:.1f}×)")
    print(f"the flood: {stats['connects']} connects in {elapsed:.0f} s ({stats['connects'] / elapsed:.0f}/s), "
          f"{stats['closed']} of its connections closed by gpud")
    print(f"answered {share:.1%} under the flood (target >= {TARGET_ANSWERED:.0%}): "
          f"{'PASS' if share >= TARGET_ANSWERED else 'FAIL'}")

if __name__ == "__main__":
    main()
