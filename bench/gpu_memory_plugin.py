"""Benchmark: the gpu-memory resource of `gpud device-plugin` on 8 x 80 GB GPUs at 1 GiB units: how
long Allocate takes, and how big its ListAndWatch frame is against what the kubelet accepts.

Usage: python bench/gpu_memory_plugin.py [--allocations 500] [--preset dgx-a100-80gb] [--unit-mib 1024]

The GPUs are a simulated gpud's (GET /v1/gpus: UUIDs, memory, NUMA nodes; dgx-a100-80gb has NUMA nodes,
so each device carries its topology, as on a real node). The gpu-memory resource is built from them in
the shape gpud's GET /v1/sharing gives it (one device `<uuid>::<n>` per unit), and one resource endpoint
of the plugin (gpud/device_plugin/endpoint.py, the class `gpud device-plugin` runs) serves it to the
kubelet stand-in of the tests (tests/kubelet_stand_in.py), which registers it and calls Allocate over
gRPC as the kubelet does. Allocate reads only the plugin's state, never gpud, so its latency is the
plugin's own. Each Allocate asks for 1 to 8 units of one GPU.

The kubelet reads ListAndWatch with gRPC-Go's default receive limit: its device plugin client dials
without MaxCallRecvMsgSize (kubernetes pkg/kubelet/cm/devicemanager/plugin/v1beta1/client.go dial), so
grpc-go's defaultClientMaxReceiveMessageSize, 4 MiB (grpc-go dialoptions.go), applies to every frame.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from simulated_gpud import REPO, simulated_gpud

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gpud.client import ApiFailure, Client, DaemonUnreachable  # noqa: E402
from gpud.device_plugin.allocation import DeviceListStrategy  # noqa: E402
from gpud.device_plugin.endpoint import Endpoint  # noqa: E402
from gpud.device_plugin.state import MpsClient, NodeState, resources_from_sharing  # noqa: E402
from gpud.logs import configure_logging  # noqa: E402
from kubelet_stand_in import Kubelet  # noqa: E402

RESOURCE = "nvidia.com/gpu-memory"
KUBELET_MAX_RECEIVE_BYTES = 4 * 1024 * 1024  # grpc-go defaultClientMaxReceiveMessageSize (see above)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def read_gpus(sock: Path) -> dict:
    client = Client(sock)
    deadline = time.monotonic() + 30
    while True:
        try:
            return client.get("/v1/gpus")
        except (DaemonUnreachable, ApiFailure):  # not listening yet, or its first inventory not read
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def gpu_memory_state(gpus: dict, unit_mib: int) -> NodeState:
    """The gpu-memory resource as gpud's GET /v1/sharing lists it, with each GPU's MPS client."""
    devices = [{"id": f"{gpu['uuid']}::{n}", "parent": gpu["uuid"], "gpu_index": gpu["index"], "healthy": True,
                "device": gpu["uuid"], "units": gpu["memory_total_mib"] // unit_mib, "mps_daemon": f"gpu{gpu['index']}"}
               for gpu in gpus["gpus"] for n in range(gpu["memory_total_mib"] // unit_mib)]
    document = {"resources": [{"name": RESOURCE, "strategy": "gpu-memory", "fail_requests_greater_than_one": False,
                               "unit_mib": unit_mib, "proportional_threads": True, "count": len(devices),
                               "devices": devices}]}
    pipe = "/run/gpud/mps/gpu{}/pipe"
    clients = {gpu["uuid"]: MpsClient(f"gpu{gpu['index']}", "running",
                                      {"CUDA_MPS_PIPE_DIRECTORY": pipe.format(gpu["index"])},
                                      ((pipe.format(gpu["index"]),) * 2 + (False,),), host_ipc=True)
               for gpu in gpus["gpus"]}
    return NodeState(resources_from_sharing(document, gpus), cdi_kind="gpud.dev/gpu",
                     cdi_names=frozenset(gpu["uuid"] for gpu in gpus["gpus"]), mps_clients=clients)


def serve_endpoint(state: NodeState, kubelet_dir: Path) -> tuple[asyncio.AbstractEventLoop, Endpoint]:
    """The resource's endpoint on an event loop of its own, registered with the kubelet."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    endpoint = Endpoint(state.resources[RESOURCE], kubelet_dir, lambda: state, (DeviceListStrategy.CDI_ANNOTATIONS,))
    asyncio.run_coroutine_threadsafe(endpoint.start(), loop).result(10)
    loop.call_soon_threadsafe(endpoint.register_soon, kubelet_dir / "kubelet.sock")
    return loop, endpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocations", type=int, default=500)
    parser.add_argument("--preset", default="dgx-a100-80gb")
    parser.add_argument("--unit-mib", type=int, default=1024)
    args = parser.parse_args()
    configure_logging("error", "console")  # as `gpud device-plugin --log-level error`: the figures alone
    with simulated_gpud(args.preset) as (_, sock):
        gpus = read_gpus(sock)
    state = gpu_memory_state(gpus, args.unit_mib)
    resource = state.resources[RESOURCE]
    work = Path(tempfile.mkdtemp(prefix="gmp", dir="/tmp"))  # short: socket paths hold 108 bytes
    kubelet_dir = work / "k"
    kubelet_dir.mkdir()
    kubelet = Kubelet(kubelet_dir)
    loop, endpoint = serve_endpoint(state, kubelet_dir)
    try:
        kubelet.frame_where(RESOURCE, lambda f: len(f) == len(resource.devices), timeout=30, what="the devices")
        frame_bytes = endpoint._frame.ByteSize()
        by_gpu: dict[str, list[str]] = {}
        for device in resource.devices:
            by_gpu.setdefault(device.gpu, []).append(device.id)
        chooser = random.Random(23)
        took = []
        for n in range(args.allocations):
            units = by_gpu[list(by_gpu)[n % len(by_gpu)]]
            ids = chooser.sample(units, chooser.randint(1, 8))
            started = time.perf_counter()
            kubelet.allocate(RESOURCE, ids, container=("bench", f"pod-{n}", "main"))
            took.append((time.perf_counter() - started) * 1000)
    finally:
        asyncio.run_coroutine_threadsafe(endpoint.stop("the benchmark is done"), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        kubelet.stop()
        shutil.rmtree(work, ignore_errors=True)
    memory = sorted({gpu["memory_total_mib"] for gpu in gpus["gpus"]})
    print(f"gpu-memory through gpud device-plugin's endpoint, simulated {args.preset}: {len(gpus['gpus'])} GPUs of "
          f"{'/'.join(map(str, memory))} MiB at {args.unit_mib} MiB units = {len(resource.devices)} devices")
    print(f"Allocate (1-8 units of one GPU, over gRPC): n={len(took)} p50 {statistics.median(took):.2f} ms, "
          f"p99 {percentile(took, 0.99):.2f} ms, max {max(took):.2f} ms")
    print(f"ListAndWatch frame: {frame_bytes} bytes, {frame_bytes / KUBELET_MAX_RECEIVE_BYTES:.1%} of the kubelet's "
          f"{KUBELET_MAX_RECEIVE_BYTES} byte receive limit (grpc-go default)")


if __name__ == "__main__":
    main()
