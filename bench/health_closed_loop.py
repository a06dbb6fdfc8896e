"""Benchmark: the cost of one health pass with 8 GPUs, 8 InfiniBand HCAs and the kernel log, and the
latency from a kernel-log XID line to the watch stream.

Usage: python bench/health_closed_loop.py [--passes 200] [--xids 40] [--kmsg-records 20000]

gpud runs in this process on a simulated HGX H100 (8 GPUs, driver 580: the recovery action and the
NVLink fabric are read), with host.sysfs at a copy of the 8-HCA ConnectX-7 fixture and a kernel log of
--kmsg-records records. Figures, each against a baseline measured in the same run:
- a health pass (the GPUs' readings and checks, then the node's: driver versions, Fabric Manager,
  InfiniBand, peermem) in ms, against the GPU checks alone (what a pass cost before this work);
- an XID the driver writes to the kernel log only (NVML missed it) until its health event is on the
  watch stream (the bus), against an XID NVML delivers. The kernel log here is a file, polled every
  0.05 s; /dev/kmsg is poll(2)-driven and wakes at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpud.config import Config, HealthConfig, HostConfig  # noqa: E402
from gpud.daemon import Daemon  # noqa: E402
from gpud.nvml.sim.kernel import append_kmsg  # noqa: E402

IB_FIXTURE = REPO / "tests" / "fixtures" / "infiniband" / "ndr-connectx7" / "sys"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


async def timed_passes(daemon: Daemon, passes: int, node_checks: bool) -> list[float]:
    health, took = daemon.health, []
    for _ in range(passes):
        started = time.perf_counter()
        await health.check_once()
        if node_checks:
            health.node_checks._fabric_manager_checked = 0.0  # systemctl's answer every pass: the worst case
            await health.check_node_once()
        took.append((time.perf_counter() - started) * 1000)
    return took


async def xid_to_watch(daemon: Daemon, xids: int, nvml_event: bool) -> list[float]:
    """ms from the driver reporting an XID to its health event on the bus, one GPU at a time."""
    bus, took = daemon.bus, []
    for n in range(xids):
        gpu = n % 8
        inventory = daemon.inventory.current
        uuid = next(g.uuid for g in inventory.gpus if g.index == gpu)
        subscription = bus.subscribe()
        started = time.perf_counter()
        await daemon.session.call(lambda nvml: nvml.sim_inject_xid(gpu, 79, nvml_event=nvml_event))
        while True:
            event = await asyncio.wait_for(subscription.queue.get(), 10)
            data = json.loads(event.line)["data"]
            if event.type == "health" and data.get("device") == uuid and data.get("state") == "unhealthy":
                break
        took.append((time.perf_counter() - started) * 1000)
        bus.unsubscribe(subscription)
        if nvml_event:  # the driver logged it too: its kernel-log twin is matched, not counted again
            deadline = time.monotonic() + 10
            while daemon.health.xids.by_source["both"] < n + 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        daemon.health.clear(uuid, None)
        daemon.health.xids._recent_sources.clear()  # the next XID 79 on this GPU is a new one, not a twin
    return took


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gpb", dir="/tmp"))
    sysfs = tmp / "sys"
    shutil.copytree(IB_FIXTURE, sysfs, symlinks=True)
    config = Config().with_overrides(**{"api.socket": str(tmp / "g.sock"), "simulate": "hgx-h100",
                                        "sim_state": str(tmp / "sim.json"), "state_dir": str(tmp / "state"),
                                        "sim_driver": "580.65.06", "inventory.refresh_interval_s": 3600.0,
                                        "log.level": "error"})
    config = dataclasses.replace(config, health=dataclasses.replace(HealthConfig(), check_interval_s=3600.0),
                                 host=HostConfig(sysfs=str(sysfs)))
    kmsg = tmp / "sim.json.kmsg"
    filler = [f"mlx5_core 0000:0c:00.0: filler record {n} of a busy kernel log" for n in range(args.kmsg_records)]
    append_kmsg(kmsg, filler, priority=6)
    daemon = Daemon(config)
    await daemon.start()
    try:
        while daemon.inventory.current is None:
            await asyncio.sleep(0.05)
        hcas = len({port.device for port in (await asyncio.to_thread(_ports, sysfs))})
        baseline = await timed_passes(daemon, args.passes, node_checks=False)
        full = await timed_passes(daemon, args.passes, node_checks=True)
        print(f"health pass, 8 GPUs: {statistics.median(baseline):.2f} ms median (GPU checks alone, baseline)")
        print(f"health pass, 8 GPUs + {hcas} HCAs + node checks: {statistics.median(full):.2f} ms median, "
              f"p99 {percentile(full, 0.99):.2f} ms, ratio {statistics.median(full) / statistics.median(baseline):.2f}")
        print(f"kernel log follower: {daemon.health.kernel_log.follower.lines_read} records read "
              f"({args.kmsg_records} filler records)")
        nvml = await xid_to_watch(daemon, args.xids, nvml_event=True)
        kernel = await xid_to_watch(daemon, args.xids, nvml_event=False)
        print(f"XID to watch stream via NVML events: p50 {percentile(nvml, 0.5):.1f} ms, p99 {percentile(nvml, 0.99):.1f}"
              f" ms (baseline)")
        print(f"XID to watch stream via the kernel log only: p50 {percentile(kernel, 0.5):.1f} ms, "
              f"p99 {percentile(kernel, 0.99):.1f} ms (a file, polled every 0.05 s)")
    finally:
        await daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _ports(sysfs: Path):
    from gpud.health.infiniband import read_ports

    return read_ports(sysfs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=200)
    parser.add_argument("--xids", type=int, default=40)
    parser.add_argument("--kmsg-records", type=int, default=20000)
    asyncio.run(main(parser.parse_args()))
