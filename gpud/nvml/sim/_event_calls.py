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
from .events import EventSet, GpuLost
from .handles import HandleRef, Kind, make_handle
from .models import GpuModel


def supported_event_types(model: GpuModel) -> int:
    ecc_events = pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
    return (
        pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypePState | (ecc_events if model.ecc else 0)
    )


class EventCalls(SimCore):
    @nvml_call
    def nvmlEventSetCreate(self):
        event_set = EventSet(next(self._event_set_ids))
        self._event_sets[event_set.id] = event_set
        return make_handle(HandleRef(Kind.EVENT_SET, serial=event_set.id))

    @nvml_call
    def nvmlDeviceGetSupportedEventTypes(self, handle) -> int:
        return supported_event_types(self._gpu(handle).model)

    @nvml_call
    def nvmlDeviceRegisterEvents(self, handle, eventTypes: int, eventSet) -> None:
        """Parent GPU handles only (§8). Asking for any unsupported type registers nothing."""
        gpu = self._gpu(handle)
        event_set = self._event_set(eventSet)
        if eventTypes & ~supported_event_types(gpu.model):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        event_set.register(gpu.index, eventTypes)

    @nvml_call
    def nvmlEventSetWait_v2(self, eventSet, timeoutms: int) -> pynvml.c_nvmlEventData_t:
        """Block until an event arrives (the lock is released while waiting) or time runs out."""
        deadline = time.monotonic() + timeoutms / 1000
        event_set = self._event_set(eventSet)
        while not event_set.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NVMLError(NVML_ERROR_TIMEOUT)
            self._event_signal.wait(remaining)
            if not self._init_count:
                raise NVMLError(NVML_ERROR_UNINITIALIZED)
            event_set = self._event_set(eventSet)  # raises if freed meanwhile
        item = event_set.pending.popleft()
        if isinstance(item, GpuLost):
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return structs.event_data(self._gpu_handle(self._gpus[item.gpu]), item)

    nvmlEventSetWait = nvmlEventSetWait_v2

    @nvml_call
    def nvmlEventSetFree(self, eventSet) -> None:
        del self._event_sets[self._event_set(eventSet).id]
        self._event_signal.notify_all()
