"""Health signals from NVML: the event loop (XIDs, ECC) on its own thread, and periodic readings.

NVML's event wait blocks, so it gets a thread of its own instead of the NVML session's, which
serves every other call; NVML is thread-safe. Events reach the asyncio loop through a callback.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from gpud.logs import get_logger
from gpud.nvml.reader import text

log = get_logger("health")
WAIT_MS = 500  # how long one wait blocks: bounds how long stopping the thread takes
NOT_ATTRIBUTED = 0xFFFFFFFF  # NVML's GPU/compute-instance id when an event is not a MIG device's

EventCallback = Callable[[dict], None]


class EventListener:
    """Registers XID and ECC events on every GPU and reports each as a dict through `deliver`:
    {"kind": "xid"|"ecc-sbe"|"ecc-dbe"|"lost"|"error", "gpu": uuid, "xid": n, "gi_id": …, "ci_id": …}."""

    def __init__(self, nvml: Any, deliver: EventCallback):
        self.nvml = nvml
        self.deliver = deliver
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered: dict[str, int] = {}  # GPU UUID -> event mask registered

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        nvml = self.nvml
        event_set = nvml.nvmlEventSetCreate()
        try:
            self._register_all(event_set)
            while not self._stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait_v2(event_set, WAIT_MS)
                except nvml.NVMLError_Timeout:
                    continue
                except nvml.NVMLError_GpuIsLost:
                    self.deliver({"kind": "lost", "gpu": None})
                    continue
                except nvml.NVMLError as exc:
                    if self._stop.is_set():
                        return
                    self.deliver({"kind": "error", "gpu": None, "error": str(exc)})
                    self._stop.wait(1.0)
                    continue
                self.deliver(self._describe(data))
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except nvml.NVMLError:
                pass

    def _register_all(self, event_set: Any) -> None:
        nvml = self.nvml
        wanted = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeSingleBitEccError | \
            nvml.nvmlEventTypeDoubleBitEccError
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                mask = wanted & nvml.nvmlDeviceGetSupportedEventTypes(handle)
                nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
                self.registered[text(nvml.nvmlDeviceGetUUID(handle))] = mask
            except nvml.NVMLError as exc:
                log.warning("nvml_events_not_registered", gpu=index, error=str(exc))

    def _describe(self, data: Any) -> dict:
        nvml = self.nvml
        uuid = text(nvml.nvmlDeviceGetUUID(data.device))
        kind = {nvml.nvmlEventTypeXidCriticalError: "xid", nvml.nvmlEventTypeSingleBitEccError: "ecc-sbe",
                nvml.nvmlEventTypeDoubleBitEccError: "ecc-dbe"}.get(data.eventType, "other")
        return {"kind": kind, "gpu": uuid, "xid": data.eventData,
                "gi_id": None if data.gpuInstanceId == NOT_ATTRIBUTED else data.gpuInstanceId,
                "ci_id": None if data.computeInstanceId == NOT_ATTRIBUTED else data.computeInstanceId}


@dataclass(frozen=True)
class Readings:
    """One GPU's periodic health readings; None where the GPU does not support a reading."""

    temperature_c: int | None = None
    slowdown_c: int | None = None
    shutdown_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    throttle_reasons: int | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    remapped_correctable: int | None = None
    remapped_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    pcie_replays: int | None = None
    fb_used_mib: int | None = None
    fb_free_mib: int | None = None
    retired_pages_pending: bool | None = None
    nvlinks_up: tuple[bool, ...] | None = None  # per link; None: no NVLink (a PCIe board)
    reset_required: bool = False  # an NVML call answered RESET_REQUIRED


def read_readings(nvml: Any, uuids: list[str]) -> dict[str, Readings | None]:
    """Readings per GPU UUID; None for a GPU NVML cannot reach (lost)."""
    return {uuid: _read_one(nvml, uuid) for uuid in uuids}


def _read_one(nvml: Any, uuid: str) -> Readings | None:
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
    except nvml.NVMLError:
        return None

    reset_required = False

    def optional(read):
        nonlocal reset_required
        try:
            return read()
        except nvml.NVMLError_ResetRequired:
            reset_required = True
            return None
        except nvml.NVMLError:
            return None  # NOT_SUPPORTED on this GPU, or it vanished between calls: no reading

    memory = optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    remap = optional(lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    power = optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    limit = optional(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    return Readings(
        temperature_c=optional(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        slowdown_c=optional(lambda: nvml.nvmlDeviceGetTemperatureThreshold(
            handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
        shutdown_c=optional(lambda: nvml.nvmlDeviceGetTemperatureThreshold(
            handle, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)),
        power_w=power / 1000 if power is not None else None,
        power_limit_w=limit / 1000 if limit is not None else None,
        throttle_reasons=optional(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),
        ecc_sbe_volatile=optional(lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC)),
        ecc_dbe_volatile=optional(lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)),
        remapped_correctable=remap[0] if remap else None,
        remapped_uncorrectable=remap[1] if remap else None,
        remap_pending=bool(remap[2]) if remap else None,
        remap_failed=bool(remap[3]) if remap else None,
        pcie_replays=optional(lambda: nvml.nvmlDeviceGetPcieReplayCounter(handle)),
        fb_used_mib=memory.used >> 20 if memory else None,
        fb_free_mib=memory.free >> 20 if memory else None,
        retired_pages_pending=_flag(optional(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)), nvml),
        nvlinks_up=_nvlinks(nvml, handle),
        reset_required=reset_required,
    )


def _flag(value: int | None, nvml: Any) -> bool | None:
    return None if value is None else value == nvml.NVML_FEATURE_ENABLED


def _nvlinks(nvml: Any, handle: Any) -> tuple[bool, ...] | None:
    """Each link's state, from link 0 until NVML says there is no such link."""
    states = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            states.append(nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED)
        except (nvml.NVMLError_InvalidArgument, nvml.NVMLError_NotSupported):
            break
        except nvml.NVMLError:
            return None
    return tuple(states) or None
