"""Health signals from NVML: the event loop (XIDs, ECC) on its own thread, and periodic readings.

NVML's event wait blocks, so it gets a thread of its own instead of the NVML session's, which
serves every other call; NVML is thread-safe. Events reach the asyncio loop through a callback.
"""

from __future__ import annotations

import ctypes
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import pynvml

from gpud.base.logs import get_logger
from gpud.nvml.reader import is_lost_error, text

log = get_logger("health")
WAIT_MS = 500  # how long one wait blocks: bounds how long stopping the thread takes
# NVML's GPU/compute-instance id of an event that is no MIG device's. gpud says None instead, and
# _attributed is the one place that maps it.
NOT_ATTRIBUTED = 0xFFFFFFFF
BACKOFF_INITIAL_S = 0.05  # the pause after a first failure; it doubles with each failure in a row
BACKOFF_MAX_S = 5.0
RETRY_UNREGISTERED_S = 5.0  # how often GPUs that could not be registered (lost) are tried again


@dataclass(frozen=True)
class NvmlEvent:
    """What the event thread reports: an event NVML delivered, or a change in what it listens to."""

    kind: str  # "xid" | "ecc-sbe" | "ecc-dbe" | "other" (delivered); "lost" | "back" | "error" (the listener's own)
    gpu: str | None  # the GPU's UUID; None for "error", which is no one GPU's
    xid: int | None = None  # for "xid"
    gi_id: int | None = None  # the MIG GPU/compute instance the event is attributed to; None: not attributed
    ci_id: int | None = None
    error: str | None = None  # for "lost" and "error": what NVML answered


EventCallback = Callable[[NvmlEvent], None]


class EventListener:
    """Registers XID and ECC events on every GPU and reports each as an NvmlEvent through `deliver`.

    No NVML error ends the thread. A set with a lost GPU registered answers every wait with
    GPU_IS_LOST at once (nvml.h: nvmlEventSetWait_v2 "may return NVML_ERROR_GPU_IS_LOST", and
    NVIDIA/k8s-dra-driver-gpu cmd/gpu-kubelet-plugin/device_health.go marks every device lost on it;
    the simulator models the repeat), so on GPU_IS_LOST the set is rebuilt with
    the GPUs that still answer: the others keep reporting, and the lost ones are tried again every
    RETRY_UNREGISTERED_S. Failures in a row back off exponentially up to BACKOFF_MAX_S.
    """

    def __init__(self, nvml: Any, deliver: EventCallback, *, retry_unregistered_s: float = RETRY_UNREGISTERED_S,
                 backoff_max_s: float = BACKOFF_MAX_S):
        self.nvml = nvml
        self.deliver = deliver
        self._retry_unregistered_s = retry_unregistered_s
        self._backoff_max_s = backoff_max_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered: dict[str, int] = {}  # GPU UUID -> event mask registered in the current set
        self._last_registered: set[str] = set()  # in the last set that had any: a GPU missing now is lost
        self.unregistered: dict[int, str] = {}  # GPU index -> why it could not be registered
        self.rebuilds = 0  # event sets made after the first: how often a failure was recovered from
        self._uuid_by_handle: dict[int, str] = {}  # handle address -> GPU UUID: events name GPUs by handle
        self._uuid_by_index: dict[int, str] = {}  # every GPU ever registered, to name a lost one
        self._failures = 0  # in a row
        self.failing: str | None = None  # why no events arrive now: the last failure, until a wait answers
        self._next_retry = 0.0

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread and frees its event set (before an nvmlShutdown, for a GPU reset)."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=WAIT_MS / 1000 + self._backoff_max_s + 1)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except Exception as exc:  # whatever NVML (or a bad handle) raises, the thread lives on
                self._failed(exc)

    def _listen(self) -> None:
        """One event set's life: made, registered, waited on until stopped or GPU_IS_LOST."""
        nvml = self.nvml
        event_set = nvml.nvmlEventSetCreate()
        try:
            self._register_all(event_set)
            while not self._stop.is_set():
                if self.unregistered and time.monotonic() >= self._next_retry:
                    self._register_returning(event_set)
                try:
                    data = nvml.nvmlEventSetWait_v2(event_set, WAIT_MS)
                except nvml.NVMLError_Timeout:
                    self._waited()
                    continue
                except nvml.NVMLError_GpuIsLost:
                    self._lost_in_wait()
                    return  # a new set, without the GPUs that no longer answer
                self._waited()
                self.deliver(self._describe(data))
        finally:
            if self.registered:
                self._last_registered = set(self.registered)
            self.registered = {}
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception:  # NVMLError, or NVML already shut down: the set is gone either way
                pass

    # -- registration ----------------------------------------------------------------------------

    def _register_all(self, event_set: Any) -> None:
        """Registers every GPU that answers; a GPU registered before that does not is lost."""
        self.unregistered, self._uuid_by_handle = {}, {}
        for index in range(self.nvml.nvmlDeviceGetCount()):
            self._register(event_set, index)
        for index, why in self.unregistered.items():
            uuid = self._uuid_by_index.get(index)
            if uuid in self._last_registered:
                log.error("nvml_events_gpu_lost", gpu=index, uuid=uuid, error=why)
                self.deliver(NvmlEvent("lost", uuid, error=why))
            else:
                log.warning("nvml_events_not_registered", gpu=index, error=why)
        self._next_retry = time.monotonic() + self._retry_unregistered_s

    def _register_returning(self, event_set: Any) -> None:
        """Tries the GPUs that could not be registered again: one that answers now is back."""
        for index in list(self.unregistered):
            self._register(event_set, index)
            uuid = self._uuid_by_index.get(index)
            if index not in self.unregistered and uuid:
                log.info("nvml_events_gpu_back", gpu=index, uuid=uuid)
                self.deliver(NvmlEvent("back", uuid))
        self._next_retry = time.monotonic() + self._retry_unregistered_s

    def _register(self, event_set: Any, index: int) -> None:
        nvml = self.nvml
        wanted = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeSingleBitEccError | \
            nvml.nvmlEventTypeDoubleBitEccError
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = text(nvml.nvmlDeviceGetUUID(handle))
            mask = wanted & nvml.nvmlDeviceGetSupportedEventTypes(handle)
            nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
        except nvml.NVMLError as exc:
            self.unregistered[index] = f"{exc} (NVML error {exc.value})"
            return
        self.unregistered.pop(index, None)
        self.registered[uuid] = mask
        self._uuid_by_index[index] = uuid
        self._uuid_by_handle[_address(handle)] = uuid

    # -- failures --------------------------------------------------------------------------------

    def _lost_in_wait(self) -> None:
        """GPU_IS_LOST: rebuild at once the first time; in a row (the rebuilt set still has a lost
        GPU in it), back off like any failure so the thread never spins."""
        self._failures += 1
        self.rebuilds += 1
        if self._failures > 1:
            self._stop.wait(self._backoff(self._failures - 1))

    def _waited(self) -> None:
        """A wait answered (an event, or nothing before its timeout): events arrive, whatever failed before."""
        self._failures, self.failing = 0, None

    def _failed(self, exc: Exception) -> None:
        self._failures += 1
        self.rebuilds += 1
        delay = self._backoff(self._failures)
        error = f"{exc} (NVML error {exc.value})" if isinstance(getattr(exc, "value", None), int) else repr(exc)
        self.failing = error
        if self._failures == 1 or self._failures & (self._failures - 1) == 0:  # the 1st, 2nd, 4th, 8th...
            log.warning("nvml_events_failed", error=error, failures_in_a_row=self._failures,
                        retry_in_s=round(delay, 3))
        if self._failures == 1:
            self.deliver(NvmlEvent("error", None, error=error))
        self._stop.wait(delay)

    def _backoff(self, failures: int) -> float:
        return min(BACKOFF_INITIAL_S * 2 ** (failures - 1), self._backoff_max_s)

    def _describe(self, data: Any) -> NvmlEvent:
        nvml = self.nvml
        uuid = self._uuid_by_handle.get(_address(data.device)) or text(nvml.nvmlDeviceGetUUID(data.device))
        kind = {nvml.nvmlEventTypeXidCriticalError: "xid", nvml.nvmlEventTypeSingleBitEccError: "ecc-sbe",
                nvml.nvmlEventTypeDoubleBitEccError: "ecc-dbe"}.get(data.eventType, "other")
        return NvmlEvent(kind, uuid, xid=data.eventData if kind == "xid" else None,
                         gi_id=_attributed(data.gpuInstanceId), ci_id=_attributed(data.computeInstanceId))


def _attributed(instance_id: int) -> int | None:
    return None if instance_id == NOT_ATTRIBUTED else instance_id


def _address(handle: Any) -> int:
    """What a device handle points at: the same GPU gives the same address for the whole session
    (an event's data.device is a new pointer object to the same device)."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


@dataclass(frozen=True)
class FbMemory:
    """Framebuffer memory as nvidia-smi shows it: used without what the driver reserves (memory info v2)."""

    fb_used_mib: int | None = None
    fb_free_mib: int | None = None
    fb_reserved_mib: int | None = None  # None where the driver has no memory info v2


@dataclass(frozen=True)
class FabricReading:
    """A GPU's place in the NVLink fabric (nvmlDeviceGetGpuFabricInfo[V]): Hopper and later GPUs on
    NVSwitch systems, registered by Fabric Manager."""

    state: int  # NVML_GPU_FABRIC_STATE_*: COMPLETED once registered
    status: int  # an nvmlReturn_t: NVML_SUCCESS when the registration worked (nvml.h: only meaningful once COMPLETED)
    health_mask: int | None  # NVML_GPU_FABRIC_HEALTH_MASK_* (struct v2 and later); None from the v1 call
    clique_id: int
    cluster_uuid: str  # formatted as a UUID; "" when all zeros (no multi-node NVLink domain)


def fabric_health_bits(mask: int) -> dict[str, int]:
    """The health mask's conditions, each its NVML_GPU_FABRIC_HEALTH_MASK_<NAME>_* value (0: not
    supported; for the yes/no ones 1: true, 2: false; incorrect_configuration 1: none, 2..: which), decoded
    as nvml.h's NVML_GPU_FABRIC_HEALTH_GET does with the binding's SHIFT/WIDTH constants. Only the
    conditions the binding defines."""
    bits = {}
    for name in _FABRIC_HEALTH_CONDITIONS:
        shift = getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{name}", None)
        width = getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_{name}", None)
        if shift is not None and width is not None:
            bits[name.lower()] = (mask >> shift) & width
    return bits


_FABRIC_HEALTH_CONDITIONS = ("DEGRADED_BW", "ROUTE_RECOVERY", "ROUTE_UNHEALTHY", "ACCESS_TIMEOUT_RECOVERY",
                             "INCORRECT_CONFIGURATION", "PARTITION_ASSIGNED", "GFM_STATE")


@dataclass(frozen=True)
class Readings(FbMemory):
    """One GPU's periodic health and telemetry readings; None where the GPU does not support a reading."""

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
    retired_pages_pending: bool | None = None
    nvlinks_up: tuple[bool, ...] | None = None  # per link; None: no NVLink (a PCIe board)
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    memory_temp_c: int | None = None
    energy_mj: int | None = None  # since the driver loaded
    gpu_util: int | None = None  # percent; NVML gives none for a GPU in MIG mode
    mem_copy_util: int | None = None
    enc_util: int | None = None
    dec_util: int | None = None
    nvlink_data_kib: int | None = None  # NVLink data received and sent over all links since the driver loaded
    read_at: float = 0.0  # time.monotonic() when read: NVLink bandwidth is a rate between two readings
    reset_required: bool = False  # an NVML call answered RESET_REQUIRED
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (NVML_GPU_RECOVERY_ACTION_*: 0 none, 1 GPU reset, 2 node reboot,
    # 3 drain P2P, 4 drain and reset, ...); None where the driver (before R565) or the binding lacks it
    recovery_action: int | None = None
    fabric: FabricReading | None = None  # None: no NVLink fabric (A100, PCIe boards, VMs, one GPU)


def read_readings(nvml: Any, uuids: list[str]) -> dict[str, Readings | None]:
    """Readings per GPU UUID; None for a GPU NVML cannot reach (lost)."""
    return {uuid: _read_one(nvml, uuid, _readings) for uuid in uuids}


def read_mig_memory(nvml: Any, uuids: list[str]) -> dict[str, FbMemory | None]:
    """Framebuffer memory per MIG device UUID: memory info answers on a MIG device handle with its GPU
    instance's memory (nvml.h; DCGM reads a GPU instance's FB fields so, DcgmCacheManager.cpp
    ReadAndCacheFBMemoryInfo). None for a device NVML cannot reach."""
    return {uuid: _read_one(nvml, uuid, lambda nvml, handle, optional, _: _fb_memory(nvml, handle, optional))
            for uuid in uuids}


class _GpuLost(Exception):
    """A reading answered what a lost GPU answers."""


def _read_one(nvml: Any, uuid: str, read: Callable) -> Any:
    """read(nvml, handle, optional, reset_required) for the device with this UUID; None when lost."""
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
        except nvml.NVMLError as exc:
            if is_lost_error(nvml, exc):
                raise _GpuLost from exc
            return None  # NOT_SUPPORTED on this GPU, NO_PERMISSION, a call the driver lacks: no reading
        except nvml.NVMLLibraryMismatchError:
            return None

    try:
        return read(nvml, handle, optional, lambda: reset_required)
    except _GpuLost:
        return None


def _readings(nvml: Any, handle: Any, optional: Callable, reset_required: Callable[[], bool]) -> Readings:
    remap = optional(lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    power = optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    limit = optional(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    utilization = optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    fields = _field_values(nvml, handle, optional)
    return Readings(
        **vars(_fb_memory(nvml, handle, optional)),
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
        retired_pages_pending=_flag(optional(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)), nvml),
        nvlinks_up=_nvlinks(nvml, handle),
        sm_clock_mhz=optional(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        mem_clock_mhz=optional(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
        memory_temp_c=fields.get(nvml.NVML_FI_DEV_MEMORY_TEMP),
        energy_mj=optional(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle)),
        gpu_util=utilization.gpu if utilization else None,
        mem_copy_util=utilization.memory if utilization else None,
        enc_util=_percent(optional(lambda: nvml.nvmlDeviceGetEncoderUtilization(handle))),
        dec_util=_percent(optional(lambda: nvml.nvmlDeviceGetDecoderUtilization(handle))),
        nvlink_data_kib=_sum_or_none(fields.get(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX),
                                     fields.get(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX)),
        read_at=time.monotonic(),
        reset_required=reset_required(),
        recovery_action=fields.get(getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)),
        fabric=_fabric(nvml, handle, optional),
    )


def _fb_memory(nvml: Any, handle: Any, optional: Callable) -> FbMemory:
    """Memory info v2, whose `used` leaves out what the driver reserves, as nvidia-smi shows it
    (our H100 capture on 580: v1 used = 480 MiB = v2 reserved, v2 used = 0). v1 where the driver
    has no v2 (its `used` then includes the reserved memory, and nothing says how much is reserved:
    DCGM too reports no FB_RESERVED without v2)."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    memory = optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle, version=version)) if version else None
    memory = memory if memory is not None else optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    if memory is None:
        return FbMemory()
    reserved = getattr(memory, "reserved", None)
    return FbMemory(memory.used >> 20, memory.free >> 20, reserved >> 20 if reserved is not None else None)


# nvml.h: "A scopeId of UINT_MAX returns aggregate value summed up across all links" (NVLink throughput).
ALL_LINKS = 0xFFFFFFFF
_VALUE_MEMBERS = {"NVML_VALUE_TYPE_DOUBLE": "dVal", "NVML_VALUE_TYPE_UNSIGNED_INT": "uiVal",
                  "NVML_VALUE_TYPE_UNSIGNED_LONG": "ulVal", "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": "ullVal",
                  "NVML_VALUE_TYPE_SIGNED_LONG_LONG": "sllVal", "NVML_VALUE_TYPE_SIGNED_INT": "siVal",
                  "NVML_VALUE_TYPE_UNSIGNED_SHORT": "usVal"}


def _field_values(nvml: Any, handle: Any, optional: Callable) -> dict[int, float | int]:
    """The field values DCGM reads for dcgm-exporter's defaults, in one call: memory temperature, and
    the NVLink data counters (KiB) of every link (DCGM's DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL adds RX and
    TX: DcgmCacheManager.cpp ReadAndCacheNvLinkBandwidth). Only the fields that answered."""
    wanted = [nvml.NVML_FI_DEV_MEMORY_TEMP, (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
              (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS)]
    # The driver's recovery action (R565 and later; older drivers answer this field NOT_SUPPORTED), in the
    # same call: one nvmlDeviceGetFieldValues per GPU.
    recovery_action = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if recovery_action is not None:
        wanted.append(recovery_action)
    members = {getattr(nvml, name): member for name, member in _VALUE_MEMBERS.items()}
    answered = {}
    for value in optional(lambda: nvml.nvmlDeviceGetFieldValues(handle, wanted)) or ():
        if value.nvmlReturn == nvml.NVML_SUCCESS and value.valueType in members:
            answered[value.fieldId] = getattr(value.value, members[value.valueType])
    return answered


# Versioned fabric structs, newest first: v3 adds healthSummary, v2 healthMask (nvml.h). Both start with
# `version`; pynvml declares `state` as an unsigned int where nvml.h has an unsigned char followed by
# padding, so only its low byte is the state.
_FABRIC_VERSIONS = (("nvmlGpuFabricInfo_v3", "c_nvmlGpuFabricInfo_v3_t"),
                    ("nvmlGpuFabricInfo_v2", "c_nvmlGpuFabricInfo_v2_t"))


def _fabric(nvml: Any, handle: Any, optional: Callable) -> FabricReading | None:
    """nvmlDeviceGetGpuFabricInfoV with the newest struct version the binding has, then older ones on
    ARGUMENT_VERSION_MISMATCH (an older driver), then the unversioned v1 call where the driver lacks V.
    None where NVML says the GPU has no fabric (the error NOT_SUPPORTED, or the state NOT_SUPPORTED: a
    Hopper GPU with no NVSwitch, as our H100 passed through to a VM answers) or nothing answers; a lost
    GPU makes the whole reading None (optional)."""
    fetch = getattr(nvml, "nvmlDeviceGetGpuFabricInfoV", None)
    for version_name, struct_name in _FABRIC_VERSIONS if fetch else ():
        version, struct = getattr(nvml, version_name, None), getattr(nvml, struct_name, None)
        if version is None or struct is None:
            continue
        info = struct()
        info.version = version
        try:
            fetch(handle, ctypes.byref(info))
        except nvml.NVMLError as exc:
            if exc.value == getattr(nvml, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", None):
                continue  # the driver takes an older version
            if exc.value == nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                break  # a driver without the versioned call: v1
            return optional(_raising(exc))
        return _fabric_reading(nvml, info, info.healthMask)
    struct = getattr(nvml, "c_nvmlGpuFabricInfo_t", None)
    if struct is None or not hasattr(nvml, "nvmlDeviceGetGpuFabricInfo"):
        return None
    info = struct()
    if optional(lambda: nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info)) or True) is None:
        return None
    return _fabric_reading(nvml, info, None)


def _raising(exc: Exception) -> Callable:
    def read():
        raise exc
    return read


def _fabric_reading(nvml: Any, info: Any, health_mask: int | None) -> FabricReading | None:
    if info.state & 0xFF == nvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
        return None  # no fabric to be part of: nothing to check, not a fabric Fabric Manager failed to train
    raw = bytes(info.clusterUuid)
    return FabricReading(state=info.state & 0xFF, status=info.status, health_mask=health_mask,
                         clique_id=info.cliqueId, cluster_uuid=str(uuid.UUID(bytes=raw)) if any(raw) else "")


def _percent(utilization: list[int] | None) -> int | None:
    """The percentage of an encoder or decoder reading, [percent, sampling period in us]."""
    return utilization[0] if utilization else None


def _sum_or_none(*values: int | None) -> int | None:
    return None if any(value is None for value in values) else sum(values)


def _flag(value: int | None, nvml: Any) -> bool | None:
    return None if value is None else value == nvml.NVML_FEATURE_ENABLED


def _nvlinks(nvml: Any, handle: Any) -> tuple[bool, ...] | None:
    """Each link's state (active or not), from link 0 until NVML says there is no such link.
    None when the GPU has no NVLink at all: NOT_SUPPORTED on link 0, as on a PCIe board or in a VM
    without NVLink (our H100 capture: NOT_SUPPORTED on every link)."""
    states = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            states.append(nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED)
        except (nvml.NVMLError_InvalidArgument, nvml.NVMLError_NotSupported):
            break
        except nvml.NVMLError as exc:
            if is_lost_error(nvml, exc):
                raise _GpuLost from exc
            return None
    return tuple(states) or None
