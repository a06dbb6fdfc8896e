"""Benchmark: gpud's Slurm integration, as ratios against baselines measured in the same run.

Usage: python bench/slurm.py [--rounds N]

1. gres.conf build: build_gres (gpud/slurm/gres.py) on a simulated DGX A100 (8x A100-SXM4-40GB), once in
   MIG layout all-1g.5gb (7 1g.5gb devices a GPU, 56 records) and once with MIG off (8 records). The
   baseline is gpud's CDI spec build, build_spec (gpud/cdi/spec.py), from the same inventory in the same
   run: the daemon rebuilds both on every inventory change, and the CDI build is the accepted cost. Both are
   the pure builds: the MIG minors table parsed and the host's device nodes listed (every node present, no
   sharing, no MPS, no driver files) once beforehand; Cores= from this host's /sys (CoreIndex). Each round
   is BUILDS builds of each, alternating; prints the median and p99 µs of each and the ratio gres/cdi.
2. `gpud slurm health` as slurmd's HealthCheckProgram runs it: a fresh process each time,
   `python -m gpud slurm health --socket S --node-name n1 --scontrol <stand-in>`, against a running gpud
   (`gpud serve` on a simulated DGX A100 with those 56 MIG devices, healthy, so nothing is drained). The
   baseline is the plain CLI reading the same /v1/health, `python -m gpud health --socket S --json`, run
   alternately with it, one of each a round. scontrol is a stand-in (a /bin/sh script printing one Slurm
   22.05 `scontrol show node -o n1` line, state IDLE): only the health program runs it, so its time is in
   the health program's figure alone. Prints the median and max ms of each, the ratio of the medians, and
   the margin to slurmd's 60 s kill limit (60 s / the slowest run).
Figures are read by people: the machine is shared and noisy, so the ratios are what count.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpud.base.logs import configure_logging  # noqa: E402
from gpud.cdi.spec import CONTROL_NODES, HostDevices, build_spec, parse_mig_minors  # noqa: E402
from gpud.client import ApiFailure, Client, DaemonUnreachable  # noqa: E402
from gpud.model.inventory import Inventory  # noqa: E402
from gpud.nvml.reader import NodeReader  # noqa: E402
from gpud.nvml.sim import SimulatedNvml  # noqa: E402
from gpud.nvml.sim.mig_minors import mig_minors_text  # noqa: E402
from gpud.nvml.sim.scenarios import fill_with_gpu_instances  # noqa: E402
from gpud.slurm.cores import CoreIndex  # noqa: E402
from gpud.slurm.gres import build_gres  # noqa: E402

PRESET = "dgx-a100"
BUILDS = 50  # builds of each spec per round and layout
NODE = "n1"
SLURMD_LIMIT_S = 60.0  # slurmd kills a HealthCheckProgram after 60 s (slurmd.c run_script_health_check)
# `scontrol show node -o n1` of Slurm 22.05.8, node IDLE
SHOW_NODE = ("NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=1.06 "
             "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:1g.5gb:56 NodeAddr=127.0.0.1 NodeHostName=n1 "
             "Version=22.05.8 OS=Linux 6.1 RealMemory=1 AllocMem=0 FreeMem=21535 Sockets=2 Boards=1 State=IDLE "
             "ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu  "
             "BootTime=2026-11-25T22:39:54 SlurmdStartTime=2026-11-26T10:04:55 LastBusyTime=2026-11-26T10:05:01 "
             "CfgTRES=cpu=2,mem=1M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 "
             "ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s")
# answers only the call gpud slurm health makes (gpud/slurm/health.py Scontrol.show_node); an update fails
SCONTROL = f"""#!/bin/sh
if [ "$*" = "show node -o {NODE}" ]; then
  echo '{SHOW_NODE}'
  exit 0
fi
echo "scontrol stand-in: unexpected call: $*" >&2
exit 1
"""


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


# -- 1. gres.conf and CDI spec builds ---------------------------------------------------------------


def simulated_inventory(sim_state: Path, mig: bool) -> Inventory:
    """What gpud reads from a simulated DGX A100 whose state is sim_state: all-1g.5gb with mig, else MIG off."""
    sim = SimulatedNvml(PRESET, sim_state)
    sim.nvmlInit()
    try:
        if mig:
            fill_with_gpu_instances(sim, sim.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
        return NodeReader(sysfs=sim.sysfs_root).read(sim, {})
    finally:
        sim.nvmlShutdown()


def host_devices(inventory: Inventory, minors: dict[str, int]) -> HostDevices:
    """Every device node the spec can name present on the host (as on a real node with the driver loaded)."""
    paths = [f"/dev/nvidia{gpu.minor_number}" for gpu in inventory.gpus] + list(CONTROL_NODES)
    paths += [f"/dev/nvidia-caps/nvidia-cap{minor}" for cap, minor in minors.items()
              if cap.startswith("gpu") and int(cap[3:cap.index("/")]) < len(inventory.gpus)]
    return HostDevices({path: path for path in paths}, minors)


def measure_builds(inventory: Inventory, rounds: int) -> tuple[int, list[float], list[float]]:
    minors = parse_mig_minors(mig_minors_text())
    cores = CoreIndex(Path("/sys"))
    host = host_devices(inventory, minors)
    gres = build_gres(inventory, None, minors, cores)
    spec = build_spec(inventory, None, {}, host)
    if gres.unavailable or spec.unavailable:  # a device left out would be a cheaper, different build
        raise SystemExit(f"devices left out: gres {gres.unavailable[:2]}, cdi {spec.unavailable[:2]}")
    clock = time.perf_counter
    gres_us, cdi_us = [], []
    for _ in range(rounds * BUILDS):
        started = clock()
        build_gres(inventory, None, minors, cores)
        middle = clock()
        build_spec(inventory, None, {}, host)
        cdi_us.append((clock() - middle) * 1e6)
        gres_us.append((middle - started) * 1e6)
    return len(gres.records), gres_us, cdi_us


# -- 2. gpud slurm health, end to end ---------------------------------------------------------------


@contextlib.contextmanager
def gpud_with_mig(workdir: Path) -> Iterator[Path]:
    """`gpud serve` on a simulated DGX A100 carrying 56 1g.5gb MIG devices; its socket once /v1/health
    says healthy. Stopped afterwards."""
    sim_state, sock = workdir / "sim.json", workdir / "g.sock"
    simulated_inventory(sim_state, mig=True)
    gpud = subprocess.Popen([sys.executable, "-m", "gpud", "serve", "--simulate", PRESET, "--sim-state",
                             str(sim_state), "--state-dir", str(workdir / "state"), "--socket", str(sock),
                             "--log-level", "error"], cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        client, deadline, health = Client(sock, timeout=5), time.monotonic() + 30, None
        while True:
            if gpud.poll() is not None:
                raise SystemExit(f"gpud did not start (exit {gpud.returncode})")
            if time.monotonic() > deadline:
                raise SystemExit(f"gpud's /v1/health never said healthy: {health}")
            with contextlib.suppress(DaemonUnreachable, ApiFailure):
                health = client.get("/v1/health")
                mig_devices = sum(len(gpu.get("mig_devices", [])) for gpu in health.get("gpus", []))
                if health.get("status") == "healthy" and mig_devices == 56:
                    break
            time.sleep(0.05)
        yield sock
    finally:
        gpud.terminate()
        try:
            gpud.wait(10)
        except subprocess.TimeoutExpired:
            gpud.kill()
            gpud.wait(10)


def timed_run(argv: list[str], what: str) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=SLURMD_LIMIT_S, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    elapsed = (time.perf_counter() - started) * 1000
    if done.returncode != 0:
        raise SystemExit(f"{what} exited {done.returncode}: {done.stdout}{done.stderr}")
    return elapsed, done.stdout


def measure_health(workdir: Path, rounds: int) -> tuple[list[float], list[float], str]:
    scontrol = workdir / "scontrol"
    scontrol.write_text(SCONTROL)
    scontrol.chmod(0o755)
    with gpud_with_mig(workdir) as sock:
        slurm = [sys.executable, "-m", "gpud", "slurm", "health", "--socket", str(sock), "--node-name", NODE,
                 "--scontrol", str(scontrol)]
        plain = [sys.executable, "-m", "gpud", "health", "--socket", str(sock), "--json"]
        slurm_ms, plain_ms, said = [], [], ""
        for _ in range(rounds):
            elapsed, said = timed_run(slurm, "gpud slurm health")
            slurm_ms.append(elapsed)
            plain_ms.append(timed_run(plain, "gpud health --json")[0])
    decision = next((line for line in said.splitlines() if line.startswith("decision: ")), "")
    if not decision.startswith("decision: nothing"):
        raise SystemExit(f"gpud slurm health did not leave the healthy node alone: {said}")
    return slurm_ms, plain_ms, decision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20,
                        help=f"rounds: {BUILDS} builds of each spec per layout, and one run of each program "
                             "(default 20)")
    args = parser.parse_args()
    configure_logging("error", stream=sys.stderr)  # the reader's notes (a shipped MIG table used) are no figures
    workdir = Path(tempfile.mkdtemp(prefix="gb", dir="/tmp"))  # short: socket paths hold 108 bytes
    try:
        print(f"gres.conf build on a simulated {PRESET} (8x A100-SXM4-40GB), {args.rounds * BUILDS} builds "
              f"each, alternating; baseline: gpud's CDI spec build from the same inventory")
        for layout, mig in (("all-1g.5gb", True), ("MIG off", False)):
            inventory = simulated_inventory(workdir / f"build-{int(mig)}.json", mig)
            records, gres_us, cdi_us = measure_builds(inventory, args.rounds)
            gres_median, cdi_median = statistics.median(gres_us), statistics.median(cdi_us)
            print(f"gres.conf build, {PRESET} {layout} ({records} records): median {gres_median:.0f} µs, "
                  f"p99 {percentile(gres_us, 0.99):.0f} µs; CDI spec build: median {cdi_median:.0f} µs, "
                  f"p99 {percentile(cdi_us, 0.99):.0f} µs; ratio gres/cdi {gres_median / cdi_median:.2f}")
        print(f"gpud slurm health as slurmd's HealthCheckProgram runs it (a fresh process), against gpud on a "
              f"simulated {PRESET} with 56 MIG devices, healthy; {args.rounds} runs of each, alternating; "
              f"baseline: gpud health --json (the same /v1/health); scontrol is a stand-in script that only "
              f"gpud slurm health runs, so its time is in that figure alone")
        slurm_ms, plain_ms, decision = measure_health(workdir, args.rounds)
        slurm_median, plain_median = statistics.median(slurm_ms), statistics.median(plain_ms)
        print(f"gpud slurm health run: n={len(slurm_ms)} median {slurm_median:.0f} ms, max {max(slurm_ms):.0f} ms "
              f"({decision}); gpud health --json: median {plain_median:.0f} ms, max {max(plain_ms):.0f} ms; "
              f"ratio {slurm_median / plain_median:.2f}; slurmd's limit {SLURMD_LIMIT_S:g} s: "
              f"margin {SLURMD_LIMIT_S * 1000 / max(slurm_ms):.0f}x")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
