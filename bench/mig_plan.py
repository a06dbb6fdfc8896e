"""Benchmark: gpud's MIG planner against mig-parted's full recreate, on 8× A100-SXM4-40GB.

Usage: python bench/mig_plan.py [--rounds N]

For every ordered pair of mig-parted's standard A100-40GB layouts (config-default.yaml), the 8 GPUs
start in the first layout (all-disabled: MIG off, no instances) and are planned to the second. Prints
the planning time of plan_gpu (median and worst µs per GPU over all rounds; the worst includes the
first, cold call) and the NVML mutations (creates + destroys) over the 8 GPUs of plan_gpu beside
plan_full_recreate (mig-parted's way, the baseline defined here), then totals and the ratio. The MIG
table is what gpud reads from a simulated A100 with MIG on. Nothing is run on a GPU: plans only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pynvml  # noqa: E402

from gpud.mig.planner import plan_gpu, plan_restore  # noqa: E402
from gpud.model.mig import (  # noqa: E402
    ComputeInstanceState,
    GiTarget,
    GpuInstanceState,
    GpuMigState,
    GpuPlan,
    MigCapabilities,
)
from gpud.nvml.reader import NodeReader  # noqa: E402
from gpud.nvml.sim import SimulatedNvml  # noqa: E402

GPUS = 8
LAYOUTS = {
    "all-disabled": {},
    "all-enabled": {},
    "all-1g.5gb": {"1g.5gb": 7},
    "all-1g.5gb.me": {"1g.5gb+me": 1},
    "all-2g.10gb": {"2g.10gb": 3},
    "all-3g.20gb": {"3g.20gb": 2},
    "all-4g.20gb": {"4g.20gb": 1},
    "all-7g.40gb": {"7g.40gb": 1},
    "all-balanced": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1},
}


def simulated_capabilities(model: str) -> MigCapabilities:
    """The MIG table gpud reads from a simulated `model` GPU (gpud/nvml/sim/models.yaml) with MIG on."""
    with tempfile.TemporaryDirectory() as state:
        sim = SimulatedNvml(f"{model}:1", Path(state) / "sim.json")
        sim.nvmlInit()
        sim.nvmlDeviceSetMigMode(sim.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_DEVICE_MIG_ENABLE)
        sim.nvmlShutdown()
        sim.sim_reset_gpu(0)  # Ampere switches MIG mode at a GPU reset (§7.2); later GPUs already have
        sim.nvmlInit()
        try:
            return NodeReader().read(sim, {}).gpus[0].mig.capabilities
        finally:
            sim.nvmlShutdown()


def state_after(gpu: GpuMigState, plan: GpuPlan) -> GpuMigState:
    """The GPU as it is once `plan` is carried out: what the benchmark (and the planner's tests) go on from.

    Kept instances keep their ids; new ones get the lowest free ids (NVML may choose others).
    """
    current = {gi.gi_id: gi for gi in (gpu.instances if gpu.mode_enabled else ())}
    taken = {gi.keep_gi_id for gi in plan.target if gi.keep_gi_id is not None}
    instances = []
    for target in plan.target:
        gi_id = target.keep_gi_id if target.keep_gi_id is not None else _lowest_free(taken)
        taken.add(gi_id)
        old = {ci.ci_id: ci for ci in current[gi_id].compute_instances} if target.keep_gi_id is not None else {}
        instances.append(GpuInstanceState(gi_id, target.profile_id, target.placement,
                                          _compute_instances_after(gpu.uuid, gi_id, target, old)))
    return replace(gpu, instances=tuple(sorted(instances, key=lambda gi: gi.gi_id)))


def _compute_instances_after(gpu_uuid: str, gi_id: int, target: GiTarget,
                             old: dict[int, ComputeInstanceState]) -> tuple[ComputeInstanceState, ...]:
    taken = {ci.keep_ci_id for ci in target.compute_instances if ci.keep_ci_id is not None}
    result = []
    for ci in target.compute_instances:
        if ci.keep_ci_id is not None:
            result.append(old[ci.keep_ci_id])
            continue
        ci_id = _lowest_free(taken)
        taken.add(ci_id)
        result.append(ComputeInstanceState(ci_id, ci.constant, ci.start, ci.slices, f"MIG-{gpu_uuid}-{gi_id}-{ci_id}"))
    return tuple(sorted(result, key=lambda ci: ci.ci_id))


def _lowest_free(taken: set[int]) -> int:
    return next(i for i in range(len(taken) + 1) if i not in taken)


def plan_full_recreate(gpu: GpuMigState, desired: Mapping[str, int]) -> GpuPlan:
    """mig-parted's apply: the same target as plan_gpu, but every instance destroyed and created anew.

    Like mig-parted it leaves a GPU alone whose devices already match the wanted counts.
    """
    plan = plan_gpu(gpu, desired)
    current = tuple(sorted(gpu.instances, key=lambda gi: gi.gi_id)) if gpu.mode_enabled else ()
    as_is = plan_restore(gpu, current)  # keeps every current instance
    if Counter(ci.name for gi in as_is.target for ci in gi.compute_instances) == +Counter(desired):
        return as_is
    fresh = tuple(replace(gi, keep_gi_id=None, compute_instances=tuple(replace(ci, keep_ci_id=None)
                                                                       for ci in gi.compute_instances))
                  for gi in plan.target)
    return GpuPlan(index=gpu.index, uuid=gpu.uuid, target=fresh,
                   destroy_cis=tuple((gi.gi_id, ci.ci_id) for gi in current for ci in gi.compute_instances),
                   destroy_gis=tuple(gi.gi_id for gi in current), create_gis=fresh)


def node_in(layout: str) -> list[GpuMigState]:
    """8 GPUs carrying `layout`, as gpud would have built it from an empty GPU."""
    capabilities = simulated_capabilities("A100-SXM4-40GB")
    gpus = []
    for index in range(GPUS):
        empty = GpuMigState(index=index, uuid=f"GPU-bench-{index}", pci_device_id="0x20B010DE", capable=True,
                            mode_enabled=layout != "all-disabled", capabilities=capabilities)
        gpus.append(state_after(empty, plan_gpu(empty, LAYOUTS[layout])) if empty.mode_enabled else empty)
    return gpus


def measure(source: str, target: str, rounds: int) -> dict:
    gpus, desired = node_in(source), LAYOUTS[target]
    times = []
    for _ in range(rounds):
        for gpu in gpus:
            started = time.perf_counter()
            plan_gpu(gpu, desired)
            times.append((time.perf_counter() - started) * 1e6)
    plans = [plan_gpu(gpu, desired) for gpu in gpus]
    return {"median_us": statistics.median(times), "worst_us": max(times), "times": times,
            "gpud": sum(plan.mutations for plan in plans), "kept": sum(plan.kept for plan in plans),
            "recreate": sum(plan_full_recreate(gpu, desired).mutations for gpu in gpus)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    print(f"{GPUS}× A100-SXM4-40GB, {len(LAYOUTS) ** 2} layout transitions, {args.rounds} rounds")
    print(f"{'from':<15}{'to':<15}{'median µs':>10}{'worst µs':>10}{'gpud':>6}{'recreate':>10}{'kept':>6}")
    results = []
    for source in LAYOUTS:
        for target in LAYOUTS:
            row = measure(source, target, args.rounds)
            results.append(row)
            print(f"{source:<15}{target:<15}{row['median_us']:>10.0f}{row['worst_us']:>10.0f}"
                  f"{row['gpud']:>6}{row['recreate']:>10}{row['kept']:>6}")
    gpud, recreate = sum(r["gpud"] for r in results), sum(r["recreate"] for r in results)
    every_time = [t for r in results for t in r["times"]]
    print(f"planning per GPU: median {statistics.median(every_time):.0f} µs, worst {max(every_time):.0f} µs")
    print(f"NVML mutations: gpud {gpud}, full recreate {recreate}, ratio recreate/gpud {recreate / gpud:.2f}; "
          f"MIG devices kept by gpud {sum(r['kept'] for r in results)}")


if __name__ == "__main__":
    main()
