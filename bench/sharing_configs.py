"""Benchmark: /healthz while a 198 KB sharing config is chosen every second (issue 38, defect 3).

Usage: python bench/sharing_configs.py [--seconds S]

Starts gpud on a simulated DGX A100 with sharing.configs_dir holding a small config and a valid one of
some 198 KB (GPUs time-sliced, and a long list of IMEX channels). Asks /healthz every 10 ms on a
connection of its own, first idle (the baseline, in the same run), then while another client chooses
the large config and the small one in turn, one PUT /v1/sharing/config a second. Prints /healthz p50
and max of both, as ratios, and how long one read of the large file takes here (what every client
waited for on each PUT when it was read on the event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.simulated_gpud import simulated_gpud  # noqa: E402
from bench.read_flood import probe_healthz, summary  # noqa: E402
from gpud.sharing.config import check_sharing  # noqa: E402

SMALL = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
LARGE = SMALL + "imex:\n  channelIDs:\n" + "".join(f"  - {index}\n" for index in range(20_500))


async def choose(path: str, name: str) -> None:
    body = json.dumps({"name": name}).encode()
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(b"PUT /v1/sharing/config HTTP/1.1\r\nHost: gpud\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    answer = await reader.read()
    writer.close()
    if not answer.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"PUT /v1/sharing/config answered {answer[:200]!r}")


async def under_puts(path: str, seconds: float) -> tuple[list[float], int]:
    prober = asyncio.ensure_future(probe_healthz(path, seconds))
    puts, until = 0, time.monotonic() + seconds
    while time.monotonic() < until:
        started = time.monotonic()
        await choose(path, "large" if puts % 2 == 0 else "small")
        puts += 1
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    return await prober, puts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each measurement")
    args = parser.parse_args()
    started = time.perf_counter()
    check_sharing(LARGE)
    one_read_ms = (time.perf_counter() - started) * 1000
    with tempfile.TemporaryDirectory(prefix="gs", dir="/tmp") as workdir:
        configs, config = Path(workdir) / "configs", Path(workdir) / "gpud.yaml"
        configs.mkdir()
        (configs / "small").write_text(SMALL)
        (configs / "large").write_text(LARGE)
        config.write_text(f"sharing:\n  configs_dir: {configs}\n  default_config: small\n")
        with simulated_gpud("dgx-a100", config) as (_, sock):
            time.sleep(2)  # gpud has read its GPUs
            print(f"/healthz every 10 ms, {args.seconds:g} s each; the large config is {len(LARGE)} bytes, one "
                  f"read of it {one_read_ms:.0f} ms here")
            idle = summary(asyncio.run(probe_healthz(str(sock), args.seconds)))
            print(f"{'idle':<28} p50 {idle[0]:7.2f} ms  max {idle[1]:7.2f} ms")
            latencies, puts = asyncio.run(under_puts(str(sock), args.seconds))
    loaded = summary(latencies)
    print(f"{'a config chosen every 1 s':<28} p50 {loaded[0]:7.2f} ms  max {loaded[1]:7.2f} ms  "
          f"({puts} PUTs; p50 {loaded[0] / idle[0]:.1f}× idle, max {loaded[1] / idle[1]:.1f}× idle, "
          f"max {loaded[1] / one_read_ms:.2f}× one read of the file)")

if __name__ == "__main__":
    main()
