"""NVML event sets: registration, blocking wait, free."""

from __future__ import annotations

import time

import pynvml
from pynvml import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    NVMLError,
)

from . import structs
from ._core import SimCore, nvml_call
from .events import EventSet
from .handles import HandleRef, Kind, make_handle


class EventCalls(SimCore):
    @nvml_call
    def nvmlEventSetCreate(self):
        event_set = EventSet(next(self._event_set_ids))
        self._event_sets[event_set.id] = event_set
        return make_handle(HandleRef(Kind.EVENT_SET, serial=event_set.id))

    @nvml_call
    def nvmlDeviceGetSupportedEventTypes(self, handle) -> int:
        return self._supported_event_types(self._gpu(handle))

    @nvml_call
    def nvmlDeviceRegisterEvents(self, handle, eventTypes: int, eventSet) -> None:
        """Parent GPU handles only (nvml.h, nvmlDeviceRegisterEvents). Asking for any unsupported type
        registers nothing. A lost GPU cannot be registered: its handle raises GPU_IS_LOST."""
        gpu = self._gpu(handle)
        event_set = self._event_set(eventSet)
        if eventTypes & ~self._supported_event_types(gpu):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        event_set.register(gpu.index, eventTypes)

    @nvml_call
    def nvmlEventSetWait_v2(self, eventSet, timeoutms: int) -> pynvml.c_nvmlEventData_t:
        """Block until an event arrives (the lock is released while waiting) or time runs out.

        While a GPU registered in the set is lost, every wait answers GPU_IS_LOST at once, without
        blocking and before any other GPU's event: the error persists until the set is freed (the
        driver has no way to unregister a GPU), which is what makes a naive listener loop spin
        (Project-HAMi/HAMi#2321: "returns a non-SUCCESS code immediately without blocking"). No source
        says whether other GPUs' events still arrive through that set: modelled the strictest way.
        """
        deadline = time.monotonic() + timeoutms / 1000
        event_set = self._event_set(eventSet)
        while True:
            if any(self._gpus[index].lost for index in event_set.masks):
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            if event_set.pending:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NVMLError(NVML_ERROR_TIMEOUT)
            self._event_signal.wait(remaining)
            if not self._init_count:
                raise NVMLError(NVML_ERROR_UNINITIALIZED)
            event_set = self._event_set(eventSet)  # raises if freed meanwhile
        event = event_set.pending.popleft()
        return structs.event_data(self._gpu_handle(self._gpus[event.gpu]), event)

    nvmlEventSetWait = nvmlEventSetWait_v2

    @nvml_call
    def nvmlEventSetFree(self, eventSet) -> None:
        del self._event_sets[self._event_set(eventSet).id]
        self._event_signal.notify_all()

    def _supported_event_types(self, gpu) -> int:
        """The model's event types the driver branch knows (H100 capture on 580: 0xFF9F)."""
        return gpu.model.event_types & self._driver.branch.event_types
