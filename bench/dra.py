"""Benchmark: `gpud dra-plugin` against NVIDIA's DRA kubelet plugin (issue 35).

Usage: python bench/dra.py [--claims 40] [--mig-changes 4] [--idle-seconds 30] [--nvidia-qps Q] [--without-nvidia]

On NVIDIA's mock H100 (../shared/nvidia-mock-nvml, 8 GPUs) both plugins run side by side as
tests/test_dra_vs_nvidia.py runs them (tests/dra_side_by_side.py: NVIDIA's gpu-kubelet-plugin on a driver
root holding the mock, gpud serve's real NVML backend on the same mock, each plugin against its own
Kubernetes API stand-in, tests/kube_api_stand_in.py) and are called as the kubelet calls them:
- Prepare and Unprepare: the same claims (one GPU each, gpu-0 to gpu-7 in turn), each prepared then
  unprepared, the plugins taking turns going first; milliseconds per gRPC call, p50 and p90, and the
  ratio gpud / NVIDIA (NVIDIA's, measured in the same run, is the baseline). NVIDIA's plugin runs with its
  own default client-side rate limit (client-go's 5 QPS, burst 10; its Helm chart sets none): past the
  burst, each Prepare's GET of its claim waits up to 200 ms for it. --nvidia-qps lifts it, to compare the
  plugins' own work; gpud's plugin has no client-side limit (16 claim reads at once at most);
- idle API requests per node-hour: the requests each plugin's user makes in an idle window, per hour,
  plus those of one watch renewal (the stand-in ends the watches, as the server does when a watch's
  timeoutSeconds runs out) times the renewals an hour at the plugins' watch timeouts (both ask for a
  random 5-10 minutes, client-go's reflector and gpud's alike: 8 an hour on average);
- RSS: VmRSS of each plugin process (gpud's plugin needs gpud serve beside it: its RSS is printed too).
Then on a simulated MIG node (gpud serve --simulate hgx-a100-4gpu, gpud's plugin only: the mock's MIG
calls are stubs, NVIDIA's plugin has no MIG to publish there): a MIG change (PUT /v1/mig?wait=true,
alternating all-balanced and all-3g.20gb) until the API stand-in holds the slice of the new devices, from
the PUT sent and from its answer.

NVIDIA's part needs ../shared (the binary, the mock) and root (the driver root's /dev nodes); without
them it is skipped, saying why, and gpud's Prepare and Unprepare are measured on the simulated node
instead (no ratio).
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from dra_side_by_side import (DRA_RULES, GpudDraPlugin, SideBySide, allocated_claim, devices_of,  # noqa: E402
                              mock_config, nvidia_missing)
from helpers import SHARED  # noqa: E402
from simulated_gpud import wait as wait_every, wait_until_listening  # noqa: E402
from kube_api_stand_in import DRA_USER, KubeApiStandIn  # noqa: E402

from gpud.client import Client  # noqa: E402
from gpud.dra.devices import node_devices  # noqa: E402
from gpud.kubernetes.node_api import WATCH_TIMEOUT_S  # noqa: E402

# polled every 10 ms: the time to a republished slice is what is measured
wait = functools.partial(wait_every, interval=0.01)

NODE = "gpu-node-1"
QUIET_S = 0.5  # no request from the plugin for this long: it has settled
RENEWALS_PER_HOUR = 3600 / (sum(WATCH_TIMEOUT_S) / 2)  # 5-10 min, both plugins: 8 an hour on average
MIG_LAYOUTS = ("all-balanced", "all-3g.20gb")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def figures(values: list[float]) -> str:
    return f"p50 {statistics.median(values):.1f} ms, p90 {percentile(values, 0.9):.1f} ms"


def plugin_requests(kube) -> int:
    return sum(1 for r in kube.requests if r["user"] == DRA_USER)


def settle(kubes: list) -> None:
    """Until no plugin has made a request for QUIET_S."""
    last, quiet_from = None, time.monotonic()
    deadline = quiet_from + 60
    while time.monotonic() - quiet_from < QUIET_S:
        counts = [plugin_requests(kube) for kube in kubes]
        if counts != last:
            last, quiet_from = counts, time.monotonic()
        if time.monotonic() > deadline:
            raise SystemExit("the plugins never went quiet")
        time.sleep(0.05)


def idle_per_hour(kubes: dict, seconds: float) -> dict[str, tuple[float, int, int]]:
    """Per plugin: (requests per node-hour, requests in the window, requests of one watch renewal)."""
    settle(list(kubes.values()))
    before = {name: plugin_requests(kube) for name, kube in kubes.items()}
    time.sleep(seconds)  # the idle window itself is what is measured
    in_window = {name: plugin_requests(kube) - before[name] for name, kube in kubes.items()}
    marks = {name: plugin_requests(kube) for name, kube in kubes.items()}
    for kube in kubes.values():
        kube.end_watches()
    for name, kube in kubes.items():  # a renewed watch is one request at least
        wait(lambda: plugin_requests(kube) > marks[name], 30, f"{name}'s watch renewed")
    settle(list(kubes.values()))
    renewal = {name: plugin_requests(kube) - marks[name] for name, kube in kubes.items()}
    return {name: (in_window[name] * 3600 / seconds + renewal[name] * RENEWALS_PER_HOUR, in_window[name],
                   renewal[name]) for name in kubes}


def prepare_unprepare(plugins: dict, kubes: dict, node: str, claims: int, gpus: int) -> dict[str, tuple[list, list]]:
    """Per plugin: (Prepare ms, Unprepare ms) of the same claims, the plugins taking turns going first."""
    took: dict[str, tuple[list, list]] = {name: ([], []) for name in plugins}
    for i in range(claims):
        order = list(plugins) if i % 2 == 0 else list(reversed(plugins))
        for name in order:
            plugin = plugins[name]
            claim = allocated_claim(kubes[name], f"claim-{i}", f"gpu-{i % gpus}", node)
            started = time.perf_counter()
            answer = plugin.prepare([claim])[claim[2]]
            took[name][0].append((time.perf_counter() - started) * 1000)
            if answer.error:
                raise SystemExit(f"{name}: Prepare failed: {answer.error}")
            started = time.perf_counter()
            answer = plugin.unprepare([claim])[claim[2]]
            took[name][1].append((time.perf_counter() - started) * 1000)
            if answer.error:
                raise SystemExit(f"{name}: Unprepare failed: {answer.error}")
    return took


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def side_by_side(args, work: Path) -> bool:
    """NVIDIA's plugin and gpud's on the mock H100; False where NVIDIA's cannot run here."""
    why = "--without-nvidia" if args.without_nvidia else nvidia_missing()
    if why is None and shutil.which("gcc") is None:
        why = "gcc is absent (the driver root's stub libcuda)"
    mock = None
    if why is None:
        build = SHARED / "nvidia-mock-nvml" / "build"
        if not build.exists():
            why = f"{build} is absent"
        else:
            mock = Path("/tmp/gpud-tests-mock-nvml")  # where the tests build it, taking turns as they do
            with open(f"{mock}.lock", "a") as lock:  # (helpers.mock_nvml_library)
                fcntl.flock(lock, fcntl.LOCK_EX)
                built = subprocess.run([str(build), str(mock)], capture_output=True, text=True, timeout=900)
            if built.returncode != 0:
                why = f"NVIDIA's mock NVML did not build: {built.stderr.strip()[-300:]}"
    if why is not None:
        print(f"NVIDIA's plugin: skipped ({why})")
        return False
    limiter = (("--kube-api-qps", str(args.nvidia_qps), "--kube-api-burst", str(args.nvidia_burst))
               if args.nvidia_qps else ())
    sides = SideBySide(work / "mock", mock, mock_config("h100"), NODE, nvidia_args=limiter)
    try:
        sides.wait_published(8)
        took = prepare_unprepare(sides.plugins, sides.kubes, NODE, args.claims, 8)
        idle = idle_per_hour(sides.kubes, args.idle_seconds)
        rss = {name: rss_mib(plugin.proc.pid) for name, plugin in sides.plugins.items()}
        gpud_rss = rss_mib(sides.gpud.proc.pid)
    finally:
        sides.stop()
    print(f"DRA plugins side by side on NVIDIA's mock H100 (8 GPUs), {args.claims} claims of one GPU each; NVIDIA's "
          "client-side limit on API requests: " + (f"{args.nvidia_qps:g} QPS, burst {args.nvidia_burst}" if args.nvidia_qps
                                                  else "its default, 5 QPS, burst 10"))
    for call, at in (("Prepare", 0), ("Unprepare", 1)):
        ours, theirs = took["gpud"][at], took["nvidia"][at]
        print(f"{call}: gpud {figures(ours)}; NVIDIA {figures(theirs)}; ratio gpud/NVIDIA p50 "
              f"{statistics.median(ours) / statistics.median(theirs):.2f}, p90 "
              f"{percentile(ours, 0.9) / percentile(theirs, 0.9):.2f}")
    print(f"idle API requests per node-hour ({args.idle_seconds:g} s window, {RENEWALS_PER_HOUR:.0f} watch renewals "
          "an hour): " + "; ".join(f"{name} {hour:.0f} ({window} in the window, {renewal} per renewal)"
                                  for name, (hour, window, renewal) in sorted(idle.items()))
          + f"; ratio gpud/NVIDIA {idle['gpud'][0] / idle['nvidia'][0]:.2f}")
    print(f"RSS: gpud dra-plugin {rss['gpud']:.1f} MiB (gpud serve beside it {gpud_rss:.1f} MiB); NVIDIA "
          f"gpu-kubelet-plugin {rss['nvidia']:.1f} MiB; ratio plugin/plugin {rss['gpud'] / rss['nvidia']:.2f}")
    return True


def wanted_names(gpud: Client) -> list[str]:
    """The device names gpud's plugin publishes for gpud's current state."""
    devices, _ = node_devices(gpud.get("/v1/gpus"), gpud.get("/v1/node"))
    return sorted(d.name for d in devices)


def simulated(args, work: Path, measure_prepare: bool) -> None:
    """gpud's plugin on a simulated hgx-a100-4gpu: MIG changes (and Prepare where NVIDIA's part was skipped)."""
    sock = work / "sim" / "g.sock"
    (work / "sim").mkdir()
    (work / "sim" / "gpud.yaml").write_text(f"mig:\n  layouts_file: {work / 'absent.yaml'}\n")
    gpud_proc = subprocess.Popen([sys.executable, "-m", "gpud", "serve", "--simulate", "hgx-a100-4gpu", "--sim-state",
                                  str(work / "sim" / "sim.json"), "--state-dir", str(work / "sim" / "state"),
                                  "--socket", str(sock), "--config", str(work / "sim" / "gpud.yaml"),
                                  "--log-level", "error"], cwd=REPO, stdout=subprocess.DEVNULL)
    kube = KubeApiStandIn(server_version="1.34")
    plugin = None
    try:
        kube.create_node(NODE)
        kube.bind_rbac("dra", DRA_RULES)
        gpud = Client(sock, timeout=120)
        wait_until_listening(sock, gpud_proc)
        wait(lambda: gpud.request("GET", "/healthz", ok_statuses=(503,))[0] == 200, 30, "gpud healthy")
        wait(lambda: gpud.get("/v1/mig")["state"] not in ("pending", "applying"), 30, "MIG start-up convergence")
        plugin = GpudDraPlugin(work / "simplugin", kube.kubeconfig("dra"), NODE, sock, "--log-level", "error")
        plugin.wait_serving()
        wait(lambda: len(devices_of(kube, NODE)) == 4, 30, "4 GPUs published")
        if measure_prepare:
            ours = prepare_unprepare({"gpud": plugin}, {"gpud": kube}, NODE, args.claims, 4)["gpud"]
            print(f"gpud's plugin alone on a simulated hgx-a100-4gpu, {args.claims} claims of one GPU each")
            print(f"Prepare: gpud {figures(ours[0])} (no baseline: NVIDIA's plugin was skipped)")
            print(f"Unprepare: gpud {figures(ours[1])}")
            idle = idle_per_hour({"gpud": kube}, args.idle_seconds)["gpud"]
            print(f"idle API requests per node-hour ({args.idle_seconds:g} s window, {RENEWALS_PER_HOUR:.0f} watch "
                  f"renewals an hour): gpud {idle[0]:.0f} ({idle[1]} in the window, {idle[2]} per renewal)")
            print(f"RSS: gpud dra-plugin {rss_mib(plugin.proc.pid):.1f} MiB (gpud serve beside it "
                  f"{rss_mib(gpud_proc.pid):.1f} MiB)")
        from_put, from_answer, counts = [], [], []
        for i in range(args.mig_changes):
            layout = MIG_LAYOUTS[i % len(MIG_LAYOUTS)]
            started = time.perf_counter()
            status, answer = gpud.request("PUT", "/v1/mig?wait=true", {"layout": layout})
            answered = time.perf_counter()
            if status != 200:
                raise SystemExit(f"PUT /v1/mig {layout}: {status} {json.dumps(answer)[:300]}")
            names = wanted_names(gpud)
            wait(lambda: sorted(devices_of(kube, NODE)) == names, 30, f"the slice of {layout}")
            published = time.perf_counter()
            from_put.append((published - started) * 1000)
            from_answer.append((published - answered) * 1000)
            counts.append(len(names))
        print(f"MIG change -> republished slice (simulated hgx-a100-4gpu, {args.mig_changes} changes between "
              f"{' and '.join(MIG_LAYOUTS)}, {min(counts)}-{max(counts)} devices): from the PUT {figures(from_put)}; "
              f"after its answer {figures(from_answer)}")
    finally:
        if plugin is not None:
            plugin.stop()
        kube.stop()
        gpud_proc.terminate()
        gpud_proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=40)
    parser.add_argument("--mig-changes", type=int, default=4)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--nvidia-qps", type=float, help="NVIDIA's --kube-api-qps (default: its own, 5: past a "
                        "burst of 10, each Prepare's GET of its claim waits for client-go's rate limiter)")
    parser.add_argument("--nvidia-burst", type=int, default=1000, help="NVIDIA's --kube-api-burst with --nvidia-qps")
    parser.add_argument("--without-nvidia", action="store_true", help="gpud's plugin alone (as without ../shared)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gbd", dir="/tmp"))  # short: socket paths hold 108 bytes
    try:
        compared = side_by_side(args, work)
        simulated(args, work, measure_prepare=not compared)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
