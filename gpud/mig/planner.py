"""The MIG planner: from a GPU's current instances and the MIG devices wanted, the fewest NVML changes.

Pure: it reads a GpuMigState and returns a GpuPlan, or raises PlanError before anything is touched.

1. Each wanted device name is resolved against the GPU's own profile table.
2. Compute instances smaller than their GPU instance are packed into the fewest GPU instances of
   their profile (an exact search over the CI start positions).
3. Every non-overlapping choice of GPU-instance placements is tried. Each is scored by what it keeps
   of the current layout: compute instances first, then GPU instances, then the longest run of
   memory slices it leaves free. Unlike mig-parted (create in some order, let the driver place,
   retry other orders), the result never depends on the order of the request.
4. The best layout is diffed against the current instances.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache, reduce
from itertools import combinations
from operator import or_

from gpud.model.mig import (
    CiTarget,
    ComputeInstanceState,
    GiProfile,
    GiTarget,
    GpuInstanceState,
    GpuMigState,
    GpuPlan,
    MigCapabilities,
    Placement,
    PlanError,
)
from gpud.model.mig_profile_names import mig_device_name, read_layout_profile

# The compute instances of one GPU instance, as (compute slices, start) pairs.
_Content = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _Demand:
    """What the wanted devices ask of one GPU-instance profile."""

    profile: GiProfile
    wanted: str  # the devices asked for, for messages: "1c.3g.20gb ×2 + 3g.20gb ×1"
    whole: int  # GPU instances holding one whole-GI compute instance
    partial: tuple[int, ...]  # slices of the smaller compute instances, largest first
    bins: int  # the fewest GPU instances the smaller compute instances fit in

    @property
    def count(self) -> int:
        return self.whole + self.bins


@dataclass(frozen=True)
class _Fill:
    """_Contents for the GPU instances of one profile: the kept ones (in order), then the new ones."""

    kept_cis: int
    kept: tuple[_Content, ...]
    new: tuple[_Content, ...]


def plan_gpu(gpu: GpuMigState, desired: Mapping[str, int]) -> GpuPlan:
    """The plan that gives `gpu` exactly the `desired` MIG devices (name → count) and keeps the most."""
    capabilities = _capabilities(gpu)
    demands = _demands(gpu, capabilities, desired)
    _check_capacity(gpu, capabilities, demands)
    current = _current_instances(gpu)
    return _diff(gpu, current, _best_target(gpu, capabilities, demands, current))


def plan_restore(gpu: GpuMigState, original: tuple[GpuInstanceState, ...]) -> GpuPlan:
    """The changes that put back exactly the given instances (same profiles, placements and starts),
    keeping whatever already matches: restored MIG devices get their UUIDs back. Used for rollback."""
    current = _current_instances(gpu)
    gis_by_place = {(gi.profile_id, gi.placement): gi for gi in current}
    target = []
    for wanted in _as_targets(_capabilities(gpu), original):
        have = gis_by_place.get((wanted.profile_id, wanted.placement))
        cis_by_start = {(ci.profile_id, ci.start, ci.slices): ci.ci_id for ci in have.compute_instances} if have else {}
        cis = tuple(replace(ci, keep_ci_id=cis_by_start.get((ci.constant, ci.start, ci.slices)))
                    for ci in wanted.compute_instances)
        target.append(replace(wanted, keep_gi_id=have.gi_id if have else None, compute_instances=cis))
    return _diff(gpu, current, tuple(target))


# -- the request ------------------------------------------------------------------------------


def _capabilities(gpu: GpuMigState) -> MigCapabilities:
    if gpu.capabilities is None:
        raise PlanError(f"GPU {gpu.index} is not MIG-capable", gpu.index)
    return gpu.capabilities


def _label(gpu: GpuMigState, capabilities: MigCapabilities) -> str:
    return f"GPU {gpu.index} ({gpu.pci_device_id}, {capabilities.memory_slices} memory slices)"


def _device_name(profile: GiProfile, ci_slices: int) -> str:
    return mig_device_name(profile.name, profile.slices, ci_slices)


def _offered_devices(capabilities: MigCapabilities) -> dict[str, tuple[GiProfile, int]]:
    """Every MIG device name the GPU offers → (its GI profile, its CI slices)."""
    return {_device_name(gi, ci.slices): (gi, ci.slices) for gi in capabilities.gi_profiles for ci in gi.ci_profiles}


def _why_unknown(name: str) -> str:
    """The name, with why no GPU can offer it where the name itself says so (`0g.5gb`, `2c.1g.5gb`)."""
    try:
        impossible = read_layout_profile(name)[1]
    except ValueError:
        impossible = None
    return name if impossible is None else f"{name} ({impossible})"


def _demands(gpu: GpuMigState, capabilities: MigCapabilities, desired: Mapping[str, int]) -> tuple[_Demand, ...]:
    offered = _offered_devices(capabilities)
    wanted = {name: count for name, count in sorted(desired.items()) if count}
    unknown = [name for name in wanted if name not in offered]
    if unknown:
        raise PlanError(f"{_label(gpu, capabilities)}: unknown MIG profile {', '.join(map(_why_unknown, unknown))}; "
                        f"this GPU offers {', '.join(offered)}", gpu.index)
    negative = [name for name, count in wanted.items() if count < 0]
    if negative:
        raise PlanError(f"{_label(gpu, capabilities)}: negative count for {', '.join(negative)}", gpu.index)
    by_profile: dict[GiProfile, dict[str, int]] = {}
    for name, count in wanted.items():
        by_profile.setdefault(offered[name][0], {})[name] = count
    demands = (_demand(gpu, capabilities, profile, names, offered) for profile, names in by_profile.items())
    # Biggest placements first: they have the fewest options, which prunes the search early.
    return tuple(sorted(demands, key=lambda d: (-_span(d.profile), d.profile.id)))


def _demand(gpu: GpuMigState, capabilities: MigCapabilities, profile: GiProfile, names: dict[str, int],
            offered: dict[str, tuple[GiProfile, int]]) -> _Demand:
    whole = names.get(profile.name, 0)
    partial = tuple(sorted((offered[name][1] for name, count in names.items() if name != profile.name
                            for _ in range(count)), reverse=True))
    wanted = " + ".join(f"{name} ×{count}" for name, count in names.items())
    bins = _fewest_bins(_starts_by_slices(profile), partial, profile.slices)
    if bins is None:
        raise PlanError(f"{_label(gpu, capabilities)}: {wanted} cannot be placed inside {profile.name}", gpu.index)
    return _Demand(profile, wanted, whole, partial, bins)


def _check_capacity(gpu: GpuMigState, capabilities: MigCapabilities, demands: tuple[_Demand, ...]) -> None:
    """Refuses what cannot fit whatever the placement, with the reason a person can act on."""
    label = _label(gpu, capabilities)
    for demand in demands:
        limit = demand.profile.instance_count
        if demand.count > limit:
            need = f"; these compute instances need {demand.count}" if demand.bins else ""
            raise PlanError(f"{label}: {demand.wanted} cannot fit: at most {limit} instance"
                            f"{'' if limit == 1 else 's'} of {demand.profile.name}{need}", gpu.index)
    slices = sum(demand.count * _span(demand.profile) for demand in demands)
    if slices > capabilities.memory_slices:
        raise PlanError(f"{label}: {_everything(demands)} needs {slices} memory slices, "
                        f"the GPU has {capabilities.memory_slices}", gpu.index)


def _everything(demands: tuple[_Demand, ...]) -> str:
    return " + ".join(demand.wanted for demand in demands)


def _span(profile: GiProfile) -> int:
    """Memory slices one instance of the profile takes."""
    return min((placement.size for placement in profile.placements), default=0)


def _current_instances(gpu: GpuMigState) -> tuple[GpuInstanceState, ...]:
    # Instances only exist in MIG mode; with MIG off whatever was recorded is gone.
    return tuple(sorted(gpu.instances, key=lambda gi: gi.gi_id)) if gpu.mode_enabled else ()


# -- compute instances inside one GPU instance ----------------------------------------------------


def _starts_by_slices(profile: GiProfile) -> tuple[tuple[int, ...], ...]:
    """Where a CI of each size may start, indexed by its slices (sizes the GI lacks: none)."""
    starts = {ci.slices: ci.starts for ci in profile.ci_profiles}
    return tuple(starts.get(slices, ()) for slices in range(profile.slices + 1))


def _fewest_bins(starts: tuple[tuple[int, ...], ...], partial: tuple[int, ...], gi_slices: int) -> int | None:
    lower = -(-sum(partial) // gi_slices)
    return next((bins for bins in range(lower, len(partial) + 1) if _pack(starts, partial, (0,) * bins) is not None),
                None)


@lru_cache(maxsize=1 << 16)
def _pack(starts: tuple[tuple[int, ...], ...], sizes: tuple[int, ...],
          used: tuple[int, ...]) -> tuple[_Content, ...] | None:
    """Places CIs of `sizes` (largest first) into GIs whose taken compute slices are the `used` bitmasks.

    Returns, per GI, the (slices, start) added, or None when they cannot all be placed.
    """
    if not sizes:
        return tuple(() for _ in used)
    if sum(sizes) > sum(len(starts) - 1 - mask.bit_count() for mask in used):
        return None
    size, rest = sizes[0], sizes[1:]
    tried = set()
    for index, mask in enumerate(used):
        if mask in tried:  # GIs with the same slices taken are interchangeable
            continue
        tried.add(mask)
        for start in starts[size]:
            bits = ((1 << size) - 1) << start
            if mask & bits:
                continue
            placed = _pack(starts, rest, used[:index] + (mask | bits,) + used[index + 1:])
            if placed is not None:
                return placed[:index] + (((size, start),) + placed[index],) + placed[index + 1:]
    return None


def _bits(content: _Content) -> int:
    return sum(((1 << size) - 1) << start for size, start in content)


def _without(sizes: tuple[int, ...], content: _Content) -> tuple[int, ...] | None:
    """`sizes` less the sizes of `content` (both as multisets), or None if it does not contain them."""
    rest = list(sizes)
    for size, _ in content:
        if size not in rest:
            return None
        rest.remove(size)
    return tuple(rest)


class _FillSearch:
    """The contents for one profile's GPU instances that keep the most current compute instances.

    Each kept GPU instance either holds a whole-GI compute instance or some of the smaller ones; of
    those, any of its current compute instances may stay where they are. The smaller compute
    instances left over must then pack into the remaining GPU instances.
    """

    def __init__(self, demand: _Demand, kept: tuple[GpuInstanceState, ...]):
        self.demand = demand
        self.starts = _starts_by_slices(demand.profile)
        self.options = [self._options(gi) for gi in kept]
        # the most the GPU instances from i on can still keep, to cut hopeless branches
        self.bound = [sum(options[0][0] for options in self.options[i:]) for i in range(len(kept) + 1)]
        self.best: _Fill | None = None

    def run(self) -> _Fill:
        self._search(0, self.demand.whole, (), self.demand.partial, 0)
        assert self.best is not None  # keeping nothing always fits: the demand alone fits
        return self.best

    def _options(self, gi: GpuInstanceState) -> list[tuple[int, _Content | None]]:
        """(compute instances kept, what stays) for each role the GI can take; None = one whole-GI CI."""
        profile = self.demand.profile
        whole = profile.whole_ci
        has_whole = any((ci.profile_id, ci.slices, ci.start) == (whole.constant, whole.slices, 0)
                        for ci in gi.compute_instances)
        keepable = tuple((ci.slices, ci.start) for ci in gi.compute_instances if self._keepable(ci))
        options = [(int(has_whole), None)] + [(len(subset), subset) for size in range(len(keepable), -1, -1)
                                              for subset in combinations(keepable, size)]
        return sorted(options, key=lambda option: -option[0])

    def _keepable(self, ci: ComputeInstanceState) -> bool:
        profile = next((p for p in self.demand.profile.ci_profiles if p.slices == ci.slices), None)
        return (profile is not None and ci.slices < self.demand.profile.slices and profile.constant == ci.profile_id
                and ci.start in profile.starts and ci.slices in self.demand.partial)

    def _search(self, index: int, wholes: int, partial_roles: tuple[_Content | None, ...],
                sizes: tuple[int, ...], kept_cis: int) -> None:
        if self.best is not None and kept_cis + self.bound[index] <= self.best.kept_cis:
            return
        if index == len(self.options):
            self._finish(wholes, partial_roles, sizes, kept_cis)
            return
        bins_taken = sum(role is not None for role in partial_roles)
        for gain, stays in self.options[index]:
            if stays is None:
                if wholes:
                    self._search(index + 1, wholes - 1, partial_roles + (None,), sizes, kept_cis + gain)
            elif bins_taken < self.demand.bins and (rest := _without(sizes, stays)) is not None:
                self._search(index + 1, wholes, partial_roles + (stays,), rest, kept_cis + gain)

    def _finish(self, wholes: int, roles: tuple[_Content | None, ...], sizes: tuple[int, ...], kept_cis: int) -> None:
        partial = [role for role in roles if role is not None]
        new_bins = self.demand.bins - len(partial)
        added = _pack(self.starts, sizes, tuple(_bits(stays) for stays in partial) + (0,) * new_bins)
        if added is None:
            return
        whole = ((self.demand.profile.slices, 0),)
        filled = iter(stays + more for stays, more in zip(partial, added))
        kept = tuple(whole if role is None else next(filled) for role in roles)
        self.best = _Fill(kept_cis, kept, (whole,) * wholes + added[len(partial):])


# -- GPU-instance placements ----------------------------------------------------------------------


def _placement_choices(demand: _Demand) -> list[tuple[tuple[Placement, ...], int]]:
    """Every set of `count` non-overlapping placements of the profile, with its memory-slice bitmask."""
    choices = []
    for chosen in combinations(sorted(demand.profile.placements, key=lambda p: p.start), demand.count):
        masks = [((1 << p.size) - 1) << p.start for p in chosen]
        union = reduce(or_, masks, 0)
        if sum(masks) == union:  # no two overlap
            choices.append((chosen, union))
    return choices


def _layouts(choices: list[list[tuple[tuple[Placement, ...], int]]], used: int = 0
             ) -> Iterator[tuple[tuple[tuple[Placement, ...], ...], int]]:
    """Every way to give each demand its placements without overlap, with the memory slices used."""
    if not choices:
        yield (), used
        return
    for chosen, mask in choices[0]:
        if not mask & used:
            for rest, all_used in _layouts(choices[1:], used | mask):
                yield (chosen,) + rest, all_used


@lru_cache(maxsize=1024)
def _longest_free_run(used: int, slots: int) -> int:
    best = run = 0
    for slot in range(slots):
        run = 0 if used >> slot & 1 else run + 1
        best = max(best, run)
    return best


def _best_target(gpu: GpuMigState, capabilities: MigCapabilities, demands: tuple[_Demand, ...],
                 current: tuple[GpuInstanceState, ...]) -> tuple[GiTarget, ...]:
    at = {(gi.profile_id, gi.placement): gi for gi in current}
    fills: dict[tuple[int, tuple[int, ...]], _Fill] = {}

    def fill(index: int, kept: tuple[GpuInstanceState, ...]) -> _Fill:
        key = (index, tuple(gi.gi_id for gi in kept))
        if key not in fills:
            fills[key] = _FillSearch(demands[index], kept).run()
        return fills[key]

    best = None
    # Layouts come in a fixed order (placements by start); ties keep the first, so the result is stable.
    for layout, used in _layouts([_placement_choices(demand) for demand in demands]):
        kept = [tuple(at[key] for p in chosen if (key := (demand.profile.id, p)) in at)
                for demand, chosen in zip(demands, layout)]
        layout_fills = [fill(index, gis) for index, gis in enumerate(kept)]
        score = (sum(f.kept_cis for f in layout_fills), sum(map(len, kept)),
                 _longest_free_run(used, capabilities.memory_slices))
        if best is None or score > best[0]:
            best = (score, layout, layout_fills)
    if best is None:
        raise PlanError(f"{_label(gpu, capabilities)}: no non-overlapping placement for {_everything(demands)}",
                        gpu.index)
    _, layout, layout_fills = best
    return _targets(demands, layout, layout_fills, at)


def _targets(demands: tuple[_Demand, ...], layout: tuple[tuple[Placement, ...], ...], fills: list[_Fill],
             at: dict[tuple[int, Placement], GpuInstanceState]) -> tuple[GiTarget, ...]:
    targets = []
    for demand, chosen, fill in zip(demands, layout, fills):
        kept, new = iter(fill.kept), iter(fill.new)
        for placement in chosen:
            gi = at.get((demand.profile.id, placement))
            targets.append(_gi_target(demand.profile, placement, next(kept) if gi else next(new), gi))
    return tuple(sorted(targets, key=lambda t: (t.placement.start, t.placement.size, t.profile_id)))


def _gi_target(profile: GiProfile, placement: Placement, content: _Content, gi: GpuInstanceState | None) -> GiTarget:
    constants = {ci.slices: ci.constant for ci in profile.ci_profiles}
    current = {(ci.profile_id, ci.slices, ci.start): ci.ci_id for ci in gi.compute_instances} if gi else {}
    cis = tuple(CiTarget(_device_name(profile, slices), constants[slices], slices, start,
                         current.get((constants[slices], slices, start)))
                for slices, start in sorted(content, key=lambda ci: ci[1]))
    return GiTarget(profile.id, profile.name, placement, cis, gi.gi_id if gi else None)


# -- the diff ------------------------------------------------------------------------------------


def _diff(gpu: GpuMigState, current: tuple[GpuInstanceState, ...], target: tuple[GiTarget, ...]) -> GpuPlan:
    kept_gis = {gi.keep_gi_id for gi in target if gi.keep_gi_id is not None}
    kept_cis = {(gi.keep_gi_id, ci.keep_ci_id) for gi in target for ci in gi.compute_instances
                if ci.keep_ci_id is not None}
    return GpuPlan(
        index=gpu.index, uuid=gpu.uuid, target=target,
        destroy_cis=tuple((gi.gi_id, ci.ci_id) for gi in current for ci in gi.compute_instances
                          if (gi.gi_id, ci.ci_id) not in kept_cis),
        destroy_gis=tuple(gi.gi_id for gi in current if gi.gi_id not in kept_gis),
        create_cis=tuple((gi.keep_gi_id, ci) for gi in target if gi.keep_gi_id is not None
                         for ci in gi.compute_instances if ci.keep_ci_id is None),
        create_gis=tuple(gi for gi in target if gi.keep_gi_id is None),
    )


def _as_targets(capabilities: MigCapabilities, current: tuple[GpuInstanceState, ...]) -> tuple[GiTarget, ...]:
    """The current instances as a target that keeps all of them."""
    targets = []
    for gi in current:
        profile = capabilities.gi_profile_by_id(gi.profile_id)
        name = profile.name if profile else f"profile {gi.profile_id}"
        cis = tuple(CiTarget(_device_name(profile, ci.slices) if profile else name, ci.profile_id, ci.slices,
                             ci.start, ci.ci_id) for ci in gi.compute_instances)
        targets.append(GiTarget(gi.profile_id, name, gi.placement, cis, gi.gi_id))
    return tuple(targets)
