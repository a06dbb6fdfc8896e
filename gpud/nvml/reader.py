"""Reads the whole node through NVML into an immutable Inventory. Runs on the NVML thread.

Real drivers answer differently from what a client may expect, and the reader keeps each answer
to its field:
- a GPU that fell off the bus mostly answers NVML_ERROR_UNKNOWN ("Unable to determine the device
  handle for GPU ...: Unknown Error", nvidia-smi), otherwise GPU_IS_LOST (nvml.h): both mark it
  lost, with the last known identity;
- NOT_SUPPORTED leaves a field out; NO_PERMISSION (a non-root user: MIG instance enumeration
  needs the MIG capabilities, MIG user guide "Device Nodes and Capabilities") leaves it out and
  says so in `Gpu.unreadable`, never failing the GPU;
- a call the driver lacks (NVMLError_FunctionNotFound, or pynvml's NVMLLibraryMismatchError,
  which is not an NVMLError) leaves an optional field out, and fails the read with the call's
  name when gpud cannot do without it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from gpud.base.hostfile import read_host_text
from gpud.base.logs import get_logger
from gpud.model.driver import MINIMUM_BRANCH
from gpud.model.inventory import (Gpu, Inventory, MigDevice, MigEngines, MigInfo, normal_bus_id, sysfs_pci_device,
                                  unknown_gpu)
from gpud.model.mig import MigCapabilities
from gpud.model.mig_profile_names import mig_device_name
from gpud.nvml import mig
from gpud.nvml.mig_tables import ReadTables, shipped_table, with_true_instance_counts

MIB = 1 << 20
_ARCHITECTURES = ("kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell")
_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
# nvmlDeviceGetBrand's answers as go-nvlib words them (pkg/nvlib/device/device.go GetBrandAsString), by the
# pynvml NVML_BRAND_* suffix: what NVIDIA's DRA driver publishes as `brand`. VGAMING is CLOUD_GAMING's old
# name (the same value, which go-nvlib words "NvidiaCloudGaming"); a value go-nvlib has no word for (the
# 13.x header's DLA, VGAMEDEV, NPU: go-nvlib answers an error) is no brand.
_BRANDS = {"UNKNOWN": "Unknown", "QUADRO": "Quadro", "TESLA": "Tesla", "NVS": "NVS", "GRID": "Grid",
           "GEFORCE": "GeForce", "TITAN": "Titan", "NVIDIA_VAPPS": "NvidiaVApps", "NVIDIA_VPC": "NvidiaVPC",
           "NVIDIA_VCS": "NvidiaVCS", "NVIDIA_VWS": "NvidiaVWS", "NVIDIA_CLOUD_GAMING": "NvidiaCloudGaming",
           "QUADRO_RTX": "QuadroRTX", "NVIDIA_RTX": "NvidiaRTX", "NVIDIA": "Nvidia", "GEFORCE_RTX": "GeForceRTX",
           "TITAN_RTX": "TitanRTX"}
# What a GPU that cannot be reached answers (nvml.h, nvmlDeviceGetHandleByIndex: GPU_IS_LOST "if
# the target GPU has fallen off the bus or is otherwise inaccessible"; UNKNOWN is what a GPU lost
# to XID 79 gives in nvidia-smi's "Unable to determine the device handle ... Unknown Error").
_LOST_ERRORS = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNKNOWN")
NEEDS_ROOT = "needs root (NVML NO_PERMISSION)"
SYSFS = Path("/sys")
# Room for 32768 CPUs in nvmlDeviceGetCpuAffinity's bitmask, as Slurm asks for (gpu_nvml.c, MAX_CPUS
# 0x8000), in pynvml's array of c_ulonglong (nvml.h: "64 CPUs per unsigned long on 64-bit machines").
_CPU_MASK_WORD_BITS = 64
_CPU_MASK_WORDS = 0x8000 // _CPU_MASK_WORD_BITS
log = get_logger("inventory")


def text(value: Any) -> str:
    """NVML strings arrive as str or bytes depending on the call and the binding's version."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def is_lost_error(nvml: Any, exc: BaseException) -> bool:
    """Whether an NVML error says the GPU cannot be reached any more."""
    return getattr(exc, "value", None) in {getattr(nvml, name, None) for name in _LOST_ERRORS}


def nvml_error_text(exc: BaseException) -> str:
    """'Unknown Error (NVML error 999)': the driver's words and code."""
    return f"{exc} (NVML error {exc.value})" if isinstance(getattr(exc, "value", None), int) else repr(exc)


class MissingNvmlCall(RuntimeError):
    """The driver lacks an NVML call gpud cannot do without."""


class _Calls:
    """The backend, remembering which NVML function was fetched last: when the driver lacks one,
    the error can name it (pynvml's error says only "Function Not Found")."""

    def __init__(self, nvml: Any):
        self._nvml = nvml
        self.last_call: str | None = None

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if name.startswith("nvml") and callable(value) and not isinstance(value, type):
            self.last_call = name
        return value


@dataclass(frozen=True)
class _Table:
    mode: int  # the MIG mode (current) it was read under: the table holds for that mode only (nvml.h)
    capabilities: MigCapabilities | None
    source: str | None  # MigInfo.profiles_source


class NodeReader:
    """Reads snapshots. Keeps each GPU's MIG profile table for as long as its MIG mode stays, and
    the last table read from NVML on each GPU in `profiles_path` for when the driver stops
    answering it."""

    def __init__(self, profiles_path: Path | None = None, sysfs: Path = SYSFS) -> None:
        self._sysfs = sysfs  # the node's (Config.sysfs_path: a simulated node's is the simulator's)
        self._tables: dict[str, _Table] = {}  # by GPU UUID
        # Where each GPU sits, by GPU UUID: its active NVLinks and its NUMA node are the board's, read
        # once (about 300 NVML calls on a DGX A100) rather than on every refresh; a link that fails
        # later is a health matter.
        self._nvlinks: dict[str, list[tuple[int, str]]] = {}
        self._numa_nodes: dict[str, int | None] = {}
        self._cpu_affinities: dict[str, tuple[int, ...]] = {}  # only answers read: a failure is asked again
        self._read_tables = ReadTables(profiles_path)

    def read(self, nvml: Any, known: dict[int, Gpu]) -> Inventory:
        """known: the last good description of each GPU, used for a GPU NVML cannot describe now."""
        calls = _Calls(nvml)
        try:
            return self._read(calls, known)
        except (nvml.NVMLError_FunctionNotFound, nvml.NVMLLibraryMismatchError) as exc:
            raise MissingNvmlCall(f"the NVIDIA driver lacks {calls.last_call or 'an NVML call'}, which gpud "
                                  f"needs ({exc}): install driver R{MINIMUM_BRANCH} or newer") from exc

    def _read(self, nvml: Any, known: dict[int, Gpu]) -> Inventory:
        driver = text(nvml.nvmlSystemGetDriverVersion())
        gpus = tuple(self._read_gpu(nvml, index, known, driver) for index in range(nvml.nvmlDeviceGetCount()))
        gpus = self._with_nvlink_peers(nvml, gpus)
        return Inventory(
            driver_version=driver,
            cuda_version=_cuda_version(nvml.nvmlSystemGetCudaDriverVersion_v2()),
            nvml_version=text(nvml.nvmlSystemGetNVMLVersion()),
            gpus=gpus,
        )

    def _read_gpu(self, nvml: Any, index: int, known: dict[int, Gpu], driver: str) -> Gpu:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            return self._describe_gpu(nvml, index, handle, driver)
        except nvml.NVMLError_FunctionNotFound:
            raise
        except nvml.NVMLError as exc:
            last = known.get(index) or unknown_gpu(index)
            lost = is_lost_error(nvml, exc)
            if lost:
                self._tables.pop(last.uuid, None)  # whatever brings it back (a reset) may change it
                self._nvlinks.pop(last.uuid, None)
                self._numa_nodes.pop(last.uuid, None)
                self._cpu_affinities.pop(last.uuid, None)  # read again when it is back; until then, the
                # affinity it was last described with stays: its slot's CPUs, which gres.conf keeps as Cores=
            if isinstance(exc, nvml.NVMLError_NoPermission):
                return replace(last, lost=False, error=f"this user may not open the GPU: {nvml_error_text(exc)}",
                               unreadable=(f"gpu: {NEEDS_ROOT}",))
            return replace(last, lost=lost, error=nvml_error_text(exc))

    def _describe_gpu(self, nvml: Any, index: int, handle: Any, driver: str) -> Gpu:
        unreadable: list[str] = []
        pci = nvml.nvmlDeviceGetPciInfo_v3(handle)
        memory_mib = nvml.nvmlDeviceGetMemoryInfo(handle).total // MIB
        uuid = text(nvml.nvmlDeviceGetUUID(handle))
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        pci_device_id = f"0x{pci.pciDeviceId:08X}"
        optional = _Optional(nvml, unreadable)
        return Gpu(
            index=index,
            uuid=uuid,
            name=text(nvml.nvmlDeviceGetName(handle)),
            pci_bus_id=text(pci.busId),
            pci_device_id=pci_device_id,
            memory_total_mib=memory_mib,
            compute_mode=_COMPUTE_MODES.get(nvml.nvmlDeviceGetComputeMode(handle), "unknown"),
            architecture=_architecture(nvml, nvml.nvmlDeviceGetArchitecture(handle)),
            cuda_compute_capability=f"{major}.{minor}",
            serial=optional("serial", lambda: text(nvml.nvmlDeviceGetSerial(handle))),
            minor_number=optional("minor_number", lambda: nvml.nvmlDeviceGetMinorNumber(handle)),
            numa_node=self._numa_node(nvml, uuid, text(pci.busId)),
            cpu_affinity=self._cpu_affinity(nvml, uuid, handle, optional),
            mig=self._read_mig(nvml, handle, _Identity(index, uuid, pci_device_id, memory_mib, driver), optional),
            memory_reserved_mib=optional("memory_reserved", lambda: _reserved_mib(nvml, handle)),
            brand=optional("brand", lambda: _brand(nvml, nvml.nvmlDeviceGetBrand(handle), uuid)),
            unreadable=tuple(unreadable),
        )

    def _numa_node(self, nvml: Any, uuid: str, bus_id: str) -> int | None:
        if uuid not in self._numa_nodes:
            self._numa_nodes[uuid] = pci_numa_node(self._sysfs, bus_id)
        return self._numa_nodes[uuid]

    def _cpu_affinity(self, nvml: Any, uuid: str, handle: Any, optional: _Optional) -> tuple[int, ...]:
        """The CPUs NVML says are ideal for the GPU, read once per GPU. Only informative (Slurm's Cores=):
        any failure gives (), and the GPU is lost only if the calls gpud needs say so."""
        if uuid not in self._cpu_affinities:
            try:
                words = optional("cpu_affinity", lambda: nvml.nvmlDeviceGetCpuAffinity(handle, _CPU_MASK_WORDS))
            except nvml.NVMLError as exc:
                log.warning("cpu_affinity_unreadable", gpu=uuid, error=nvml_error_text(exc))
                return ()
            if words is None:
                return ()
            self._cpu_affinities[uuid] = cpus_of_mask(words)
        return self._cpu_affinities[uuid]

    def _with_nvlink_peers(self, nvml: Any, gpus: tuple[Gpu, ...]) -> tuple[Gpu, ...]:
        """Each GPU with the GPUs it reaches over active NVLink: a GPU-to-GPU link's far end, and every
        other GPU with links to the NVSwitches when it has some (an NVSwitch system joins them all); and
        how many of its links end at each GPU, as Slurm counts them for gres.conf Links= (gpu_nvml.c: an
        active link whose remote PCI bus id is another GPU's)."""
        index_of = {normal_bus_id(gpu.pci_bus_id): gpu.index for gpu in gpus}
        direct: dict[int, Counter[int]] = {gpu.index: Counter() for gpu in gpus}
        switched: set[int] = set()
        for gpu in gpus:
            if gpu.lost or gpu.error:
                continue
            if gpu.uuid not in self._nvlinks:
                try:
                    self._nvlinks[gpu.uuid] = active_nvlinks(nvml, nvml.nvmlDeviceGetHandleByIndex(gpu.index))
                except nvml.NVMLError:
                    continue
            for remote_type, remote_bus_id in self._nvlinks[gpu.uuid]:
                if remote_type == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                    switched.add(gpu.index)
                elif (other := index_of.get(normal_bus_id(remote_bus_id))) is not None and other != gpu.index:
                    direct[gpu.index][other] += 1
        return tuple(replace(
            gpu,
            nvlink_peers=tuple(sorted(
                set(direct[gpu.index]) | ((switched - {gpu.index}) if gpu.index in switched else set()))),
            nvlink_counts=tuple(sorted(direct[gpu.index].items()))) for gpu in gpus)

    # -- MIG ---------------------------------------------------------------------------------

    def _read_mig(self, nvml: Any, handle: Any, gpu: _Identity, optional: _Optional) -> MigInfo:
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError_NotSupported:
            return MigInfo(capable=False, mode=None, pending_mode=None)
        table = self._table(nvml, handle, gpu, current, optional)
        mode = lambda value: "enabled" if value == nvml.NVML_DEVICE_MIG_ENABLE else "disabled"  # noqa: E731
        devices: tuple[MigDevice, ...] = ()
        instances: tuple = ()
        capabilities = table.capabilities
        if current == nvml.NVML_DEVICE_MIG_ENABLE and capabilities is not None:
            read = optional("mig.instances", lambda: self._read_instances(nvml, handle, gpu, table))
            if read is not None:
                instances, devices, capabilities = read
        return MigInfo(capable=True, mode=mode(current), pending_mode=mode(pending), devices=devices,
                       profiles_source=table.source, capabilities=capabilities, instances=instances)

    def _read_instances(self, nvml: Any, handle: Any, gpu: _Identity, table: _Table) -> tuple:
        handles = _read_mig_handles(nvml, handle)
        instances, capabilities = mig.read_instances(nvml, handle, table.capabilities,
                                                     {ids: (h["uuid"], h["pids"]) for ids, h in handles.items()})
        if capabilities != table.capabilities:  # compute-instance profiles read through a new GPU instance
            self._tables[gpu.uuid] = replace(table, capabilities=capabilities)
            if table.source == "nvml":
                self._remember(gpu, table.mode, capabilities)
        return instances, _mig_devices(instances, handles, capabilities), capabilities

    def _table(self, nvml: Any, handle: Any, gpu: _Identity, current: int, optional: _Optional) -> _Table:
        """The GPU's profile table under its current MIG mode: read again after any mode change."""
        cached = self._tables.get(gpu.uuid)
        if cached is None or cached.mode != current:
            read = optional("mig.profiles", lambda: mig.read_capabilities(nvml, handle, gpu.memory_mib))
            cached = self._tables[gpu.uuid] = self._choose_table(gpu, current, read)
        return cached

    def _choose_table(self, gpu: _Identity, current: int, read: MigCapabilities | None) -> _Table:
        """NVML's table when it answers one; else the one last read on this GPU; else gpud's own."""
        if read is not None and read.gi_profiles:
            read = with_true_instance_counts(read, gpu.pci_device_id)
            self._remember(gpu, current, read)
            return _Table(current, read, "nvml")
        why = "the driver answers no MIG profile table under the current MIG mode"
        last = self._read_tables.get(gpu.uuid)
        if last is not None:
            log.info("mig_profiles_fallback", gpu=gpu.index, uuid=gpu.uuid, source="last-read", why=why)
            return _Table(current, last, "last-read")
        shipped = shipped_table(gpu.pci_device_id)
        if shipped is not None:
            log.info("mig_profiles_fallback", gpu=gpu.index, uuid=gpu.uuid, source="shipped", model=shipped.model,
                     table_source=shipped.source, why=why)
            return _Table(current, shipped.capabilities, "shipped")
        log.warning("mig_profiles_unknown", gpu=gpu.index, uuid=gpu.uuid, pci_device_id=gpu.pci_device_id,
                    why=why + ", gpud has not read it before and ships none for this GPU")
        return _Table(current, None, None)

    def _remember(self, gpu: _Identity, mode: int, capabilities: MigCapabilities) -> None:
        self._read_tables.remember(gpu.uuid, capabilities, pci_device_id=gpu.pci_device_id,
                                   driver_version=gpu.driver_version, mig_mode_when_read=mode)


@dataclass(frozen=True)
class _Identity:
    index: int
    uuid: str
    pci_device_id: str
    memory_mib: int
    driver_version: str


def _reserved_mib(nvml: Any, handle: Any) -> int | None:
    """What the driver reserves of the GPU's memory (nvmlDeviceGetMemoryInfo_v2 `reserved`), rounded up
    so that what is offered from the rest is never more than there is. None without memory info v2."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is None:
        return None
    reserved = nvml.nvmlDeviceGetMemoryInfo(handle, version=version).reserved
    return -(-reserved // MIB)


class _Optional:
    """Reads a field gpud can do without: None when the driver does not support it, lacks the call,
    or refuses it to this user (noted in `unreadable`). Other errors (a lost GPU) propagate."""

    def __init__(self, nvml: Any, unreadable: list[str]):
        self._nvml = nvml
        self._unreadable = unreadable

    def __call__(self, field: str, read: Callable[[], Any]) -> Any:
        nvml = self._nvml
        try:
            return read()
        except nvml.NVMLError_NoPermission:
            self._unreadable.append(f"{field}: {NEEDS_ROOT}")
            return None
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound, nvml.NVMLLibraryMismatchError):
            return None


def _read_mig_handles(nvml: Any, handle: Any) -> dict[tuple[int, int], dict]:
    """What only a MIG device handle tells, by (GI id, CI id): its index, UUID, size and processes."""
    found = {}
    for mig_index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
        except (nvml.NVMLError_NotFound, nvml.NVMLError_InvalidArgument):
            continue  # NVML allows holes in the MIG device index range
        attrs = nvml.nvmlDeviceGetAttributes(device)
        ids = (nvml.nvmlDeviceGetGpuInstanceId(device), nvml.nvmlDeviceGetComputeInstanceId(device))
        found[ids] = {"index": mig_index, "uuid": text(nvml.nvmlDeviceGetUUID(device)), "attrs": attrs,
                      "pids": _pids(nvml, device)}
    return found


def _pids(nvml: Any, device: Any) -> tuple[int, ...]:
    """The compute processes on a MIG device; none listed where the driver will not tell."""
    try:
        processes = nvml.nvmlDeviceGetComputeRunningProcesses(device)
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission, nvml.NVMLLibraryMismatchError):
        return ()
    return tuple(sorted(p.pid for p in processes))


def _mig_devices(instances: tuple, handles: dict[tuple[int, int], dict], capabilities: MigCapabilities):
    """The MIG devices for the API: the instance tree (already read) joined with their handles."""
    devices = []
    for gi in instances:
        gi_profile = capabilities.gi_profile_by_id(gi.profile_id)
        for ci in gi.compute_instances:
            found = handles.get((gi.gi_id, ci.ci_id))
            if found is None or gi_profile is None:
                continue  # being created or destroyed right now: the next read shows it
            attrs = found["attrs"]
            ci_slices, gi_slices = attrs.computeInstanceSliceCount, attrs.gpuInstanceSliceCount
            devices.append(MigDevice(
                uuid=found["uuid"], index=found["index"],
                profile=mig_device_name(gi_profile.name, gi_slices, ci_slices),
                gi_id=gi.gi_id, ci_id=ci.ci_id, gi_profile_id=gi.profile_id, ci_profile_id=ci.profile_id,
                placement=gi.placement, memory_total_mib=attrs.memorySizeMB, sm_count=attrs.multiprocessorCount,
                pids=found["pids"], gi_slices=gi_slices, ci_slices=ci_slices,
                engines=MigEngines(copy=attrs.sharedCopyEngineCount, decoder=attrs.sharedDecoderCount,
                                   encoder=attrs.sharedEncoderCount, jpeg=attrs.sharedJpegCount,
                                   ofa=attrs.sharedOfaCount)))
    return tuple(sorted(devices, key=lambda d: d.index))


def pci_numa_node(sysfs: Path, bus_id: str) -> int | None:
    """The NUMA node the kernel says a PCI device is attached to (Documentation/ABI/testing/sysfs-bus-pci,
    numa_node: "or -1 if the node is unknown", from ACPI _PXM); None when unknown or unreadable."""
    device = sysfs_pci_device(sysfs, bus_id)
    if device is None:
        return None
    try:
        node = int(read_host_text(device / "numa_node"))
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def cpus_of_mask(words: Any) -> tuple[int, ...]:
    """The CPU ids set in an NVML CPU bitmask: bit j of word i is CPU i * 64 + j."""
    return tuple(index * _CPU_MASK_WORD_BITS + bit for index, word in enumerate(words) if word
                 for bit in range(_CPU_MASK_WORD_BITS) if word >> bit & 1)


def active_nvlinks(nvml: Any, handle: Any) -> list[tuple[int, str]]:
    """(remote device type, remote bus id) of each active link of the GPU."""
    if handle is None:
        return []
    found = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                continue  # present but inactive (a PCIe board without its bridge): connects nothing
            remote_type = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            # pynvml's name for the C call nvmlDeviceGetNvLinkRemotePciInfo_v2 (pynvml.py, 13.615).
            found.append((remote_type, text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)))
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            # NOT_SUPPORTED: no NVLink (a VM without it answers so on every link, as our H100 capture
            # shows); INVALID_ARGUMENT: past the GPU's last link (link 18 on an H100, same capture).
            break
        except nvml.NVMLError:
            continue  # a link that cannot be read connects nothing gpud can name
    return found


def _cuda_version(value: int) -> str:
    return f"{value // 1000}.{value % 1000 // 10}"


def _brand(nvml: Any, value: int, uuid: str) -> str | None:
    """go-nvlib's word for an NVML_BRAND_* value; None (logged at debug) for a value it has no word for."""
    for suffix, word in _BRANDS.items():
        if getattr(nvml, f"NVML_BRAND_{suffix}", None) == value:
            return word
    log.debug("brand_unknown", gpu=uuid, value=value, why="go-nvlib's GetBrandAsString has no word for it")
    return None


def _architecture(nvml: Any, value: int) -> str:
    for name in _ARCHITECTURES:
        if getattr(nvml, f"NVML_DEVICE_ARCH_{name.upper()}", None) == value:
            return name
    return "unknown"
