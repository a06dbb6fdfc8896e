"""Benchmark: the gpu-memory resource of `gpud device-plugin` on 8 x 80 GB GPUs at 1 GiB units: how
long Allocate takes, and how big its ListAndWatch frame is against what the kubelet accepts.

Usage: python bench/gpu_memory_plugin.py [--allocations 500] [--preset dgx-a100-80gb] [--unit-mib 1024]

Starts gpud on a simulated node (dgx-a100-80gb: 8 x A100-SXM4-80GB, with NUMA nodes, so each device
carries its topology as on a real node) with `gpu_memory.enabled`, so GET /v1/sharing has the
gpu-memory resource, one device per unit, and gpud runs an MPS daemon per GPU (NVIDIA's
nvidia-cuda-mps-control); then `gpud device-plugin` and the kubelet stand-in of the tests
(tests/kubelet_stand_in.py), which registers it, reads its ListAndWatch stream and calls Allocate
over gRPC as the kubelet does. Each Allocate asks for 1 to 8 units of one GPU (envvar strategy).
Allocate reads only the plugin's state, never gpud.

The kubelet reads ListAndWatch with gRPC-Go's default receive limit: its device plugin client dials
without MaxCallRecvMsgSize (kubernetes pkg/kubelet/cm/devicemanager/plugin/v1beta1/client.go dial), so
grpc-go's defaultClientMaxReceiveMessageSize, 4 MiB (grpc-go dialoptions.go), applies to every frame.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from simulated_gpud import REPO, simulated_gpud

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gpud.client import Client  # noqa: E402
from helpers import kill_mps_under  # noqa: E402
from kubelet_stand_in import Kubelet  # noqa: E402

RESOURCE = "nvidia.com/gpu-memory"
KUBELET_MAX_RECEIVE_BYTES = 4 * 1024 * 1024  # grpc-go defaultClientMaxReceiveMessageSize (see above)
READY_TIMEOUT_S = 60.0


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def first_allocate(kubelet: Kubelet, ids: list[str]) -> None:
    """The first Allocate of `ids` that succeeds: their MPS daemon runs and the plugin has read its
    client environment."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            kubelet.allocate(RESOURCE, ids, container=("bench", "warm-up", "main"))
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocations", type=int, default=500)
    parser.add_argument("--preset", default="dgx-a100-80gb")
    parser.add_argument("--unit-mib", type=int, default=1024)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gmp", dir="/tmp"))  # short: socket paths hold 108 bytes
    (work / "gpud.yaml").write_text(f"gpu_memory:\n  enabled: true\n  unit_mib: {args.unit_mib}\n"
                                    f"mps:\n  pipe_root: {work / 'mps'}\n  log_root: {work / 'mpslog'}\n")
    kubelet_dir = work / "k"
    kubelet_dir.mkdir()
    kubelet = Kubelet(kubelet_dir)
    try:
        with simulated_gpud(args.preset, work / "gpud.yaml") as (_, sock):
            plugin = subprocess.Popen([sys.executable, "-m", "gpud", "device-plugin", "--socket", str(sock),
                                       "--kubelet-dir", str(kubelet_dir), "--device-list-strategy", "envvar",
                                       "--pod-resources-socket", str(kubelet.pod_resources_socket),
                                       "--log-level", "error"], cwd=REPO, stdout=subprocess.DEVNULL)
            try:
                frame = kubelet.frame_where(RESOURCE, lambda f: f and all(h == "Healthy" for _, h in f),
                                            timeout=READY_TIMEOUT_S, what="the gpu-memory devices")
                gpus = Client(sock).get("/v1/gpus")["gpus"]
                by_gpu: dict[str, list[str]] = {}
                for device_id, _ in frame:
                    by_gpu.setdefault(device_id.partition("::")[0], []).append(device_id)
                for units in by_gpu.values():
                    first_allocate(kubelet, units[:1])
                chooser = random.Random(23)
                took = []
                for n in range(args.allocations):
                    units = list(by_gpu.values())[n % len(by_gpu)]
                    ids = chooser.sample(units, chooser.randint(1, 8))
                    started = time.perf_counter()
                    kubelet.allocate(RESOURCE, ids, container=("bench", f"pod-{n}", "main"))
                    took.append((time.perf_counter() - started) * 1000)
                frame_bytes = kubelet.frame_bytes[RESOURCE][-1]
            finally:
                plugin.terminate()
                plugin.wait(10)
    finally:
        kubelet.stop()
        kill_mps_under(work / "mps")  # MPS daemons outlive gpud by design
        shutil.rmtree(work, ignore_errors=True)
    memory = sorted({gpu["memory_total_mib"] for gpu in gpus})
    print(f"gpu-memory through gpud device-plugin, simulated {args.preset}: {len(gpus)} GPUs of "
          f"{'/'.join(map(str, memory))} MiB at {args.unit_mib} MiB units = {len(frame)} devices")
    print(f"Allocate (1-8 units of one GPU, over gRPC): n={len(took)} p50 {statistics.median(took):.2f} ms, "
          f"p99 {percentile(took, 0.99):.2f} ms, max {max(took):.2f} ms")
    print(f"ListAndWatch frame: {frame_bytes} bytes, {frame_bytes / KUBELET_MAX_RECEIVE_BYTES:.1%} of the kubelet's "
          f"{KUBELET_MAX_RECEIVE_BYTES} byte receive limit (grpc-go default)")


if __name__ == "__main__":
    main()
