"""The mutable machine state and its JSON state file.

Everything that survives a restart lives here: MIG modes, GPU/compute instances, compute modes,
processes, other processes holding the GPUs, lost GPUs, error counters and whether Fabric Manager
runs. Identities (UUIDs, bus ids) and NVLink wiring are derived from the preset, so the file repeats
them only for people reading it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pynvml

from .errors import SimError
from .events import NOT_ATTRIBUTED
from .host_processes import start_time
from .identity import gpu_uuid, mig_uuid, pci_buses
from .models import ComputeInstanceProfile, GpuInstanceProfile, GpuModel
from .placement import Span
from .presets import preset_fabric
from .sysfs import HOST_DRIVER_FIELD_BYTES, VgpuHost
from .topology import Link, wire

FORMAT = 1
# How a lost GPU answers (sim_set_gpu_lost): "unknown" — handle lookups fail with NVML_ERROR_UNKNOWN,
# as nvidia-smi's "Unable to determine the device handle for GPU ...: Unknown Error" after an Xid 79;
# "is-lost" — they fail with NVML_ERROR_GPU_IS_LOST ("... GPU is lost. Reboot the system").
LOST_HOW = ("unknown", "is-lost")
MIB = 1 << 20
# Recovery actions a GPU reset satisfies (NVML_GPU_RECOVERY_ACTION_*: nvml.h "Reset Gpu", "Drain P2P and
# Reset Gpu").
RESET_CLEARS = frozenset({pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET, pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET})
FABRIC_FAULT_KEYS = ("state", "status", "health_mask")
# What a simulated compute process holds on the GPU unless told otherwise (a CUDA context plus a little).
DEFAULT_PROCESS_MEMORY_BYTES = 256 * MIB


class Holder(NamedTuple):
    """Another host process that holds the GPU's device node open (nvidia-persistenced, DCGM, ...)."""

    pid: int
    process: str


@dataclass(frozen=True)
class SimProcess:
    """A compute process the simulated driver lists on a GPU or MIG device.

    host_start: when a process with this PID ran on this host as it was set, its start time
    (/proc/<pid>/stat field 22). nvml.h, nvmlDeviceGetComputeRunningProcesses, lists "only ... compute
    running processes (e.g. CUDA application which have active context)", and a context does not
    outlive its process, so such a process is listed only while that same host process runs (a reused
    PID has another start time). None: a PID of the simulated world only, listed until replaced.
    sm_percent: the SM utilisation nvmlDeviceGetProcessUtilization samples for it; None or 0: no sample.
    """

    pid: int
    used_memory_bytes: int = DEFAULT_PROCESS_MEMORY_BYTES
    sm_percent: int | None = None
    host_start: int | None = None

    def running(self) -> bool:
        return self.host_start is None or start_time(self.pid) == self.host_start

    def as_record(self) -> dict[str, Any]:
        return asdict(self)


def live_pids(table: list[SimProcess]) -> list[int]:
    return [process.pid for process in table if process.running()]


@dataclass(eq=False)
class ComputeInstance:
    id: int
    profile: ComputeInstanceProfile
    span: Span
    uuid: str  # of the MIG device this CI is
    serial: int  # in-memory only: tells this CI from an earlier one with the same id
    process_table: list[SimProcess] = field(default_factory=list)

    @property
    def processes(self) -> list[int]:
        """PIDs of the compute processes running on this MIG device now."""
        return live_pids(self.process_table)

    def running_process_table(self) -> list[SimProcess]:
        return [process for process in self.process_table if process.running()]


@dataclass(eq=False)
class GpuInstance:
    id: int
    profile: GpuInstanceProfile
    span: Span
    serial: int
    compute_instances: dict[int, ComputeInstance] = field(default_factory=dict)

    def process_count(self) -> int:
        return sum(len(ci.processes) for ci in self.compute_instances.values())

    def process_memory_bytes(self) -> int:
        return sum(p.used_memory_bytes for ci in self.compute_instances.values() for p in ci.running_process_table())


@dataclass
class EccCounters:
    volatile_corrected: int = 0
    volatile_uncorrected: int = 0
    aggregate_corrected: int = 0
    aggregate_uncorrected: int = 0

    def record(self, double_bit: bool) -> None:
        kind = "uncorrected" if double_bit else "corrected"
        for counter in ("volatile", "aggregate"):
            name = f"{counter}_{kind}"
            setattr(self, name, getattr(self, name) + 1)

    def count(self, error_type: int, counter_type: int) -> int:
        counter = "volatile" if counter_type == pynvml.NVML_VOLATILE_ECC else "aggregate"
        kind = "uncorrected" if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "corrected"
        return getattr(self, f"{counter}_{kind}")

    def clear_volatile(self) -> None:
        self.volatile_corrected = self.volatile_uncorrected = 0


@dataclass
class RemappedRows:
    correctable: int = 0
    uncorrectable: int = 0
    pending: bool = False
    failure: bool = False


class MigDevice(NamedTuple):
    """What NVML exposes as a MIG device: a compute instance inside its GPU instance."""

    gpu_instance: GpuInstance
    compute_instance: ComputeInstance


@dataclass(eq=False)
class Gpu:
    index: int
    model: GpuModel
    uuid: str
    bus: int
    mig_current: int = pynvml.NVML_DEVICE_MIG_DISABLE
    mig_pending: int = pynvml.NVML_DEVICE_MIG_DISABLE
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    lost: str | None = None  # one of LOST_HOW while the GPU is off the bus
    process_table: list[SimProcess] = field(default_factory=list)  # while MIG is off; else on the CIs
    holders: list[Holder] = field(default_factory=list)
    ecc: EccCounters = field(default_factory=EccCounters)
    remapped_rows: RemappedRows = field(default_factory=RemappedRows)
    pcie_replays: int = 0
    nvlinks_down: list[int] = field(default_factory=list)
    retired_pages_pending: bool = False
    gpu_instances: dict[int, GpuInstance] = field(default_factory=dict)
    links: tuple[Link, ...] = ()  # NVLink wiring, from the preset
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: what the driver asks for after a fault (NVML_GPU_RECOVERY_ACTION_*)
    recovery_action: int = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    # Fabric Manager registered the GPU in the NVLink fabric since the driver loaded (fabric state COMPLETED);
    # it stays registered when FM stops afterwards (NVIDIA/NVSentinel#883, #889: the state does not revert).
    fabric_registered: bool = True
    # sim_set_fabric: what an injected fabric fault makes NVML answer, {"state", "status", "health_mask"}
    # (each may be absent: the driver's own value then); None: no fault.
    fabric_fault: dict[str, int] | None = None

    @property
    def processes(self) -> list[int]:
        """PIDs of the compute processes running on the whole GPU now (MIG off)."""
        return live_pids(self.process_table)

    @property
    def mig_enabled(self) -> bool:
        return self.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE

    def mig_devices(self) -> list[MigDevice]:
        """In NVML's MIG device index order: by GI id, then CI id (as nvidia-smi -L lists them in the
        MIG user guide)."""
        return [
            MigDevice(gi, gi.compute_instances[ci_id])
            for _, gi in sorted(self.gpu_instances.items())
            for ci_id in sorted(gi.compute_instances)
        ]

    def in_use(self) -> bool:
        """Another process holds the device or computes on it: the driver cannot reset it."""
        return bool(self.holders or self.running_processes())

    def reset(self) -> None:
        """What a GPU reset does: GPU and compute instances are destroyed (MIG instances are driver
        state), a pending MIG mode applies, a lost GPU answers again, volatile ECC counters clear,
        pending row remaps and page retirements apply, NVLink training runs again. A recovery action a
        reset satisfies (GPU_RESET, DRAIN_AND_RESET) goes back to NONE ("Error Recovery and Response
        Flags": "reset the GPU using nvidia-smi -r, and the GPU can be used again"); NODE_REBOOT stays
        ("Reboot the operating system"), and so do the others a reset does not satisfy."""
        if self.recovery_action in RESET_CLEARS:
            self.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
        self.gpu_instances.clear()
        self.mig_current = self.mig_pending
        self.lost = None
        self.ecc.clear_volatile()
        self.remapped_rows.pending = False
        self.retired_pages_pending = False
        self.nvlinks_down.clear()

    def running_processes(self) -> list[tuple[int, int, int]]:
        """(pid, GI id, CI id) of every compute process; ids are 0xFFFFFFFF without MIG."""
        unattributed = [(pid, NOT_ATTRIBUTED, NOT_ATTRIBUTED) for pid in self.processes]
        return unattributed + [(pid, gi.id, ci.id) for gi, ci in self.mig_devices() for pid in ci.processes]

    def running_process_table(self) -> list[tuple[SimProcess, int, int]]:
        """Like running_processes, with each process's whole record."""
        unattributed = [(p, NOT_ATTRIBUTED, NOT_ATTRIBUTED) for p in self.process_table if p.running()]
        return unattributed + [(p, gi.id, ci.id) for gi, ci in self.mig_devices() for p in ci.running_process_table()]


def new_gpus(preset: str, models: list[GpuModel]) -> list[Gpu]:
    buses = pci_buses(len(models))
    links = wire(models, buses, preset_fabric(preset))
    return [
        Gpu(index=index, model=model, uuid=gpu_uuid(preset, index, model.key), bus=buses[index],
            links=links[index])
        for index, model in enumerate(models)
    ]


# --- state file -------------------------------------------------------------------------------


def read_state_file(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise SimError(f"{path}: not a simulator state file: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise SimError(f"{path}: not a simulator state file of format {FORMAT}")
    return document


@dataclass
class Node:
    """The simulated host beyond its GPUs: what runs on it and how the GPUs reach it."""

    fabric_manager: bool = True  # nvidia-fabricmanager runs (NVSwitch systems)
    # The GPUs are passed through to a virtual machine (`nvidia-smi -q`: "Virtualization Mode:
    # Pass-Through", as on the H100 of tests/fixtures/hardware): the VM sees no GPU reset.
    passthrough: bool = False
    # The version of the loaded kernel module when it is not the user-space library's (an unfinished
    # driver upgrade: sim_set_kernel_module); None: the library's own, as after a boot.
    kernel_module: str | None = None
    # /proc/sys/kernel/random/boot_id: a random UUID the kernel makes at each boot (random(4)).
    boot_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    # The node is a VM whose GPUs are NVIDIA vGPUs of a hypervisor running this vGPU manager (its driver
    # version and branch, which the vGPUs' PCI config space carries: sysfs.py); None: not a vGPU guest.
    vgpu_host_driver_version: str | None = None
    vgpu_host_driver_branch: str | None = None

    @property
    def vgpu_host(self) -> VgpuHost | None:
        if self.vgpu_host_driver_version is None:
            return None
        return VgpuHost(self.vgpu_host_driver_version, self.vgpu_host_driver_branch or "")


def check_vgpu_host(version: object, branch: object) -> None:
    """A vGPU manager's version and branch as its host driver record holds them: ASCII text of at most
    10 bytes each (internal/vgpu/vgpu.go HostDriverVersionLength, HostDriverBranchLength)."""
    for name, value in (("version", version), ("branch", branch)):
        if not (isinstance(value, str) and value.isascii() and value.isprintable()
                and 0 < len(value) <= HOST_DRIVER_FIELD_BYTES):
            raise SimError(f"the vGPU host driver {name} must be 1 to {HOST_DRIVER_FIELD_BYTES} printable ASCII "
                           f"characters, got {value!r}")


def dump_state(preset: str, gpus: list[Gpu], node: Node) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "preset": preset,
        **asdict(node),
        "gpus": [_dump_gpu(gpu) for gpu in gpus],
    }


def restore_node(document: dict[str, Any]) -> Node:
    # The keys are absent in state files of older gpud versions: the defaults apply.
    kernel_module = document.get("kernel_module")
    if kernel_module is not None and not isinstance(kernel_module, str):
        raise SimError(f"kernel_module must be a driver version or null, not {kernel_module!r}")
    boot_id = document.get("boot_id")
    version, branch = document.get("vgpu_host_driver_version"), document.get("vgpu_host_driver_branch")
    if version is not None or branch is not None:
        check_vgpu_host(version, branch)
    return Node(fabric_manager=bool(document.get("fabric_manager", True)),
                passthrough=bool(document.get("passthrough", False)),
                kernel_module=kernel_module,
                **({"boot_id": str(boot_id)} if boot_id else {}),
                vgpu_host_driver_version=version, vgpu_host_driver_branch=branch)


def _dump_gpu(gpu: Gpu) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "model": gpu.model.key,
        "uuid": gpu.uuid,
        "mig_mode": {"current": gpu.mig_current, "pending": gpu.mig_pending},
        "compute_mode": gpu.compute_mode,
        "lost": gpu.lost or False,
        "processes": [process.as_record() for process in gpu.process_table],
        "holders": [holder._asdict() for holder in gpu.holders],
        "ecc_errors": asdict(gpu.ecc),
        "remapped_rows": asdict(gpu.remapped_rows),
        "pcie_replays": gpu.pcie_replays,
        "nvlinks_down": gpu.nvlinks_down,
        "retired_pages_pending": gpu.retired_pages_pending,
        "recovery_action": gpu.recovery_action,
        "fabric_registered": gpu.fabric_registered,
        "fabric_fault": gpu.fabric_fault,
        "gpu_instances": [_dump_gpu_instance(gi) for _, gi in sorted(gpu.gpu_instances.items())],
    }


def _dump_gpu_instance(gi: GpuInstance) -> dict[str, Any]:
    return {
        "id": gi.id,
        "profile_id": gi.profile.id,
        "profile": gi.profile.name,
        "placement": gi.span._asdict(),
        "compute_instances": [
            {
                "id": ci.id,
                "profile_id": ci.profile.id,
                "placement": ci.span._asdict(),
                "uuid": ci.uuid,
                "processes": [process.as_record() for process in ci.process_table],
            }
            for _, ci in sorted(gi.compute_instances.items())
        ],
    }


def restore_gpus(
    document: dict[str, Any], preset: str, models: list[GpuModel], next_serial: Callable[[], int]
) -> list[Gpu]:
    """The GPUs of a state file; raises ValueError (or a KeyError, TypeError...) when it does not fit."""
    gpus = new_gpus(preset, models)
    saved = document["gpus"]
    if [record["model"] for record in saved] != [model.key for model in models]:
        raise ValueError("its GPU models differ from the preset's")
    for gpu, record in zip(gpus, saved, strict=True):
        _restore_gpu(gpu, record, next_serial)
    return gpus


def _restore_gpu(gpu: Gpu, record: dict[str, Any], next_serial: Callable[[], int]) -> None:
    gpu.mig_current = record["mig_mode"]["current"]
    gpu.mig_pending = record["mig_mode"]["pending"]
    gpu.compute_mode = record["compute_mode"]
    gpu.lost = _restore_lost(record["lost"])
    gpu.process_table = _restore_processes(record["processes"])
    gpu.holders = [Holder(int(h["pid"]), str(h["process"])) for h in record.get("holders", [])]
    gpu.ecc = EccCounters(**record["ecc_errors"])
    gpu.remapped_rows = RemappedRows(**record["remapped_rows"])
    gpu.pcie_replays = record.get("pcie_replays", 0)  # absent in state files of older gpud versions
    gpu.nvlinks_down = list(record.get("nvlinks_down", []))
    gpu.retired_pages_pending = record.get("retired_pages_pending", False)
    # Absent in state files of older gpud versions: no recovery action, registered, no fabric fault.
    gpu.recovery_action = int(record.get("recovery_action", pynvml.NVML_GPU_RECOVERY_ACTION_NONE))
    gpu.fabric_registered = bool(record.get("fabric_registered", True))
    fault = record.get("fabric_fault")
    if fault is not None and (not isinstance(fault, dict) or set(fault) - set(FABRIC_FAULT_KEYS)
                              or not all(isinstance(value, int) for value in fault.values())):
        raise ValueError(f"fabric_fault must be null or an object of {FABRIC_FAULT_KEYS} integers, not {fault!r}")
    gpu.fabric_fault = dict(fault) if fault else None
    for gi_record in record["gpu_instances"]:
        gi = GpuInstance(
            id=gi_record["id"],
            profile=_required(gpu.model.mig.by_id(gi_record["profile_id"])),
            span=Span(**gi_record["placement"]),
            serial=next_serial(),
        )
        for ci_record in gi_record["compute_instances"]:
            gi.compute_instances[ci_record["id"]] = ComputeInstance(
                id=ci_record["id"],
                profile=_required(gi.profile.compute_profile(ci_record["profile_id"])),
                span=Span(**ci_record["placement"]),
                uuid=mig_uuid(gpu.uuid, gi.id, ci_record["id"]),
                serial=next_serial(),
                process_table=_restore_processes(ci_record["processes"]),
            )
        gpu.gpu_instances[gi.id] = gi


def _restore_processes(records: list) -> list[SimProcess]:
    # State files of older gpud versions list bare PIDs: processes of the simulated world, default memory.
    return [SimProcess(record) if isinstance(record, int) else SimProcess(**record) for record in records]


def _restore_lost(value: Any) -> str | None:
    if value is True:  # state files of older gpud versions: lost meant GPU_IS_LOST everywhere
        return "is-lost"
    if value in (False, None):
        return None
    if value not in LOST_HOW:
        raise ValueError(f"lost must be false or one of {LOST_HOW}, not {value!r}")
    return value


def _required(profile: Any) -> Any:
    if profile is None:
        raise ValueError("unknown profile id")
    return profile
