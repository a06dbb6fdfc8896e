"""Benchmark: GET /v1/gpus over gpud's Unix socket against a bare aiohttp app serving the same bytes.

Usage: python bench/api.py [--seconds S] [--rounds N]

Starts gpud on a simulated DGX A100 with 56 MIG devices (7× 1g.5gb per GPU) and, beside it, a bare
aiohttp app that answers with the very bytes gpud served. Both are measured in the same run, in
alternating rounds, at 1, 16 and 64 concurrent keep-alive connections, by one light raw-socket
client. Prints requests/s, p50 and p99 latency for each, and gpud's share of the baseline's
throughput (target: ratio ≥ 0.9). Ratios are what count: the machine is shared and noisy.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.simulated_gpud import wait_until_listening  # noqa: E402
from gpud.nvml.sim import SimulatedNvml  # noqa: E402
from gpud.nvml.sim.scenarios import fill_with_gpu_instances  # noqa: E402

REQUEST = b"GET /v1/gpus HTTP/1.1\r\nHost: localhost\r\n\r\n"
CONCURRENCY = (1, 16, 64)


async def _connection(path: str, until: float, latencies: list[float]) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    clock = time.perf_counter
    try:
        while clock() < until:
            started = clock()
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            latencies.append(clock() - started)
    finally:
        writer.close()


async def measure(path: str, connections: int, seconds: float) -> dict:
    latencies: list[float] = []
    started = time.perf_counter()
    await asyncio.gather(*(_connection(path, started + seconds, latencies) for _ in range(connections)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {"rps": len(latencies) / elapsed, "p50_ms": latencies[len(latencies) // 2] * 1000,
            "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000}


async def _fetch_body(path: str) -> bytes:
    for _ in range(600):
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(REQUEST)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        body = await reader.readexactly(length)
        writer.close()
        if head.startswith(b"HTTP/1.1 200"):
            return body
        await asyncio.sleep(0.05)
    raise SystemExit("gpud never served /v1/gpus")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per concurrency (median kept)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gb", dir="/tmp"))
    sim_state, gpud_sock, bare_sock = workdir / "sim.json", workdir / "g.sock", workdir / "b.sock"
    sim = SimulatedNvml("dgx-a100", sim_state)
    sim.nvmlInit()
    mig_devices = fill_with_gpu_instances(sim, sim.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    sim.nvmlShutdown()

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    gpud = subprocess.Popen([sys.executable, "-m", "gpud", "serve", "--simulate", "dgx-a100", "--sim-state",
                             str(sim_state), "--socket", str(gpud_sock), "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL)
    bare = None
    try:
        wait_until_listening(gpud_sock, gpud)
        body = asyncio.run(_fetch_body(str(gpud_sock)))
        (workdir / "body.json").write_bytes(body)
        bare = subprocess.Popen([sys.executable, str(REPO / "bench" / "bare_server.py"), str(bare_sock),
                                 str(workdir / "body.json")], env=env, stdout=subprocess.DEVNULL)
        wait_until_listening(bare_sock, bare)
        print(f"GET /v1/gpus: dgx-a100, {mig_devices} MIG devices, {len(body)} bytes; "
              f"{args.rounds} alternating rounds of {args.seconds:g} s, median kept")
        print(f"{'conns':>5} {'server':>6} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}   ratio (gpud/bare req/s)")
        ratios = []
        for connections in CONCURRENCY:
            results = {"bare": [], "gpud": []}
            for _ in range(args.rounds):
                for name, sock in (("bare", bare_sock), ("gpud", gpud_sock)):
                    results[name].append(asyncio.run(measure(str(sock), connections, args.seconds)))
            medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                       for name, runs in results.items()}
            ratio = medians["gpud"]["rps"] / medians["bare"]["rps"]
            ratios.append(ratio)
            for name in ("bare", "gpud"):
                m = medians[name]
                tail = f"   {ratio:.3f}" if name == "gpud" else ""
                print(f"{connections:>5} {name:>6} {m['rps']:>9.0f} {m['p50_ms']:>8.2f} {m['p99_ms']:>8.2f}{tail}")
        print(f"minimum ratio {min(ratios):.3f} (target ≥ 0.9): {'PASS' if min(ratios) >= 0.9 else 'FAIL'}")
    finally:
        for proc in (gpud, bare):
            if proc is not None:
                proc.terminate()
                proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
