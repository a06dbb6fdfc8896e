"""Event sets: per-GPU registration masks and a queue of undelivered events."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# gpuInstanceId / computeInstanceId of an event that no GI/CI is attributed to (nvml.h, nvmlEventData_t).
NOT_ATTRIBUTED = 0xFFFFFFFF


@dataclass(frozen=True)
class Event:
    gpu: int
    event_type: int
    data: int = 0
    gpu_instance_id: int = NOT_ATTRIBUTED
    compute_instance_id: int = NOT_ATTRIBUTED


@dataclass(eq=False)
class EventSet:
    id: int
    masks: dict[int, int] = field(default_factory=dict)  # GPU index -> registered event types
    pending: deque[Event] = field(default_factory=deque)

    def register(self, gpu: int, event_types: int) -> None:
        self.masks[gpu] = self.masks.get(gpu, 0) | event_types

    def accepts(self, event: Event) -> bool:
        return bool(self.masks.get(event.gpu, 0) & event.event_type)
