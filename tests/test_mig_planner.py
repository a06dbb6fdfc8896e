"""The MIG planner and the compute-instance profiles, on the tables gpud reads from simulated GPUs
(mig-profiles.md §3–§5).

Expected placements come from the tables; the property tests compare the planner with a brute-force
enumeration of every layout the placement tables allow.
"""

import importlib.util
import random
import subprocess
import sys
import time
from collections import Counter
from functools import cache
from itertools import combinations, permutations

import pynvml
import pytest
from helpers import REPO

from gpud.mig.planner import plan_gpu
from gpud.model.mig import ComputeInstanceState, GpuInstanceState, GpuMigState, GpuPlan, Placement, PlanError
from gpud.model.mig_profile_names import mig_device_name
from gpud.nvml.mig_tables import derive_ci_profiles, shipped_table


def _bench():
    """bench/mig_plan.py: it reads MIG tables from simulated GPUs and holds mig-parted's baseline."""
    spec = importlib.util.spec_from_file_location("mig_plan_bench", REPO / "bench" / "mig_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench()
state_after = BENCH.state_after  # what a plan leaves, modelled by the benchmark
A100 = BENCH.simulated_capabilities("A100-SXM4-40GB")
A30 = BENCH.simulated_capabilities("A30")
H100 = BENCH.simulated_capabilities("H100-SXM5-80GB")
CI_CONSTANTS_BY_SLICES = {slices: getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE")
                          for slices in (1, 2, 3, 4, 6, 7, 8)}
BALANCED = {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}


def empty_gpu(capabilities, enabled=True) -> GpuMigState:
    return GpuMigState(index=3, uuid="GPU-test", pci_device_id="0x20B010DE", capable=True, mode_enabled=enabled,
                       capabilities=capabilities)


def gpu_with(capabilities, *instances) -> GpuMigState:
    """A GPU holding GPU instances given as (gi_id, profile name, start, [(ci_id, ci slices, ci start), ...])."""
    states = []
    for gi_id, name, start, cis in instances:
        profile = capabilities.gi_profile(name)
        placement = next(p for p in profile.placements if p.start == start)
        constants = {ci.slices: ci.constant for ci in profile.ci_profiles}
        states.append(GpuInstanceState(gi_id, profile.id, placement, tuple(
            ComputeInstanceState(ci_id, constants[slices], ci_start, slices, f"MIG-{gi_id}-{ci_id}")
            for ci_id, slices, ci_start in cis)))
    return GpuMigState(index=3, uuid="GPU-test", pci_device_id="0x20B010DE", capable=True, mode_enabled=True,
                       capabilities=capabilities, instances=tuple(states))


def built(capabilities, desired) -> GpuMigState:
    gpu = empty_gpu(capabilities)
    return state_after(gpu, plan_gpu(gpu, desired))


def layout(plan: GpuPlan) -> list[tuple[str, int, list[tuple[str, int]]]]:
    return [(gi.name, gi.placement.start, [(ci.name, ci.start) for ci in gi.compute_instances]) for gi in plan.target]


def starts_of(plan: GpuPlan, name: str) -> list[int]:
    return [gi.placement.start for gi in plan.target if gi.name == name]


def devices(plan: GpuPlan) -> Counter:
    return Counter(ci.name for gi in plan.target for ci in gi.compute_instances)


def assert_valid(capabilities, plan: GpuPlan) -> None:
    """The target obeys the tables: valid placements, no overlap, instance counts, CI positions."""
    used = set()
    for gi in plan.target:
        profile = capabilities.gi_profile_by_id(gi.profile_id)
        assert gi.placement in profile.placements
        slots = set(range(gi.placement.start, gi.placement.start + gi.placement.size))
        assert not used & slots
        used |= slots
        taken = set()
        for ci in gi.compute_instances:
            ci_profile = next(p for p in profile.ci_profiles if p.slices == ci.slices)
            assert ci.start in ci_profile.starts and ci.constant == ci_profile.constant
            assert not taken & set(range(ci.start, ci.start + ci.slices))
            taken |= set(range(ci.start, ci.start + ci.slices))
    for profile, count in Counter(gi.profile_id for gi in plan.target).items():
        assert count <= capabilities.gi_profile_by_id(profile).instance_count


# -- compute-instance profiles (§4.2–4.3) -------------------------------------------------------


@pytest.mark.parametrize("gi_slices, expected", [
    (7, [(0, 1, (0, 1, 2, 3, 4, 5, 6)), (1, 2, (0, 2, 4)), (2, 3, (0, 4)), (3, 4, (0,)), (4, 7, (0,))]),
    (4, [(0, 1, (0, 1, 2, 3)), (1, 2, (0, 2)), (3, 4, (0,))]),
    (3, [(0, 1, (0, 1, 2)), (1, 2, (0,)), (2, 3, (0,))]),
    (2, [(0, 1, (0, 1)), (1, 2, (0,))]),
    (1, [(0, 1, (0,))]),
])
def test_compute_instance_profiles_follow_the_reference(gi_slices, expected):
    profiles = derive_ci_profiles(gi_slices, CI_CONSTANTS_BY_SLICES)
    assert [(p.constant, p.slices, p.starts) for p in profiles] == expected


def test_double_memory_1g_offers_the_rev1_compute_instance():
    assert [(p.constant, p.slices) for p in derive_ci_profiles(1, CI_CONSTANTS_BY_SLICES, whole_constant=7)] == [(7, 1)]
    assert H100.gi_profile("1g.20gb").whole_ci.constant == 7
    assert H100.gi_profile("1g.10gb").whole_ci.constant == 0


def test_reference_tables():
    one_g = A100.gi_profile("1g.5gb")
    assert (one_g.id, one_g.constant, one_g.memory_mib, one_g.instance_count) == (19, 0, 4864, 7)
    assert [p.start for p in one_g.placements] == [0, 1, 2, 3, 4, 5, 6]
    assert A100.gi_profile("3g.20gb").placements == (Placement(0, 4), Placement(4, 4))
    assert (A30.memory_slices, A30.gi_profile("2g.12gb").id, A30.gi_profile("4g.24gb").id) == (4, 5, 0)
    # H200: 140.00 GiB in the real lgip on 580.159.04 (tests/fixtures/hardware/h200-580.159.04)
    assert shipped_table("0x233510DE").capabilities.gi_profile("7g.141gb").memory_mib == 143360
    assert shipped_table("0x20B510DE").capabilities.gi_profile("1g.20gb").constant == 9  # A100-SXM4-80GB
    assert shipped_table("0x1EB810DE") is None  # T4: no MIG table


# -- what fits on an A100-40GB -------------------------------------------------------------------


def test_seven_1g_instances_take_starts_0_to_6():
    plan = plan_gpu(empty_gpu(A100), {"1g.5gb": 7})
    assert starts_of(plan, "1g.5gb") == [0, 1, 2, 3, 4, 5, 6]
    assert plan.mutations == 14 and plan.kept == 0


def test_4g_and_3g_share_the_gpu():
    plan = plan_gpu(empty_gpu(A100), {"4g.20gb": 1, "3g.20gb": 1})
    assert layout(plan) == [("4g.20gb", 0, [("4g.20gb", 0)]), ("3g.20gb", 4, [("3g.20gb", 0)])]


@pytest.mark.parametrize("desired, reason", [
    ({"4g.20gb": 2}, "4g.20gb ×2 cannot fit: at most 1 instance of 4g.20gb"),
    ({"3g.20gb": 3}, "3g.20gb ×3 cannot fit: at most 2 instances of 3g.20gb"),
    ({"1g.5gb+me": 2}, "1g.5gb+me ×2 cannot fit: at most 1 instance of 1g.5gb+me"),
    ({"1c.7g.40gb": 8}, "at most 1 instance of 7g.40gb; these compute instances need 2"),
    ({"4g.20gb": 1, "3g.20gb": 1, "1g.5gb": 1}, "needs 9 memory slices, the GPU has 8"),
    ({"2g.10gb": 3, "1g.5gb": 2}, "no non-overlapping placement for 2g.10gb ×3 + 1g.5gb ×2"),
])
def test_what_cannot_fit_is_refused_with_the_reason(desired, reason):
    with pytest.raises(PlanError, match="GPU 3 .*8 memory slices") as refused:
        plan_gpu(empty_gpu(A100), desired)
    assert reason in str(refused.value) and refused.value.gpu_index == 3


def test_balanced_fits_whatever_the_order_of_the_request():
    plans = {plan_gpu(empty_gpu(A100), dict(order)) for order in permutations(BALANCED.items())}
    assert len(plans) == 1
    plan = plans.pop()
    assert devices(plan) == Counter(BALANCED)
    assert_valid(A100, plan)


def test_the_auto_placement_trap_is_planned():
    # §5.2: creating 1g, 1g, 2g lets the driver put them at 6, 4 and 0, after which a 3g fails.
    trapped = gpu_with(A100, (13, "1g.5gb", 6, [(0, 1, 0)]), (11, "1g.5gb", 4, [(0, 1, 0)]),
                       (3, "2g.10gb", 0, [(0, 2, 0)]))
    plan = plan_gpu(trapped, BALANCED)
    assert layout(plan) == [("2g.10gb", 0, [("2g.10gb", 0)]), ("1g.5gb", 2, [("1g.5gb", 0)]),
                            ("1g.5gb", 3, [("1g.5gb", 0)]), ("3g.20gb", 4, [("3g.20gb", 0)])]
    assert plan.target[0].keep_gi_id == 3 and plan.destroy_gis == (11, 13)


def test_compute_instances_of_one_profile_share_a_gpu_instance():
    plan = plan_gpu(empty_gpu(A100), {"1c.3g.20gb": 3})
    assert layout(plan) == [("3g.20gb", 0, [("1c.3g.20gb", 0), ("1c.3g.20gb", 1), ("1c.3g.20gb", 2)])]


def test_a_2c_and_a_1c_fill_one_3g_instance():
    # In a 3g GI a 2c can only start at 0 (§4.3), so the 1c goes to slice 2.
    plan = plan_gpu(empty_gpu(A100), {"1c.3g.20gb": 1, "2c.3g.20gb": 1})
    assert layout(plan) == [("3g.20gb", 0, [("2c.3g.20gb", 0), ("1c.3g.20gb", 2)])]


def test_two_1c_and_a_2c_need_two_3g_instances():
    # 4 compute slices: more than one 3g GI holds, and both 3g placements are free.
    plan = plan_gpu(empty_gpu(A100), {"1c.3g.20gb": 2, "2c.3g.20gb": 1})
    assert layout(plan) == [("3g.20gb", 0, [("2c.3g.20gb", 0), ("1c.3g.20gb", 2)]),
                            ("3g.20gb", 4, [("1c.3g.20gb", 0)])]


def test_seven_1c_in_one_7g_instance():
    plan = plan_gpu(empty_gpu(A100), {"1c.7g.40gb": 7})
    assert layout(plan) == [("7g.40gb", 0, [("1c.7g.40gb", start) for start in range(7)])]


def test_unknown_profiles_are_refused_naming_what_the_gpu_offers():
    with pytest.raises(PlanError) as refused:
        plan_gpu(empty_gpu(A100), {"1g.10gb": 1, "1g.6gb": 1, "5c.7g.40gb": 1})
    message = str(refused.value)
    # the GPU's devices in the order NVML lists its profiles (by profile constant)
    assert "GPU 3" in message and "1g.6gb, 5c.7g.40gb;" in message and "offers 1g.5gb, 1c.2g.10gb, 2g.10gb" in message


def test_zero_counts_mean_nothing():
    assert plan_gpu(empty_gpu(A100), {"7g.40gb": 0, "1g.6gb": 0}).target == ()


def test_a_gpu_without_mig_cannot_be_planned():
    with pytest.raises(PlanError, match="not MIG-capable"):
        plan_gpu(empty_gpu(None), {})


# -- A30 and H100 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("capabilities, name, count, starts", [
    (A30, "1g.6gb", 4, [0, 1, 2, 3]),
    (A30, "2g.12gb", 2, [0, 2]),
    (A30, "4g.24gb", 1, [0]),
    (H100, "1g.10gb", 7, [0, 1, 2, 3, 4, 5, 6]),
    (H100, "1g.10gb+me", 1, [0]),
    (H100, "1g.20gb", 4, [0, 2, 4, 6]),
    (H100, "2g.20gb", 3, [0, 2, 4]),
    (H100, "3g.40gb", 2, [0, 4]),
    (H100, "4g.40gb", 1, [0]),
    (H100, "7g.80gb", 1, [0]),
])
def test_single_profile_layouts(capabilities, name, count, starts):
    plan = plan_gpu(empty_gpu(capabilities), {name: count})
    assert starts_of(plan, name) == starts
    assert_valid(capabilities, plan)


def test_h100_balanced():
    desired = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    plan = plan_gpu(empty_gpu(H100), desired)
    assert devices(plan) == Counter(desired)
    assert_valid(H100, plan)


def test_h100_double_memory_1g_gets_ci_profile_7():
    plan = plan_gpu(empty_gpu(H100), {"1g.20gb": 1})
    assert plan.target[0].compute_instances[0].constant == 7


# -- minimal changes -------------------------------------------------------------------------------


def test_making_room_for_a_2g_destroys_only_the_two_1g_in_its_way():
    gpu = built(A100, {"1g.5gb": 7})
    plan = plan_gpu(gpu, {"1g.5gb": 5, "2g.10gb": 1})
    (created,) = plan.create_gis
    assert created.name == "2g.10gb"
    in_the_way = [gi.gi_id for gi in gpu.instances if created.placement.start <= gi.placement.start
                  < created.placement.start + created.placement.size]
    assert plan.destroy_gis == tuple(in_the_way) and len(in_the_way) == 2
    assert plan.destroy_cis == tuple((gi_id, 0) for gi_id in in_the_way)
    kept = {gi.keep_gi_id for gi in plan.target} - {None}
    assert kept == {gi.gi_id for gi in gpu.instances} - set(in_the_way)
    assert plan.kept == 5 and plan.create_cis == () and plan.mutations == 6


def test_the_same_layout_again_changes_nothing():
    gpu = built(A100, BALANCED)
    plan = plan_gpu(gpu, dict(reversed(BALANCED.items())))
    assert plan.mutations == 0 and plan.kept == 4
    assert state_after(gpu, plan) == gpu


def test_a_leftover_empty_gpu_instance_is_reused():
    gpu = gpu_with(A100, (3, "2g.10gb", 0, []), (9, "1g.5gb", 2, [(0, 1, 0)]))
    plan = plan_gpu(gpu, {"2g.10gb": 1, "1g.5gb": 1})
    assert plan.destroy_gis == () and plan.destroy_cis == () and plan.create_gis == ()
    assert [(gi_id, ci.name, ci.start) for gi_id, ci in plan.create_cis] == [(3, "2g.10gb", 0)]


def test_a_leftover_empty_gpu_instance_no_one_needs_is_destroyed():
    gpu = gpu_with(A100, (3, "2g.10gb", 0, []), (9, "1g.5gb", 2, [(0, 1, 0)]))
    plan = plan_gpu(gpu, {"1g.5gb": 2})
    assert plan.destroy_gis == (3,) and plan.destroy_cis == ()
    assert plan.kept == 1 and [gi.name for gi in plan.create_gis] == ["1g.5gb"]


@pytest.mark.parametrize("before, after, removed", [
    (BALANCED, {"1g.5gb": 1, "2g.10gb": 1, "3g.20gb": 1}, "1g.5gb"),
    (BALANCED, {"1g.5gb": 2, "3g.20gb": 1}, "2g.10gb"),
    ({"2g.10gb": 3}, {"2g.10gb": 2}, "2g.10gb"),
])
def test_lowering_one_count_keeps_everything_else(before, after, removed):
    gpu = built(A100, before)
    plan = plan_gpu(gpu, after)
    assert plan.mutations == 2 and len(plan.destroy_gis) == 1
    (gone,) = [gi for gi in gpu.instances if gi.gi_id == plan.destroy_gis[0]]
    assert A100.gi_profile_by_id(gone.profile_id).name == removed


def test_raising_one_count_keeps_everything_else():
    gpu = built(A100, {"1g.5gb": 2, "3g.20gb": 1})
    plan = plan_gpu(gpu, {"1g.5gb": 3, "3g.20gb": 1})
    assert plan.kept == 3 and plan.mutations == 2 and [gi.name for gi in plan.create_gis] == ["1g.5gb"]


def test_a_gpu_instance_that_must_move_is_destroyed_and_created():
    gpu = gpu_with(A100, (7, "1g.5gb", 0, [(0, 1, 0)]))
    plan = plan_gpu(gpu, {"4g.20gb": 1, "1g.5gb": 1})
    assert plan.destroy_gis == (7,) and plan.destroy_cis == ((7, 0),)
    assert starts_of(plan, "4g.20gb") == [0] and starts_of(plan, "1g.5gb")[0] >= 4


def test_compute_instances_are_kept_inside_a_kept_gpu_instance():
    gpu = gpu_with(A100, (0, "7g.40gb", 0, [(ci, 1, ci) for ci in range(7)]))
    plan = plan_gpu(gpu, {"1c.7g.40gb": 5, "2c.7g.40gb": 1})
    assert plan.kept == 5 and plan.destroy_gis == () and len(plan.destroy_cis) == 2
    assert [(gi_id, ci.name) for gi_id, ci in plan.create_cis] == [(0, "2c.7g.40gb")]


def test_a_whole_gpu_instance_is_split_without_recreating_it():
    gpu = gpu_with(A100, (2, "3g.20gb", 4, [(0, 3, 0)]))
    plan = plan_gpu(gpu, {"1c.3g.20gb": 3})
    assert plan.destroy_gis == () and plan.destroy_cis == ((2, 0),) and len(plan.create_cis) == 3


def test_current_instances_do_not_count_with_mig_off():
    gpu = GpuMigState(**{**built(A100, BALANCED).__dict__, "mode_enabled": False})
    plan = plan_gpu(gpu, BALANCED)
    assert plan.destroy_gis == () and plan.destroy_cis == () and plan.mutations == 8


def test_full_recreate_rebuilds_the_same_target():
    gpu = built(A100, {"1g.5gb": 7})
    desired = {"1g.5gb": 5, "2g.10gb": 1}
    recreate, minimal = BENCH.plan_full_recreate(gpu, desired), plan_gpu(gpu, desired)
    assert layout(recreate) == layout(minimal) and recreate.kept == 0
    assert len(recreate.destroy_gis) == 7 and recreate.mutations == 14 + 12
    assert BENCH.plan_full_recreate(gpu, {"1g.5gb": 7}).mutations == 0  # mig-parted skips a GPU already right


# -- properties against brute force -----------------------------------------------------------------


def device_name(profile, ci_slices) -> str:
    return mig_device_name(profile.name, profile.slices, ci_slices)


def no_overlap(spans) -> bool:
    slots = [slot for start, size in spans for slot in range(start, start + size)]
    return len(slots) == len(set(slots))


@cache
def arrangements(profile):
    """Every non-empty set of compute instances one GPU instance can hold, as (slices, start) pairs."""
    candidates = [(ci.slices, start) for ci in profile.ci_profiles for start in ci.starts]
    return [chosen for size in range(1, len(candidates) + 1) for chosen in combinations(candidates, size)
            if no_overlap((start, slices) for slices, start in chosen)]


@cache
def every_layout(capabilities):
    """Every layout the tables allow, grouped by its MIG devices: {sorted device names: [layout, ...]}.

    A layout is a tuple of (GI profile, placement, compute instances); every GI holds at least one CI.
    """
    spots = [(profile, placement) for profile in capabilities.gi_profiles for placement in profile.placements]
    grouped = {}

    def visit(index, chosen):
        if index == len(spots):
            for contents in _products([arrangements(profile) for profile, _ in chosen]):
                gis = tuple((profile, placement, cis) for (profile, placement), cis in zip(chosen, contents))
                key = tuple(sorted(device_name(p, slices) for p, _, cis in gis for slices, _ in cis))
                grouped.setdefault(key, []).append(gis)
            return
        visit(index + 1, chosen)
        profile, placement = spots[index]
        fits = no_overlap([(p.start, p.size) for _, p in chosen] + [(placement.start, placement.size)])
        if fits and sum(p is profile for p, _ in chosen) < profile.instance_count:
            visit(index + 1, chosen + [spots[index]])

    visit(0, [])
    return grouped


def _products(options):
    if not options:
        yield ()
        return
    for first in options[0]:
        for rest in _products(options[1:]):
            yield (first,) + rest


def as_gpu(capabilities, gis, leftovers=()) -> GpuMigState:
    """A GPU holding the layout `gis`; GIs whose index is in `leftovers` have lost their CIs."""
    instances = [(gi_id, profile.name, placement.start,
                  [] if gi_id in leftovers else [(ci_id, slices, start) for ci_id, (slices, start) in enumerate(cis)])
                 for gi_id, (profile, placement, cis) in enumerate(gis)]
    return gpu_with(capabilities, *instances)


def best_kept(gpu, candidates) -> tuple[int, int]:
    """The most (compute instances, GPU instances) of `gpu` any of the fewest-GI candidate layouts keeps."""
    fewest = min(len(gis) for gis in candidates)
    current = {(gi.profile_id, gi.placement): gi for gi in gpu.instances}
    best = (0, 0)
    for gis in (gis for gis in candidates if len(gis) == fewest):
        kept_gis = [(current[(p.id, placement)], p, cis) for p, placement, cis in gis if (p.id, placement) in current]
        kept_cis = sum((ci.slices, ci.start) in cis and ci.profile_id == next(
            c.constant for c in p.ci_profiles if c.slices == ci.slices)
            for gi, p, cis in kept_gis for ci in gi.compute_instances)
        best = max(best, (kept_cis, len(kept_gis)))
    return best


def random_request(rng, capabilities, layouts, near=()):
    """A layout that exists, a random mix of the GPU's device names, or `near` with one device swapped."""
    names = sorted({device_name(gi, ci.slices) for gi in capabilities.gi_profiles for ci in gi.ci_profiles})
    roll = rng.random()
    if near and roll < 0.4:
        changed = list(near)
        changed.remove(rng.choice(changed))
        return Counter(changed + [rng.choice(names)])
    if roll < 0.7:
        return Counter(rng.choice(list(layouts)))
    return Counter({name: rng.randint(1, 4) for name in rng.sample(names, rng.randint(1, 3))})


@pytest.mark.parametrize("capabilities", [A100, A30], ids=["A100-40GB", "A30"])
def test_a_plan_exists_exactly_when_brute_force_finds_a_layout(capabilities):
    layouts, rng = every_layout(capabilities), random.Random(7)
    for _ in range(400):
        desired = random_request(rng, capabilities, layouts)
        exists = tuple(sorted(desired.elements())) in layouts
        try:
            plan = plan_gpu(empty_gpu(capabilities), desired)
        except PlanError:
            assert not exists, desired
            continue
        assert exists, desired
        assert devices(plan) == desired
        assert_valid(capabilities, plan)


@pytest.mark.parametrize("capabilities", [A100, A30], ids=["A100-40GB", "A30"])
def test_plans_keep_as_much_as_brute_force_and_lead_to_the_request(capabilities):
    layouts, rng = every_layout(capabilities), random.Random(11)
    layout_list = [gis for group in layouts.values() for gis in group if gis]
    for _ in range(400):
        current = rng.choice(layout_list)
        gpu = as_gpu(capabilities, current, leftovers={i for i in range(len(current)) if rng.random() < 0.2})
        desired = random_request(rng, capabilities, layouts, near=[device_name(p, slices) for p, _, cis in current
                                                                    for slices, _ in cis])
        key = tuple(sorted(desired.elements()))
        if key not in layouts:
            with pytest.raises(PlanError):
                plan_gpu(gpu, desired)
            continue
        plan = plan_gpu(gpu, desired)
        kept_gis = sum(gi.keep_gi_id is not None for gi in plan.target)
        assert (plan.kept, kept_gis) == best_kept(gpu, layouts[key]), (current, desired)
        assert plan_gpu(gpu, dict(reversed(list(desired.items())))) == plan
        after = state_after(gpu, plan)
        assert plan_gpu(after, desired).mutations == 0
        assert_valid(capabilities, plan)


def test_common_plans_are_fast():
    gpu = built(A100, {"1g.5gb": 7})
    started = time.perf_counter()
    for _ in range(20):
        plan_gpu(gpu, BALANCED)
    assert (time.perf_counter() - started) / 20 < 0.01


def test_benchmark_runs():
    result = subprocess.run([sys.executable, "bench/mig_plan.py", "--rounds", "1"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "81 layout transitions" in result.stdout and "ratio recreate/gpud" in result.stdout
