"""Compute-instance profiles of a GPU instance, and reference MIG tables of known GPUs.

NVML describes compute-instance profiles only through an existing GPU instance, so gpud derives
them from the GPU-instance size with the rule in mig-profiles.md §4.2–4.3.

`reference_capabilities` rebuilds the tables of a few GPU models from mig-profiles.md §3. It exists
for tests and benchmarks only: the daemon reads every GPU's real tables from NVML.
"""

from __future__ import annotations

import pynvml

from gpud.mig.model import CiProfile, GiProfile, MigCapabilities, Placement


def derive_ci_profiles(gi_slices: int, constants_by_slices: dict[int, int],
                       whole_constant: int | None = None) -> tuple[CiProfile, ...]:
    """The compute-instance profiles a GPU instance of `gi_slices` compute slices offers, smallest first.

    `constants_by_slices` maps CI slices to the NVML compute-instance profile constant;
    `whole_constant` overrides the constant of the whole-GI profile (1_SLICE_REV1 in a REV2 1g GI).
    """
    if whole_constant is None:
        if gi_slices not in constants_by_slices:
            raise ValueError(f"no compute-instance profile constant for {gi_slices} slices")
        whole_constant = constants_by_slices[gi_slices]
    partial = sorted(c for c in constants_by_slices if _fits_partially(c, gi_slices))
    return tuple(CiProfile(constant=constants_by_slices[c], slices=c, starts=_ci_starts(c, gi_slices))
                 for c in partial) + (CiProfile(constant=whole_constant, slices=gi_slices, starts=(0,)),)


def _fits_partially(ci_slices: int, gi_slices: int) -> bool:
    # §4.2 (go-nvlib's rule): a CI smaller than its GI takes at most about half of it.
    return 0 < ci_slices < gi_slices and 2 * ci_slices <= gi_slices + 1


def _ci_starts(ci_slices: int, gi_slices: int) -> tuple[int, ...]:
    # §4.3: CIs start on boundaries of their size rounded up to a power of two (3c in a 7g GI at
    # 0 and 4, like a 3g GI on the memory axis), as long as they end inside the GI.
    alignment = 1 << (ci_slices - 1).bit_length()
    return tuple(range(0, gi_slices - ci_slices + 1, alignment))


# -- reference tables (tests and benchmarks only) ----------------------------------------------

# NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE by slice count, as the NVML reader passes them.
CI_CONSTANTS_BY_SLICES = {n: getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{n}_SLICE")
                          for n in (1, 2, 3, 4, 6, 7, 8)}

_EIGHT_ONES = (0, 1, 2, 3, 4, 5, 6)  # 1-slice placements on 8-slot GPUs: slot 7 is never a start

# memory slices, then per GI profile: (name, NVML_GPU_INSTANCE_PROFILE_<constant>, profile id, compute
# slices, memory MiB, instance count, placement starts, placement size in memory slices); §3.1–3.8,
# memory from the first column where a table gives two.
_TABLES = {
    "A100-SXM4-40GB": (8, (
        ("1g.5gb", "1_SLICE", 19, 1, 4864, 7, _EIGHT_ONES, 1),
        ("1g.5gb+me", "1_SLICE_REV1", 20, 1, 4864, 1, _EIGHT_ONES, 1),
        ("1g.10gb", "1_SLICE_REV2", 15, 1, 9856, 4, (0, 2, 4, 6), 2),
        ("2g.10gb", "2_SLICE", 14, 2, 9856, 3, (0, 2, 4), 2),
        ("3g.20gb", "3_SLICE", 9, 3, 19968, 2, (0, 4), 4),
        ("4g.20gb", "4_SLICE", 5, 4, 19968, 1, (0,), 4),
        ("7g.40gb", "7_SLICE", 0, 7, 40192, 1, (0,), 8),
    )),
    "A100-SXM4-80GB": (8, (
        ("1g.10gb", "1_SLICE", 19, 1, 9728, 7, _EIGHT_ONES, 1),
        ("1g.10gb+me", "1_SLICE_REV1", 20, 1, 9728, 1, _EIGHT_ONES, 1),
        ("1g.20gb", "1_SLICE_REV2", 15, 1, 19968, 4, (0, 2, 4, 6), 2),
        ("2g.20gb", "2_SLICE", 14, 2, 19968, 3, (0, 2, 4), 2),
        ("3g.40gb", "3_SLICE", 9, 3, 40192, 2, (0, 4), 4),
        ("4g.40gb", "4_SLICE", 5, 4, 40192, 1, (0,), 4),
        ("7g.80gb", "7_SLICE", 0, 7, 80640, 1, (0,), 8),
    )),
    "A30": (4, (
        ("1g.6gb", "1_SLICE", 14, 1, 5952, 4, (0, 1, 2, 3), 1),
        ("1g.6gb+me", "1_SLICE_REV1", 21, 1, 5952, 1, (0, 1, 2, 3), 1),
        ("2g.12gb", "2_SLICE", 5, 2, 11968, 2, (0, 2), 2),
        ("2g.12gb+me", "2_SLICE_REV1", 6, 2, 11968, 1, (0, 2), 2),
        ("4g.24gb", "4_SLICE", 0, 4, 24064, 1, (0,), 4),
    )),
    "H100-80GB": (8, (
        ("1g.10gb", "1_SLICE", 19, 1, 9984, 7, _EIGHT_ONES, 1),
        ("1g.10gb+me", "1_SLICE_REV1", 20, 1, 9984, 1, _EIGHT_ONES, 1),
        ("1g.20gb", "1_SLICE_REV2", 15, 1, 20096, 4, (0, 2, 4, 6), 2),
        ("2g.20gb", "2_SLICE", 14, 2, 20096, 3, (0, 2, 4), 2),
        ("3g.40gb", "3_SLICE", 9, 3, 40448, 2, (0, 4), 4),
        ("4g.40gb", "4_SLICE", 5, 4, 40448, 1, (0,), 4),
        ("7g.80gb", "7_SLICE", 0, 7, 81152, 1, (0,), 8),
    )),
    "H200": (8, (
        ("1g.18gb", "1_SLICE", 19, 1, 16384, 7, _EIGHT_ONES, 1),
        ("1g.18gb+me", "1_SLICE_REV1", 20, 1, 16384, 1, _EIGHT_ONES, 1),
        ("1g.35gb", "1_SLICE_REV2", 15, 1, 33024, 4, (0, 2, 4, 6), 2),
        ("2g.35gb", "2_SLICE", 14, 2, 33024, 3, (0, 2, 4), 2),
        ("3g.71gb", "3_SLICE", 9, 3, 71168, 2, (0, 4), 4),
        ("4g.71gb", "4_SLICE", 5, 4, 71168, 1, (0,), 4),
        ("7g.141gb", "7_SLICE", 0, 7, 143360, 1, (0,), 8),
    )),
}

REFERENCE_MODELS = tuple(_TABLES)


def reference_capabilities(model: str) -> MigCapabilities:
    """The MIG tables of `model` (one of REFERENCE_MODELS) per the reference notes; tests and benchmarks only."""
    if model not in _TABLES:
        raise ValueError(f"no reference MIG table for {model!r}; known: {', '.join(REFERENCE_MODELS)}")
    memory_slices, rows = _TABLES[model]
    return MigCapabilities(memory_slices=memory_slices, gi_profiles=tuple(_gi_profile(*row) for row in rows))


def _gi_profile(name: str, constant: str, profile_id: int, slices: int, memory_mib: int, instance_count: int,
                starts: tuple[int, ...], size: int) -> GiProfile:
    # §4.2: a double-memory 1g GI (REV2) offers its single slice as CI profile 1_SLICE_REV1.
    whole_ci = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1 if constant == "1_SLICE_REV2" else None
    return GiProfile(id=profile_id, constant=getattr(pynvml, f"NVML_GPU_INSTANCE_PROFILE_{constant}"), name=name, slices=slices, memory_mib=memory_mib,
                     instance_count=instance_count, placements=tuple(Placement(s, size) for s in starts),
                     ci_profiles=derive_ci_profiles(slices, CI_CONSTANTS_BY_SLICES, whole_ci))
