"""The NVML reads of `gpud doctor`: queries only, each failure kept with the error NVML gave.

Nothing here changes a GPU: every call is an nvml*Get* query (tests/test_doctor.py records every
call a doctor run makes and fails on any Set/Create/Destroy/Reset/Register/Clear).

A read that NVML answers with NOT_SUPPORTED (or, for optional reads, FUNCTION_NOT_FOUND: the
driver branch lacks the call) means "does not apply here" and is left out. Any other error is
kept as a Failure, so doctor can say which read failed and why (NO_PERMISSION: needs root).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

from gpud.nvml.reader import text
from gpud.nvml.session import describe_error

MIB = 1 << 20
_ABSENT = object()


@dataclass(frozen=True)
class Failure:
    read: str  # what doctor tried: "mig.gpu_instances", "processes", ...
    error: str  # "Insufficient Permissions (NVML error 4)"
    code: int | None  # the NVML error code, None for an error that is not NVML's


@dataclass(frozen=True)
class GiProfile:
    id: int
    name: str | None  # "MIG 1g.10gb" from the v2 profile info; None where the driver gave none
    slices: int
    instances: int  # how many GPU instances of this profile the GPU can hold
    memory_mib: int


@dataclass(frozen=True)
class MigDevice:
    index: int
    uuid: str
    name: str


@dataclass(frozen=True)
class Process:
    pid: int
    name: str | None


@dataclass(frozen=True)
class NvLinks:
    present: int  # links NVML reports a state for
    active: int


@dataclass(frozen=True)
class Fabric:
    state: str  # "not-supported" | "not-started" | "in-progress" | "completed" | "unknown"
    status: str | None  # the registration result once completed: "Success" or an NVML error text


@dataclass(frozen=True)
class GpuReading:
    index: int
    error: str | None = None  # set when NVML gave no handle for this GPU: nothing else was read
    name: str | None = None
    uuid: str | None = None
    bus_id: str | None = None
    minor_number: int | None = None
    memory_total_mib: int | None = None
    mig_current: str | None = None  # "enabled" | "disabled"; None when the GPU cannot do MIG
    mig_pending: str | None = None
    gi_profiles: tuple[GiProfile, ...] = ()
    gi_profiles_answered: bool = False  # False: every profile query said NOT_SUPPORTED (R535 with MIG off)
    gpu_instance_count: int | None = None
    mig_devices: tuple[MigDevice, ...] = ()
    processes: tuple[Process, ...] = ()
    nvlinks: NvLinks = NvLinks(0, 0)
    fabric: Fabric | None = None  # None: this driver or binding offers no fabric query
    failures: tuple[Failure, ...] = ()


@dataclass(frozen=True)
class NodeReading:
    driver_version: str
    nvml_version: str | None
    cuda_version: str | None
    gpus: tuple[GpuReading, ...]
    failures: tuple[Failure, ...] = ()



class _Reads:
    """Runs reads on one backend, keeping each failure that is not an "absent" answer."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.failures: list[Failure] = []

    def get(self, read: str, call: Callable, *args: Any, optional: bool = False) -> Any:
        """call(*args); _ABSENT for NOT_SUPPORTED (and FUNCTION_NOT_FOUND if optional); _ABSENT + a
        Failure for any other error."""
        nvml = self.nvml
        absent = (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND) if optional \
            else (nvml.NVML_ERROR_NOT_SUPPORTED,)
        try:
            return call(*args)
        except nvml.NVMLError as exc:
            if exc.value not in absent:
                self.failures.append(Failure(read, describe_error(exc), exc.value))
        except nvml.NVMLLibraryMismatchError as exc:  # pynvml's, not an NVMLError: a call the library lacks
            if not optional:
                self.failures.append(Failure(read, str(exc) or "NVML library mismatch", None))
        return _ABSENT

    def take_failures(self) -> tuple[Failure, ...]:
        taken, self.failures = tuple(self.failures), []
        return taken


def read_node(nvml: Any) -> NodeReading:
    """Everything doctor needs to know from NVML. NVML must be initialised."""
    reads = _Reads(nvml)
    driver = text(nvml.nvmlSystemGetDriverVersion())
    nvml_version = reads.get("nvml_version", nvml.nvmlSystemGetNVMLVersion)
    cuda = reads.get("cuda_version", nvml.nvmlSystemGetCudaDriverVersion_v2, optional=True)
    count = nvml.nvmlDeviceGetCount()
    system_failures = reads.take_failures()
    gpus = tuple(_read_gpu(reads, index) for index in range(count))
    return NodeReading(driver_version=driver,
                       nvml_version=None if nvml_version is _ABSENT else text(nvml_version),
                       cuda_version=None if cuda is _ABSENT else f"{cuda // 1000}.{cuda % 1000 // 10}",
                       gpus=gpus, failures=system_failures)


def _read_gpu(reads: _Reads, index: int) -> GpuReading:
    nvml = reads.nvml
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError as exc:
        return GpuReading(index=index, error=describe_error(exc))
    known = {"index": index}
    for key, read, call in (("name", "name", nvml.nvmlDeviceGetName), ("uuid", "uuid", nvml.nvmlDeviceGetUUID)):
        value = reads.get(read, call, handle)
        known[key] = None if value is _ABSENT else text(value)
    pci = reads.get("pci", nvml.nvmlDeviceGetPciInfo_v3, handle)
    known["bus_id"] = None if pci is _ABSENT else text(pci.busId)
    minor = reads.get("minor_number", nvml.nvmlDeviceGetMinorNumber, handle)
    known["minor_number"] = None if minor is _ABSENT else minor
    memory = reads.get("memory", nvml.nvmlDeviceGetMemoryInfo, handle)
    known["memory_total_mib"] = None if memory is _ABSENT else memory.total // MIB
    known.update(_read_mig(reads, handle))
    known["processes"] = _read_processes(reads, handle)
    known["nvlinks"] = _read_nvlinks(reads, handle)
    known["fabric"] = _read_fabric(reads, handle)
    return GpuReading(**known, failures=reads.take_failures())


def _read_mig(reads: _Reads, handle: Any) -> dict:
    nvml = reads.nvml
    modes = reads.get("mig.mode", nvml.nvmlDeviceGetMigMode, handle)
    if modes is _ABSENT:
        return {}
    name = lambda value: "enabled" if value == nvml.NVML_DEVICE_MIG_ENABLE else "disabled"  # noqa: E731
    found = {"mig_current": name(modes[0]), "mig_pending": name(modes[1])}
    profiles, answered = _read_gi_profiles(reads, handle)
    found.update(gi_profiles=profiles, gi_profiles_answered=answered)
    if found["mig_current"] == "enabled":
        found["gpu_instance_count"] = _count_gpu_instances(reads, handle, profiles)
        found["mig_devices"] = _read_mig_devices(reads, handle)
    return found


def _read_gi_profiles(reads: _Reads, handle: Any) -> tuple[tuple[GiProfile, ...], bool]:
    """The GPU-instance profile table, one query per NVML_GPU_INSTANCE_PROFILE_* constant.

    NOT_SUPPORTED is "no such profile on this GPU", INVALID_ARGUMENT "no such constant here"
    (our H100 capture answers 0x11 so); R535 answers NOT_SUPPORTED to all while MIG is off
    (NVIDIA/mig-parted commit 219e780d).
    """
    nvml = reads.nvml
    profiles = []
    for constant in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant)
        except nvml.NVMLError as exc:
            if exc.value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            reads.failures.append(Failure("mig.profiles", describe_error(exc), exc.value))
            break
        name = getattr(info, "name", None)
        profiles.append(GiProfile(id=info.id, name=text(name) if name else None, slices=info.sliceCount,
                                  instances=info.instanceCount, memory_mib=info.memorySizeMB))
    return tuple(profiles), bool(profiles)


def _count_gpu_instances(reads: _Reads, handle: Any, profiles: tuple[GiProfile, ...]) -> int | None:
    """How many GPU instances exist: the enumeration call that needs MIG privileges as non-root."""
    nvml = reads.nvml
    total = 0
    for profile in profiles:
        count = ctypes.c_uint(profile.instances)
        array = (nvml.c_nvmlGpuInstance_t * max(profile.instances, 1))()
        if reads.get("mig.gpu_instances", nvml.nvmlDeviceGetGpuInstances, handle, profile.id, array,
                     ctypes.byref(count)) is _ABSENT:
            return None
        total += count.value
    return total


def _read_mig_devices(reads: _Reads, handle: Any) -> tuple[MigDevice, ...]:
    nvml = reads.nvml
    maximum = reads.get("mig.devices", nvml.nvmlDeviceGetMaxMigDeviceCount, handle)
    devices = []
    for mig_index in range(0 if maximum is _ABSENT else maximum):
        try:
            device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
        except nvml.NVMLError as exc:
            if exc.value not in (nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_ERROR_INVALID_ARGUMENT):  # holes are normal
                reads.failures.append(Failure("mig.devices", describe_error(exc), exc.value))
            continue
        uuid = reads.get("mig.devices", nvml.nvmlDeviceGetUUID, device)
        name = reads.get("mig.devices", nvml.nvmlDeviceGetName, device)
        if uuid is not _ABSENT:
            devices.append(MigDevice(mig_index, text(uuid), "" if name is _ABSENT else text(name)))
    return tuple(devices)


def _read_processes(reads: _Reads, handle: Any) -> tuple[Process, ...]:
    nvml = reads.nvml
    found = reads.get("processes", nvml.nvmlDeviceGetComputeRunningProcesses, handle)
    if found is _ABSENT:
        return ()
    processes = []
    for pid in sorted({p.pid for p in found}):
        name = reads.get("process_name", nvml.nvmlSystemGetProcessName, pid, optional=True)
        processes.append(Process(pid, None if name is _ABSENT else text(name)))
    return tuple(processes)


def _read_nvlinks(reads: _Reads, handle: Any) -> NvLinks:
    """Links with a state; a GPU without NVLink answers NOT_SUPPORTED on every link (our H100 capture)."""
    nvml = reads.nvml
    present = active = 0
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as exc:
            if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                continue
            if exc.value != nvml.NVML_ERROR_INVALID_ARGUMENT:  # INVALID_ARGUMENT: past the GPU's last link
                reads.failures.append(Failure("nvlink", describe_error(exc), exc.value))
            break
        present += 1
        active += state == nvml.NVML_FEATURE_ENABLED
    return NvLinks(present, active)


_FABRIC_STATES = {"NVML_GPU_FABRIC_STATE_NOT_SUPPORTED": "not-supported",
                  "NVML_GPU_FABRIC_STATE_NOT_STARTED": "not-started",
                  "NVML_GPU_FABRIC_STATE_IN_PROGRESS": "in-progress",
                  "NVML_GPU_FABRIC_STATE_COMPLETED": "completed"}


def _read_fabric(reads: _Reads, handle: Any) -> Fabric | None:
    """The GPU's NVLink-fabric registration (NVSwitch systems: Fabric Manager registers each GPU).

    pynvml's nvmlDeviceGetGpuFabricInfoV fills a c_nvmlGpuFabricInfoV_t passed by reference.
    NOT_SUPPORTED: no fabric here; FUNCTION_NOT_FOUND / no struct in the binding: cannot ask.
    """
    nvml = reads.nvml
    struct = getattr(nvml, "c_nvmlGpuFabricInfoV_t", None)
    if struct is None:
        return None
    info = struct()
    try:
        nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    except nvml.NVMLError as exc:
        if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
            return Fabric("not-supported", None)
        if exc.value != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            reads.failures.append(Failure("fabric", describe_error(exc), exc.value))
        return None
    states = {getattr(nvml, constant): name for constant, name in _FABRIC_STATES.items() if hasattr(nvml, constant)}
    state = states.get(info.state, "unknown")
    status = None
    if state == "completed":
        status = "Success" if info.status == nvml.NVML_SUCCESS else describe_error(nvml.NVMLError(info.status))
    return Fabric(state, status)
