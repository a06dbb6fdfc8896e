"""Benchmark: a MIG device made for a DRA claim at Prepare, against the same change through `gpud mig apply`
(issue 36).

Usage: python bench/dynamic_mig.py [--rounds 30]

On a simulated HGX H100 (gpud serve --simulate hgx-h100, dra.dynamic_mig_gpus: [0]) with `gpud dra-plugin`
beside it (against the Kubernetes API stand-in, tests/kube_api_stand_in.py, as bench/dra.py runs it):
- dynamic: GPU 0 holds six 1g.10gb MIG devices made for six prepared claims (placements 0-5), each running a
  process; each round a seventh claim, allocated the placement left (gpu-0-mig-1g10gb-19-6), is prepared
  through the plugin's DRA socket as the kubelet calls it (NodePrepareResources), then unprepared. Timed:
  claim-to-prepared (the call until its answer, which comes once the device is made, held and in the
  claim's CDI spec) and the Unprepare; then how long until gpud's CDI node spec lists the new device and
  the stand-in's slices are what the plugin publishes for gpud's state (a partition device stands for the
  instance, so nothing needs republishing: the figure says how long the pool took to be right);
- static: GPU 1 has the layout of six 1g.10gb devices applied with `gpud mig apply`, each running a process;
  each round `gpud mig apply` of the layout with seven (the incremental engine adds the one device, the
  same NVML change), timed from the command's start to its exit, then the six again.
Prints p50 and p99 of each and the ratio dynamic / static (the static apply, measured in the same run, is
the baseline). Both keep the six busy devices: their UUIDs and processes are checked unchanged at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from dra_side_by_side import DRIVER, GpudDraPlugin  # noqa: E402
from kube_api_stand_in import KubeApiStandIn  # noqa: E402
from kube_manifests import dra_rbac_rules  # noqa: E402
from simulated_gpud import simulated_gpud, wait  # noqa: E402

from gpud.client import Client  # noqa: E402
from gpud.dra.devices import counter_sets, node_devices  # noqa: E402

NODE = "node1"
PROFILE, PROFILE_ID = "1g.10gb", 19  # H100 80GB: GI profile 1_SLICE, seven placements (starts 0-6)
LAYOUTS = """version: v1
mig-configs:
  six:
    - devices: [1]
      mig-enabled: true
      mig-devices: {"1g.10gb": 6}
  seven:
    - devices: [1]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
"""


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def figures(name: str, values: list[float]) -> str:
    return f"{name}: p50 {statistics.median(values) * 1000:.1f} ms, p99 {percentile(values, 0.99) * 1000:.1f} ms"


def gpu_migs(client: Client, index: int) -> dict[str, tuple]:
    gpu = client.get("/v1/gpus")["gpus"][index]
    return {m["uuid"]: (m["placement"]["start"], tuple(m["pids"])) for m in gpu["mig"]["devices"]}


def run_processes(client: Client, uuids: list[str], first_pid: int) -> None:
    for pid, uuid in enumerate(uuids, first_pid):
        client.request("POST", "/v1/sim/processes", {"gpu": uuid, "pids": [pid]})


class DynamicSide:
    def __init__(self, work: Path, sock: Path, client: Client):
        self.client = client
        self.kube = KubeApiStandIn(server_version="1.36")
        self.kube.create_node(NODE)
        self.kube.bind_rbac("dra", dra_rbac_rules())
        self.plugin = GpudDraPlugin(work / "plugin", self.kube.kubeconfig("dra"), NODE, sock, "--log-level", "error")
        self.plugin.wait_serving()
        self.claims = 0

    def claim(self, start: int) -> tuple[str, str, str]:
        self.claims += 1
        device = f"gpu-0-mig-{PROFILE.replace('.', '')}-{PROFILE_ID}-{start}"
        created = self.kube.create_resource_claim("default", f"c{self.claims}", [
            {"name": "mig", "exactly": {"deviceClassName": "mig.nvidia.com"}}], [
            {"request": "mig", "driver": DRIVER, "pool": NODE, "device": device}], node=NODE)
        return "default", created["metadata"]["name"], created["metadata"]["uid"]

    def prepare(self, claim) -> None:
        error = self.plugin.prepare([claim])[claim[2]].error
        if error:
            raise SystemExit(f"Prepare failed: {error}")

    def unprepare(self, claim) -> None:
        error = self.plugin.unprepare([claim])[claim[2]].error
        if error:
            raise SystemExit(f"Unprepare failed: {error}")

    def published_right(self) -> bool:
        """The stand-in holds what the plugin publishes for gpud's state now."""
        get = self.client.get
        devices, _ = node_devices(get("/v1/gpus"), get("/v1/node"), None, get("/v1/mig/dynamic"),
                                  get("/v1/claims").get("shares"))
        slices = self.kube.resource_slices(NODE, DRIVER)
        names = {d["name"] for s in slices for d in s["spec"].get("devices") or []}
        sets = {c["name"] for s in slices for c in s["spec"].get("sharedCounters") or []}
        return names == {d.name for d in devices} and sets == {c.name for c in counter_sets(devices)}

    def stop(self) -> None:
        self.plugin.stop()
        self.kube.stop()


def measure_dynamic(side: DynamicSide, client: Client, rounds: int) -> dict:
    for start in range(6):
        side.prepare(side.claim(start))
    six = gpu_migs(client, 0)
    run_processes(client, list(six), 50000)
    six = gpu_migs(client, 0)
    wait(side.published_right, 30, "the plugin's slices")
    prepared, unprepared, cdi, pool = [], [], [], []
    for _ in range(rounds):
        claim = side.claim(6)
        began = time.monotonic()
        side.prepare(claim)
        prepared.append(time.monotonic() - began)
        new = (set(gpu_migs(client, 0)) - set(six)).pop()
        wait(lambda: new in {d["name"] for d in client.get("/v1/cdi")["spec"]["devices"]}, 5, "gpud's CDI spec",
             interval=0.005)
        cdi.append(time.monotonic() - began)
        wait(side.published_right, 5, "the plugin's slices", interval=0.005)
        pool.append(time.monotonic() - began)
        began = time.monotonic()
        side.unprepare(claim)
        unprepared.append(time.monotonic() - began)
    assert gpu_migs(client, 0) == six, "the six busy MIG devices changed"
    return {"prepare": prepared, "unprepare": unprepared, "cdi": cdi, "pool": pool}


def cli(sock: Path, *args: str) -> float:
    """Seconds `gpud <args>` took, from its start to its exit."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gpud", *args, "--socket", str(sock)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise SystemExit(f"gpud {' '.join(args)} failed: {done.stderr or done.stdout}")
    return time.monotonic() - began


def measure_static(sock: Path, client: Client, layouts: Path, rounds: int) -> tuple[list[float], list[float]]:
    """`gpud mig apply` of seven, and `gpud mig status` (what starting the CLI costs) each round."""
    def apply(layout: str) -> float:
        return cli(sock, "mig", "apply", layout, "--file", str(layouts))

    apply("six")
    six = gpu_migs(client, 1)
    run_processes(client, list(six), 60000)
    six = gpu_migs(client, 1)
    times, status = [], []
    for _ in range(rounds):
        times.append(apply("seven"))
        apply("six")
        status.append(cli(sock, "mig", "status"))
    assert gpu_migs(client, 1) == six, "the six busy MIG devices changed"
    return times, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bd", dir="/tmp"))
    config = work / "gpud.yaml"
    config.write_text(f"mig:\n  layouts_file: {work / 'absent.yaml'}\ndra:\n  dynamic_mig_gpus: [0]\n")
    (work / "layouts.yaml").write_text(LAYOUTS)
    with simulated_gpud("hgx-h100", config) as (_, sock):
        client = Client(sock, timeout=60)
        wait(lambda: client.request("GET", "/healthz", ok_statuses=(503,))[0] == 200, 30, "gpud healthy")
        side = DynamicSide(work, sock, client)
        try:
            dynamic = measure_dynamic(side, client, args.rounds)
        finally:
            side.stop()
        static, status = measure_static(sock, client, work / "layouts.yaml", args.rounds)
    print(f"rounds: {args.rounds} (simulated HGX H100; six busy 1g.10gb devices on the GPU each time)")
    print(figures("dynamic MIG claim-to-prepared (NodePrepareResources)", dynamic["prepare"]))
    print(figures("dynamic MIG Unprepare (device destroyed)", dynamic["unprepare"]))
    print(figures("gpud mig apply of the same change (CLI start to exit)", static))
    print(figures("gpud mig status (what starting the CLI costs)", status))
    print(figures("gpud's CDI spec lists the new device, from the Prepare call", dynamic["cdi"]))
    print(figures("slices what the plugin publishes for gpud's state, from the Prepare call", dynamic["pool"]))
    print(f"ratio claim-to-prepared / mig apply: p50 {statistics.median(dynamic['prepare']) / statistics.median(static):.2f}, "
          f"p99 {percentile(dynamic['prepare'], 0.99) / percentile(static, 0.99):.2f}")
    print(json.dumps({"max_cdi_s": max(dynamic["cdi"]), "max_pool_s": max(dynamic["pool"])}))


if __name__ == "__main__":
    main()
