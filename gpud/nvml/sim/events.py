"""Event sets: per-GPU registration masks and a queue of undelivered events."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# gpuInstanceId / computeInstanceId of an event that no GI/CI is attributed to (§8).
NOT_ATTRIBUTED = 0xFFFFFFFF


@dataclass(frozen=True)
class Event:
    gpu: int
    event_type: int
    data: int = 0
    gpu_instance_id: int = NOT_ATTRIBUTED
    compute_instance_id: int = NOT_ATTRIBUTED


@dataclass(frozen=True)
class GpuLost:
    """Makes the next nvmlEventSetWait_v2 on a set registered on this GPU raise GpuIsLost."""

    gpu: int


@dataclass(eq=False)
class EventSet:
    id: int
    masks: dict[int, int] = field(default_factory=dict)  # GPU index -> registered event types
    pending: deque[Event | GpuLost] = field(default_factory=deque)

    def register(self, gpu: int, event_types: int) -> None:
        self.masks[gpu] = self.masks.get(gpu, 0) | event_types

    def accepts(self, item: Event | GpuLost) -> bool:
        mask = self.masks.get(item.gpu, 0)
        return bool(mask & item.event_type) if isinstance(item, Event) else mask != 0
