"""What Prepare checks and asks of gpud for the devices that are made or counted when a claim needs them:
dynamic MIG placements (partitionable devices, KEP-4815: gpud makes the GPU instance at exactly the
allocated placement) and shares of a GPU with consumed capacity (consumable capacity, KEP-5075: memory and
compute become the claim's MPS limits).

The scheduler accounts counters and capacity before it allocates (k8s.io/dynamic-resource-allocation
structured allocator); the plugin checks the allocation again against what it has prepared, so an
allocation made from stale slices, or by a scheduler without the feature gates, never overcommits a GPU:
a counter set's counters (pkg/apis/resource types.go CounterSet: the sum consumed by allocated devices
never exceeds a counter's value) and, through gpud's one ledger, a GPU's memory.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpud.dra.checkpoint import PreparedClaim
from gpud.base.quantity import whole_quantity
from gpud.dra.devices import PARTITION, SHARE, DraDevice


class AllocationRefused(Exception):
    """The allocation cannot be prepared as it is: the message says what it overcommits or lacks."""


def placements(devices: Iterable[DraDevice]) -> list[tuple[DraDevice, dict]]:
    """The claim's dynamic MIG devices and what gpud is asked to make for each (PUT /v1/mig/dynamic/{uid})."""
    return [(d, {"gpu": d.gpu_uuid, "gi_profile_id": d.partition.gi_profile_id, "placement_start": d.partition.start})
            for d in devices if d.kind == PARTITION and d.partition is not None]


def consumed(device: DraDevice, result: dict) -> dict | None:
    """A share's consumed capacity as gpud holds it ({"memory_mib", "compute_percent"}); None for a device
    that is no share. An allocation that counted none (an API server whose DRAConsumableCapacity gate is off
    drops allowMultipleAllocations, and the scheduler hands the GPU out whole) consumes all of it."""
    if device.kind != SHARE:
        return None
    capacity = result.get("consumedCapacity") or {"memory": device.capacity["memory"]["value"], "compute": "100"}
    try:
        memory = whole_quantity(capacity.get("memory", "")) >> 20  # MPS pins memory in whole MiB
        compute = whole_quantity(capacity.get("compute", "100"))
    except ValueError:
        raise AllocationRefused(f"device {device.name}: consumed capacity {capacity} is not memory and compute "
                                "as the slice publishes them") from None
    if memory < 1:
        raise AllocationRefused(f"device {device.name}: consumed memory {capacity.get('memory')} is below 1 MiB")
    if not 1 <= compute <= 100:
        raise AllocationRefused(f"device {device.name}: compute {compute} is not a percentage from 1 to 100")
    return {"memory_mib": memory, "compute_percent": compute}


def refuse_overcommitted_counters(devices: list[DraDevice], prepared: Iterable[PreparedClaim],
                                  pool: dict[str, DraDevice]) -> None:
    """AllocationRefused when these devices, with those of the claims prepared already (looked up in the
    pool by name), consume more of a counter set than it has. A shared device counts once, however many
    claims share it (the allocator's counters follow devices, not claims)."""
    held = {d.device for claim in prepared for d in claim.devices if d.device in pool}
    consuming = [pool[name] for name in sorted(held)] + [d for d in devices if d.name not in held]
    used: dict[tuple[str, str], int] = {}
    for device in consuming:
        if device.counter_set is None:
            continue
        for counter, amount in device.consumes.items():
            key = (device.counter_set.name, counter)
            used[key] = used.get(key, 0) + whole_quantity(amount)
    for device in devices:
        if device.counter_set is None:
            continue
        for counter in device.consumes:
            have = whole_quantity(device.counter_set.counters.get(counter, "0"))
            if used[(device.counter_set.name, counter)] > have:
                raise AllocationRefused(
                    f"device {device.name} needs {counter} of {device.counter_set.name}, which the claims prepared "
                    f"on this node use up ({used[(device.counter_set.name, counter)]} of {have} with it): the "
                    "allocation was made from an older slice, or by a scheduler that does not count counters")
