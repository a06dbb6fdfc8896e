"""Slice arithmetic shared by GPU instances (memory slices) and compute instances (compute slices).

The same rules apply on both levels: a profile offers a fixed list of placements, a new instance
needs one that overlaps no existing instance, and a profile may have at most instanceCount
instances. Errors are the NVML return codes the driver gives for each violation (nvml.h; NVIDIA/k8s-dra-driver-gpu
cmd/gpu-kubelet-plugin/nvlib.go).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple, Protocol

from pynvml import (
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVMLError,
)


class Span(NamedTuple):
    """A placement: `size` slices starting at slice `start`."""

    start: int
    size: int

    def overlaps(self, other: Span) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size


class Profile(Protocol):
    id: int
    instance_count: int
    spans: tuple[Span, ...]


class Instance(Protocol):
    profile: Profile
    span: Span


def free_spans(profile: Profile, instances: Collection[Instance]) -> list[Span]:
    """The profile's placements that overlap no existing instance."""
    return [span for span in profile.spans if not any(span.overlaps(i.span) for i in instances)]


def instances_left(profile: Profile, instances: Iterable[Instance]) -> int:
    return profile.instance_count - sum(1 for i in instances if i.profile.id == profile.id)


def remaining_capacity(profile: Profile, instances: Collection[Instance]) -> int:
    """What nvidia-smi prints as "Free": fully free placements, capped by instanceCount
    (checkable with `nvidia-smi mig -lgip` after each create).

    A profile's own placements never overlap each other, so every free one can still be used.
    """
    return max(0, min(len(free_spans(profile, instances)), instances_left(profile, instances)))


def choose_span(
    profile: Profile,
    all_profiles: Sequence[Profile],
    instances: Collection[Instance],
    requested: Span | None,
) -> Span:
    """The placement a new instance of `profile` gets, or the NVMLError the driver raises.

    `requested` is the placement a ...WithPlacement call asked for; None lets the driver choose.
    """
    if requested is not None and requested not in profile.spans:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if instances_left(profile, instances) <= 0:
        raise NVMLError(NVML_ERROR_INSUFFICIENT_RESOURCES)
    free = free_spans(profile, instances)
    if requested is not None:
        if requested not in free:
            raise NVMLError(NVML_ERROR_INSUFFICIENT_RESOURCES)
        return requested
    if not free:
        raise NVMLError(NVML_ERROR_INSUFFICIENT_RESOURCES)
    return _least_blocking(free, all_profiles, instances)


def _least_blocking(
    candidates: list[Span], all_profiles: Sequence[Profile], instances: Collection[Instance]
) -> Span:
    """Auto placement: the candidate that blocks the fewest still-free placements, ties → lowest start.

    Blocked placements are counted per (profile, placement) pair. This is the inferred driver
    heuristic; it reproduces the A100 transcripts it was drawn from (the MIG user guide's "Getting
    Started with MIG" among them; e.g. a lone 1g lands on slot 6,
    which keeps 4g@0 and both 3g placements available).
    """
    still_free = [span for p in all_profiles for span in free_spans(p, instances)]
    return min(candidates, key=lambda c: (sum(c.overlaps(s) for s in still_free), c.start))


def gpu_instance_id(span: Span, memory_slices: int) -> int:
    """GPU-instance id = RM swizzId, the node of a binary tree over the memory slices
    (NVIDIA/open-gpu-kernel-modules kmigmgr_ga100.c, kmigmgrSwizzIdToSpan_GA100).

    Numbered like a heap: the whole GPU is 0, halves 1-2, quarters 3-6, eighths 7-14
    (4-slot A30: whole 0, halves 1-2, quarters 3-6). Real GPUs sometimes mirror this.
    """
    return memory_slices // span.size - 1 + span.start // span.size


def lowest_free_id(used: Collection[int]) -> int:
    """Compute-instance ids restart at 0 in each GI and are allocated lowest-free-first
    (as in the MIG user guide's transcripts)."""
    return next(i for i in range(len(used) + 1) if i not in used)
