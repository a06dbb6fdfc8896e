"""Benchmark: root's GET /healthz while a reader floods a read route (issue 20 item 4).

Usage: python bench/read_flood.py [--seconds S] [--baseline-seconds S] [--routes /metrics,/v1/gpus,...]

Starts gpud (run this as root) on a simulated DGX A100 with 56 MIG devices (7× 1g.5gb per GPU),
its socket given to a group of readers. A reader (a uid with that group and no other, not an
admin) floods each route in turn with 64 keep-alive connections, each sending its next request as
soon as the last is answered; meanwhile root asks /healthz every 10 ms on a connection of its own.
Prints root's /healthz p50 and max unloaded (the baseline, in the same run) and under each flood,
and the flood's own requests/s. Target: p50 <= 20 ms and max <= 100 ms under every flood.
"""

from __future__ import annotations

import argparse
import asyncio
import grp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.api import _fetch_body  # noqa: E402
from bench.simulated_gpud import wait_until_listening  # noqa: E402
from gpud.nvml.sim import SimulatedNvml  # noqa: E402
from gpud.nvml.sim.scenarios import fill_with_gpu_instances  # noqa: E402

READERS = "gpudt-readers"  # the test suite's readers' group (tests/helpers.py)
READER_UID = 60061  # a uid without an account: only the group it is given
CONNECTIONS = 64
ROUTES = ("/metrics", "/v1/gpus", "/v1/health", "/v1/mig")
TARGET_P50_MS, TARGET_MAX_MS = 20.0, 100.0
# The reader's process, under the system interpreter: floods one route until its stdin closes, then
# prints how many answers it had.
FLOODER = r"""
import asyncio, sys
path, route, connections = sys.argv[1], sys.argv[2], int(sys.argv[3])
request = f"GET {route} HTTP/1.1\r\nHost: gpud\r\n\r\n".encode()
answers = [0]
async def one(stop):
    reader, writer = await asyncio.open_unix_connection(path)
    while not stop.is_set():
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        await reader.readexactly(length)
        answers[0] += 1
    writer.close()
async def main():
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), stop.set)
    print("flooding", flush=True)
    await asyncio.gather(*(one(stop) for _ in range(connections)))
    print(answers[0], flush=True)
asyncio.run(main())
"""


async def probe_healthz(path: str, seconds: float) -> list[float]:
    """Root's /healthz every 10 ms on one keep-alive connection: each answer's latency in ms."""
    reader, writer = await asyncio.open_unix_connection(path)
    latencies, clock = [], time.perf_counter
    until = clock() + seconds
    try:
        while clock() < until:
            started = clock()
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: gpud\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            if not head.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"/healthz answered {head.split(b' ')[1].decode()}")
            latencies.append((clock() - started) * 1000)
            await asyncio.sleep(0.01)
    finally:
        writer.close()
    return latencies


async def under_flood(path: str, route: str, seconds: float) -> tuple[list[float], float]:
    flooder = await asyncio.create_subprocess_exec(
        "/usr/bin/python3", "-c", FLOODER, path, route, str(CONNECTIONS), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, user=READER_UID, group=grp.getgrnam(READERS).gr_gid, extra_groups=[])
    try:
        assert await asyncio.wait_for(flooder.stdout.readline(), 20) == b"flooding\n"
        started = time.perf_counter()
        latencies = await probe_healthz(path, seconds)
        flooder.stdin.write(b"stop\n")
        answers = int(await asyncio.wait_for(flooder.stdout.readline(), 30))
        return latencies, answers / (time.perf_counter() - started)
    finally:
        if flooder.returncode is None:
            flooder.kill()
        await asyncio.wait_for(flooder.wait(), 30)


def summary(latencies: list[float]) -> tuple[float, float]:
    ordered = sorted(latencies)
    return ordered[len(ordered) // 2], ordered[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each flood")
    parser.add_argument("--baseline-seconds", type=float, default=5.0, help="length of the unloaded measurement")
    parser.add_argument("--routes", default=",".join(ROUTES), help="the routes flooded, one after another")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the flood comes from another user")
    subprocess.run(["groupadd", "-f", READERS], check=True, timeout=60)

    workdir = Path(tempfile.mkdtemp(prefix="gf", dir="/tmp"))
    workdir.chmod(0o755)  # the reader reaches the socket; its mode and group decide the rest
    sim_state, sock, config = workdir / "sim.json", workdir / "g.sock", workdir / "gpud.yaml"
    sim = SimulatedNvml("dgx-a100", sim_state)
    sim.nvmlInit()
    mig_devices = fill_with_gpu_instances(sim, sim.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    sim.nvmlShutdown()
    config.write_text(f"api:\n  group: {READERS}\n")
    gpud = subprocess.Popen([sys.executable, "-m", "gpud", "serve", "--simulate", "dgx-a100", "--sim-state",
                             str(sim_state), "--socket", str(sock), "--config", str(config), "--log-level", "error"],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
    try:
        wait_until_listening(sock, gpud)
        asyncio.run(_fetch_body(str(sock)))  # gpud has read its GPUs
        print(f"root's GET /healthz under a reader's flood: dgx-a100, {mig_devices} MIG devices, "
              f"{CONNECTIONS} connections, {args.seconds:g} s per route")
        baseline = summary(asyncio.run(probe_healthz(str(sock), args.baseline_seconds)))
        print(f"{'unloaded':<22} p50 {baseline[0]:7.2f} ms  max {baseline[1]:7.2f} ms")
        worst_p50 = worst_max = 0.0
        for route in args.routes.split(","):
            latencies, rate = asyncio.run(under_flood(str(sock), route, args.seconds))
            p50, peak = summary(latencies)
            worst_p50, worst_max = max(worst_p50, p50), max(worst_max, peak)
            print(f"{'flood GET ' + route:<22} p50 {p50:7.2f} ms  max {peak:7.2f} ms  "
                  f"(n={len(latencies)}; p50 {p50 / baseline[0]:.1f}× unloaded; flood {rate:.0f} req/s)")
        passed = worst_p50 <= TARGET_P50_MS and worst_max <= TARGET_MAX_MS
        print(f"worst p50 {worst_p50:.2f} ms (target <= {TARGET_P50_MS:g}), worst max {worst_max:.2f} ms "
              f"(target <= {TARGET_MAX_MS:g}): {'PASS' if passed else 'FAIL'}")
    finally:
        gpud.terminate()
        gpud.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
