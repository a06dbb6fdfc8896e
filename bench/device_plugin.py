"""Benchmark: how fast an XID reaches the kubelet through `gpud device-plugin`, with and without a
registration the kubelet never answers.

Usage: python bench/device_plugin.py [--events 50]

Starts gpud on a simulated A100 node (two GPUs: GPU 0 as nvidia.com/gpu, GPU 1's two replicas as
nvidia.com/gpu.shared), the kubelet stand-in of the tests (tests/kubelet_stand_in.py) and the plugin.
For each event an XID 79 is injected on GPU 0 (POST /v1/sim/xid) and the clock runs until the frame
with GPU 0 Unhealthy reaches the stand-in's open ListAndWatch stream; the GPU is then cleared and its
Healthy frame awaited. First while the kubelet leaves nvidia.com/gpu.shared's Register hanging, then,
the baseline of the same run, once it has let it through (idle). Target: every frame within 1 s;
the hanging phase no slower than idle (ratio ≈ 1).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from simulated_gpud import REPO, simulated_gpud

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gpud.client import Client  # noqa: E402
from kubelet_stand_in import Kubelet  # noqa: E402

SHARING = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      rename: nvidia.com/gpu.shared
      devices: [1]
      replicas: 2
"""
HANGING = "nvidia.com/gpu.shared"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def xid_to_frame(gpud: Client, kubelet: Kubelet, events: int) -> list[float]:
    """Milliseconds from each XID's POST to the Unhealthy frame on nvidia.com/gpu's stream."""
    took = []
    for _ in range(events):
        frames = len(kubelet.frames["nvidia.com/gpu"])
        started = time.monotonic()
        status, _ = gpud.request("POST", "/v1/sim/xid", {"gpu": 0, "xid": 79})
        assert status == 200
        kubelet.wait(lambda: len(kubelet.frames["nvidia.com/gpu"]) > frames and
                     kubelet.last_frame("nvidia.com/gpu")[0][1] == "Unhealthy", timeout=10, what="the XID")
        took.append((kubelet.frame_times["nvidia.com/gpu"][-1] - started) * 1000)
        gpud.request("POST", "/v1/health/0/clear", {})
        kubelet.frame_where("nvidia.com/gpu", lambda f: f[0][1] == "Healthy", what="Healthy again")
    return took


def line(name: str, values: list[float]) -> str:
    return (f"{name}: n={len(values)} p50 {statistics.median(values):.1f} ms, p95 {percentile(values, 0.95):.1f} ms, "
            f"max {max(values):.1f} ms (target < 1000 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gdp", dir="/tmp"))  # short: socket paths hold 108 bytes
    (work / "sharing.yaml").write_text(SHARING)
    (work / "gpud.yaml").write_text(f"sharing:\n  file: {work / 'sharing.yaml'}\n")
    kubelet_dir = work / "k"
    kubelet_dir.mkdir()
    kubelet = Kubelet(kubelet_dir)
    kubelet.hang.add(HANGING)
    with simulated_gpud("A100-SXM4-40GB:2", work / "gpud.yaml") as (_, sock):
        plugin = subprocess.Popen([sys.executable, "-m", "gpud", "device-plugin", "--socket", str(sock),
                                   "--kubelet-dir", str(kubelet_dir), "--log-level", "error"],
                                  cwd=REPO, stdout=subprocess.DEVNULL)
        try:
            gpud = Client(sock)
            kubelet.frame_where("nvidia.com/gpu", lambda f: f and f[0][1] == "Healthy", timeout=30,
                                what="nvidia.com/gpu registered")
            kubelet.wait(lambda: any(a.resource_name == HANGING for a in kubelet.attempts), what="the hanging one")
            hanging = xid_to_frame(gpud, kubelet, args.events)
            assert kubelet.registered(HANGING) == 0, "the hanging registration went through"
            kubelet.release(HANGING)
            kubelet.wait(lambda: kubelet.registered(HANGING) == 1, what=f"{HANGING} registered")
            idle = xid_to_frame(gpud, kubelet, args.events)
        finally:
            plugin.terminate()
            plugin.wait(10)
            kubelet.stop()
            shutil.rmtree(work, ignore_errors=True)
    print(f"XID -> ListAndWatch frame through gpud device-plugin, simulated A100-SXM4-40GB:2, {args.events} XIDs each")
    print(line("idle", idle))
    print(line(f"with {HANGING}'s Register hanging", hanging))
    print(f"ratio hanging/idle (p50): {statistics.median(hanging) / statistics.median(idle):.2f}")


if __name__ == "__main__":
    main()
