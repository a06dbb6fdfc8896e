"""The simulator's own control surface (sim_*): fault injection and the outside world.

The sim_* controls model other processes and the hardware, not this process's NVML session, so they
work whether or not NVML is initialised here (see `sim_control`).
"""

from __future__ import annotations

import uuid

import pynvml
from pynvml import NVML_ERROR_IN_USE, NVML_ERROR_NOT_SUPPORTED, NVMLError

from ._core import SimCore, require_root, sim_control
from .drivers import parse_driver
from .errors import SimError
from .identity import pci_bus_id_legacy
from .kernel import append_kmsg, xid_record
from .events import NOT_ATTRIBUTED, Event
from .host_processes import start_time
from .state import LOST_HOW, MIB, Gpu, Holder, MigDevice, SimProcess, check_vgpu_host
from .topology import on_switches, reaches_switches


_PROCESS_KEYS = {"pid", "used_memory_mib", "sm_percent"}

# The recovery action the driver sets after an Xid, from NVIDIA's Xid catalog "Resolution Bucket
# (Immediate Action)" (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html): RESET_GPU
# -> GPU_RESET, RESTART_BM (reboot the bare-metal node) -> NODE_REBOOT. Kept to Xids whose pairing with
# Xid 154 public kernel logs show (79 -> 0x2 Node Reboot Required; 119 -> 0x1 GPU Reset Required) or
# whose catalog action and the A100 memory error guide agree (48, 95 uncontained, 140 unrecovered ECC:
# "requires a GPU reset"); 120 (GSP error) as 119. Other Xids leave the action as it is.
XID_RECOVERY_ACTIONS = {
    48: pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
    79: pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT,
    95: pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
    119: pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
    120: pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
    140: pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
}
# The names Xid 154 prints (the catalog: "None, Drain P2P, Drain and Reset, GPU Reset Required, Node
# Reboot Required"); the newer values by their nvml.h comments.
_ACTION_NAMES = {
    pynvml.NVML_GPU_RECOVERY_ACTION_NONE: "None",
    pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET: "GPU Reset Required",
    pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT: "Node Reboot Required",
    pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P: "Drain P2P",
    pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET: "Drain and Reset",
}
for _name, _text in (("RECOVER_IMEX_DOMAIN", "Recover IMEX Domain"), ("BUS_RESET", "Bus Reset"),
                     ("SYSTEM_REBOOT", "System Reboot")):
    if hasattr(pynvml, "NVML_GPU_RECOVERY_ACTION_" + _name):
        _ACTION_NAMES[getattr(pynvml, "NVML_GPU_RECOVERY_ACTION_" + _name)] = _text
# How far an action goes: a new fault never lowers what an earlier one asked for.
_ACTION_RANK = {
    pynvml.NVML_GPU_RECOVERY_ACTION_NONE: 0,
    pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P: 1,
    pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET: 2,
    pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET: 3,
    pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT: 4,
}
# The text after "pid=..., name=...," for a few Xids (the catalog's descriptions); others get a plain one.
XID_TEXT = {
    13: "Graphics Engine Exception",
    31: "MMU Fault",
    43: "Reset Channel Verif Error",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU",
    79: "GPU has fallen off the bus.",
    94: "Contained: ECC error",
    95: "Uncontained: ECC error",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP!",
}


def _xid_154(bus_id: str, old: int, new: int) -> str:
    return (f"NVRM: Xid (PCI:{bus_id}): 154, GPU recovery action changed from {old:#x} "
            f"({_ACTION_NAMES.get(old, 'Unknown')}) to {new:#x} ({_ACTION_NAMES.get(new, 'Unknown')})")


def _process_name(pid: int | None) -> str | None:
    """The command name of a host process (/proc/<pid>/comm); None for a PID of the simulated world."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as comm:
            return comm.read().strip() or None
    except OSError:
        return None


def _sim_processes(processes: list, memory_mib: int) -> list[SimProcess]:
    """Processes given as PIDs, or as {"pid", "used_memory_mib", "sm_percent"} (the last two optional),
    on a device of memory_mib MiB. Each PID that names a host process now is tied to that process."""
    if not isinstance(processes, list):
        raise SimError(f"processes must be a list, got {processes!r}")
    table = [_sim_process(entry, memory_mib) for entry in processes]
    if len({process.pid for process in table}) != len(table):
        raise SimError("a PID is listed twice")
    return table


def _sim_process(entry: object, memory_mib: int) -> SimProcess:
    record = {"pid": entry} if not isinstance(entry, dict) else entry
    if set(record) - _PROCESS_KEYS or not _is_pid(record.get("pid")):
        raise SimError(f"a process is a PID (positive integer) or an object with 'pid' and optional "
                       f"'used_memory_mib', 'sm_percent'; got {entry!r}")
    memory = record.get("used_memory_mib")
    if memory is not None and not (_is_int(memory) and 0 < memory <= memory_mib):
        raise SimError(f"used_memory_mib must be 1..{memory_mib} (the device's memory), got {memory!r}")
    sm_percent = record.get("sm_percent")
    if sm_percent is not None and not (_is_int(sm_percent) and 0 <= sm_percent <= 100):
        raise SimError(f"sm_percent must be 0..100, got {sm_percent!r}")
    pid = record["pid"]
    used = {} if memory is None else {"used_memory_bytes": memory * MIB}
    return SimProcess(pid, sm_percent=sm_percent, host_start=start_time(pid), **used)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_pid(pid: object) -> bool:
    return _is_int(pid) and pid > 0


class SimControls(SimCore):
    @sim_control
    def sim_resolve(self, gpu: int | str) -> int:
        """The index of a GPU given by index or GPU UUID."""
        return self._target(gpu).index

    @sim_control
    def sim_inject_xid(
        self, gpu: int | str, xid: int, gi_id: int | None = None, ci_id: int | None = None, *,
        nvml_event: bool = True,
    ) -> None:
        """The driver reports an Xid: it logs the NVRM line to the kernel log (sim_kmsg_path) and, with
        nvml_event (the default), delivers the Xid event, attributed to a GI/CI when given, to every set
        that wants it; nvml_event=False is an Xid NVML's event sets missed (only the kernel log has it).

        From R565 on the driver also keeps a recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): an
        Xid whose catalog action is a GPU reset sets GPU_RESET, one that needs the node rebooted
        NODE_REBOOT (XID_RECOVERY_ACTIONS), never lowering one already set; a change is logged as Xid 154
        (NVIDIA's Xid catalog: "Xid 154 will be seen in conjunction with other Xids and summarizes the
        recovery action required", "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot
        Required)")."""
        target = self._target(gpu)
        if not isinstance(xid, int) or isinstance(xid, bool) or xid < 0:
            raise SimError(f"an Xid is a non-negative integer, got {xid!r}")
        if not isinstance(nvml_event, bool):
            raise SimError(f"nvml_event must be true or false, got {nvml_event!r}")
        self._check_instance_ids(target, gi_id, ci_id)
        bus_id = pci_bus_id_legacy(target.bus).rsplit(".", 1)[0].lower()
        pid = next((pid for pid, _, _ in target.running_processes()), None)
        records = [xid_record(bus_id, xid, pid, _process_name(pid), XID_TEXT.get(xid, f"Xid {xid} reported"))]
        action = XID_RECOVERY_ACTIONS.get(xid)
        if self._driver.has_recovery_action and action is not None and \
                _ACTION_RANK[action] > _ACTION_RANK.get(target.recovery_action, 0):
            records.append(_xid_154(bus_id, target.recovery_action, action))
            target.recovery_action = action
            self._commit()
        append_kmsg(self.sim_kmsg_path, records)
        if nvml_event:
            self._publish(
                Event(
                    target.index,
                    pynvml.nvmlEventTypeXidCriticalError,
                    xid,
                    NOT_ATTRIBUTED if gi_id is None else gi_id,
                    NOT_ATTRIBUTED if ci_id is None else ci_id,
                )
            )

    @sim_control
    def sim_set_recovery_action(self, gpu: int | str, action: int) -> None:
        """Sets the GPU's recovery action (NVML_GPU_RECOVERY_ACTION_*) as the driver would after a fault,
        logging the Xid 154 the driver prints for the change. Drivers before R565 keep none: SimError."""
        target = self._target(gpu)
        if not self._driver.has_recovery_action:
            raise SimError(f"driver {self._driver.version} keeps no GPU recovery action (R565 and later do)")
        if not isinstance(action, int) or isinstance(action, bool) or action not in _ACTION_NAMES:
            raise SimError(f"action must be one of the NVML_GPU_RECOVERY_ACTION_* values "
                           f"{sorted(_ACTION_NAMES)}, got {action!r}")
        if action != target.recovery_action:
            bus_id = pci_bus_id_legacy(target.bus).rsplit(".", 1)[0].lower()
            append_kmsg(self.sim_kmsg_path, [_xid_154(bus_id, target.recovery_action, action)])
            target.recovery_action = action
            self._commit()

    @sim_control
    def sim_inject_ecc(self, gpu: int | str, double_bit: bool) -> None:
        """Count one ECC error and deliver its event; a double-bit error also remaps a row."""
        target = self._target(gpu)
        if not target.model.ecc:
            raise SimError(f"GPU {target.index} ({target.model.name}) has no ECC memory")
        target.ecc.record(double_bit)
        if double_bit and target.model.row_remapping:
            target.remapped_rows.uncorrectable += 1
            target.remapped_rows.pending = True  # applied by the next reset
        self._commit()
        event_type = (
            pynvml.nvmlEventTypeDoubleBitEccError if double_bit else pynvml.nvmlEventTypeSingleBitEccError
        )
        self._publish(Event(target.index, event_type))

    @sim_control
    def sim_set_gpu_lost(self, gpu: int | str, how: str = "unknown") -> None:
        """The GPU fell off the bus (Xid 79) until `sim_recover_gpu` or `sim_reset_gpu`.

        nvmlDeviceGetCount still counts it. Handle lookups (by index, UUID, PCI bus id) fail with
        `how`: "unknown" (NVML_ERROR_UNKNOWN, the common case: nvidia-smi's "Unable to determine the
        device handle for GPU ...: Unknown Error" in NVIDIA/nvidia-docker#1553,
        NVIDIA/open-gpu-kernel-modules#387, NVIDIA/dcgm-exporter#604) or "is-lost"
        (NVML_ERROR_GPU_IS_LOST: "... GPU is lost. Reboot the system to recover this GPU"). Handles
        obtained before raise GPU_IS_LOST; event sets with it registered answer GPU_IS_LOST.
        """
        if how not in LOST_HOW:
            raise SimError(f"how must be one of {', '.join(LOST_HOW)}, got {how!r}")
        target = self._target(gpu)
        target.lost = how
        self._commit()
        self._event_signal.notify_all()  # waiters on sets with this GPU answer GPU_IS_LOST now

    @sim_control
    def sim_recover_gpu(self, gpu: int | str) -> None:
        """A lost GPU answers again (as after a reset or a reboot); nothing else changes."""
        target = self._target(gpu)
        if target.lost:
            target.lost = None
            self._commit()

    @sim_control
    def sim_set_processes(self, target: int | str, pids: list) -> None:
        """Replace the compute processes of a GPU (index or UUID) or of a MIG device (MIG UUID).

        Each entry is a PID (holding DEFAULT_PROCESS_MEMORY_BYTES, no SM use) or an object {"pid",
        "used_memory_mib", "sm_percent"}. A PID of a process running on this host stays listed while
        that process runs; other PIDs are processes of the simulated world only (SimProcess)."""
        if isinstance(target, str) and target.startswith("MIG-"):
            gpu, (gi, ci) = self._mig_device_and_gpu(target)
            ci.process_table = _sim_processes(pids, self._gi_memory_mb(gpu, gi))
        else:
            gpu = self._target(target)
            if gpu.mig_enabled:
                raise SimError(
                    f"GPU {gpu.index} is in MIG mode: processes run on MIG devices, pass a MIG UUID"
                )
            gpu.process_table = _sim_processes(pids, int(gpu.model.memory_mib - gpu.model.reserved_mib))
        self._commit()

    # --- processes holding the device ------------------------------------------------------------

    @sim_control
    def sim_add_holder(self, gpu: int | str, process: str, pid: int) -> None:
        """Another host process opens the GPU's device node and keeps it open: a monitoring agent,
        nvidia-persistenced, an MPS server, a CUDA application. It blocks `sim_reset_gpu` (a GPU
        reset needs the GPU free of every client: nvidia-smi's manual on -r). Holders are
        processes, so they live in the state file and outlive this simulator."""
        target = self._target(gpu)
        if not isinstance(process, str) or not process.strip():
            raise SimError(f"process must be a process name, got {process!r}")
        if not _is_pid(pid):
            raise SimError(f"pid must be a positive integer, got {pid!r}")
        if any(holder.pid == pid for holder in target.holders):
            raise SimError(f"PID {pid} already holds GPU {target.index}")
        target.holders.append(Holder(pid, process.strip()))
        self._commit()

    @sim_control
    def sim_release_holders(self, gpu: int | str) -> None:
        """Every other process closes the GPU's device node (they were stopped)."""
        target = self._target(gpu)
        if target.holders:
            target.holders.clear()
            self._commit()

    @sim_control
    def sim_holders(self, gpu: int | str) -> list[tuple[int, str]]:
        """(pid, process name) of the other processes holding the GPU, by PID."""
        return sorted(tuple(holder) for holder in self._target(gpu).holders)

    # --- GPU reset -------------------------------------------------------------------------------

    @sim_control
    def sim_set_fabric_manager(self, running: bool) -> None:
        """Starts or stops nvidia-fabricmanager: on Ampere NVSwitch systems a GPU reset needs it, or
        every NVLink peer must be reset in the same command (nvidia-smi manual, -r)."""
        if not isinstance(running, bool):
            raise SimError(f"running must be true or false, got {running!r}")
        self._node.fabric_manager = running
        if running:  # it registers every GPU in the fabric; stopping it unregisters none (_fabric_calls.py)
            for target in self._gpus:
                target.fabric_registered = True
        self._commit()

    @sim_control
    def sim_fabric_manager_running(self) -> bool:
        """Whether nvidia-fabricmanager runs on the node (what a look at the host's processes tells)."""
        return self._node.fabric_manager

    @sim_control
    def sim_set_passthrough(self, passthrough: bool) -> None:
        """The GPUs are passed through to a virtual machine (or not) that this node is."""
        if not isinstance(passthrough, bool):
            raise SimError(f"passthrough must be true or false, got {passthrough!r}")
        if passthrough and self._node.vgpu_host:
            raise SimError("the GPUs are vGPUs (sim_set_vgpu): a VM's GPU is passed through or a vGPU, not both")
        self._node.passthrough = passthrough
        self._commit()

    @sim_control
    def sim_set_vgpu(self, host_driver_version: str | None, host_driver_branch: str | None = None) -> None:
        """The node is a VM whose GPUs are NVIDIA vGPUs of a hypervisor running the vGPU manager of this
        driver version and branch ("550.54.16", "r550_40"), or (None) not a vGPU guest: their PCI config
        space says so at once (sysfs.py), and nvmlDeviceGetVirtualizationMode answers
        NVML_GPU_VIRTUALIZATION_MODE_VGPU (nvml.h: "Device is associated with vGPU inside virtual machine").
        Only these two are modelled: what else differs in a vGPU guest (no MIG changes, no reset, the
        vGPU profile's name and memory) is not."""
        if host_driver_version is not None:
            check_vgpu_host(host_driver_version, host_driver_branch)
            if self._node.passthrough:
                raise SimError("the GPUs are passed through (sim_set_passthrough): a VM's GPU is passed through "
                               "or a vGPU, not both")
        elif host_driver_branch is not None:
            raise SimError("a host driver branch without its version")
        self._node.vgpu_host_driver_version = host_driver_version
        self._node.vgpu_host_driver_branch = host_driver_branch
        self._commit()
        self._write_sysfs()

    @sim_control
    def sim_reset_gpu(self, gpus: int | str | list[int | str]) -> None:
        """What `nvidia-smi -r -i <ids>` does, in another process.

        Refused with NVMLError(NVML_ERROR_IN_USE), changing nothing, when (nvidia-smi manual, -r:
        "There can't be any applications using these devices (e.g. CUDA application, graphics
        application like X server, monitoring application like other instance of nvidia-smi)"):
        * this process has NVML initialised: its NVML session and event sets hold every GPU open
          (reference README correction);
        * another process holds a GPU being reset (`sim_add_holder`) or computes on it;
        * the GPUs must be reset together with their NVLink peers (on an Ampere NVSwitch system
          without Fabric Manager; Hopper and later, and direct GPU-to-GPU links from Ampere on, reset
          each GPU individually: the manual's two tables) and a peer is left out, or a compute
          process runs on any GPU of the system ("if individual GPU reset is not feasible").
        Otherwise every GPU given is reset (`Gpu.reset`: MIG instances gone, a pending MIG mode
        applied, a lost GPU back, volatile ECC cleared, pending remaps applied, NVLink retrained).
        Holders stay: they are processes, which a reset does not end.

        Root only, before anything else is looked at: nvidia-smi(1), -r/--gpu-reset, "Requires root";
        the driver call behind it is not in nvml.h, so the refusal is NVML's for every root-only
        call, NO_PERMISSION ("Insufficient Permissions"), as for -mig and -c.
        """
        targets = self._reset_targets(gpus)
        require_root()
        if self._node.passthrough:
            # nvml.h, nvmlDeviceSetMigMode: "On certain platforms like pass-through virtualization,
            # where reset functionality may not be exposed directly, VM reboot is required." No source
            # says what nvidia-smi -r answers there: modelled as the strictest, not supported.
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if self._init_count:
            raise NVMLError(NVML_ERROR_IN_USE)
        self._check_reset(targets)
        for gpu in targets:
            gpu.reset()
            # A reset GPU registers with the fabric again: at once where Fabric Manager runs, else not.
            gpu.fabric_registered = self._node.fabric_manager
        self._commit()

    def _reset_targets(self, gpus: int | str | list[int | str]) -> list[Gpu]:
        chosen = gpus if isinstance(gpus, list) else [gpus]
        if not chosen:
            raise SimError("give at least one GPU to reset")
        by_index = {gpu.index: gpu for gpu in map(self._target, chosen)}
        return [by_index[index] for index in sorted(by_index)]

    def _check_reset(self, targets: list[Gpu]) -> None:
        if any(gpu.in_use() for gpu in targets):
            raise NVMLError(NVML_ERROR_IN_USE)
        if any(self._needs_peers_in_reset(gpu) for gpu in targets):
            peers = on_switches([gpu.links for gpu in self._gpus])
            if peers - {gpu.index for gpu in targets}:
                raise NVMLError(NVML_ERROR_IN_USE)
            if any(gpu.running_processes() for gpu in self._gpus):
                raise NVMLError(NVML_ERROR_IN_USE)

    def _needs_peers_in_reset(self, gpu: Gpu) -> bool:
        """True when the GPU cannot be reset on its own (nvidia-smi manual, -r): Ampere GPUs on
        NVSwitches need Fabric Manager for an individual reset. No catalogue model has NVLink before
        Ampere, the other case the manual names."""
        if self._node.fabric_manager or gpu.model.architecture != pynvml.NVML_DEVICE_ARCH_AMPERE:
            return False
        return reaches_switches(gpu.links)

    # --- faults ----------------------------------------------------------------------------------

    @sim_control
    def sim_set_nvlink(self, gpu: int | str, link: int, up: bool) -> None:
        """Takes an NVLink link down (or brings it back), as a failed link or cable would."""
        target = self._target(gpu)
        if not target.links:
            raise SimError(f"GPU {target.index} ({target.model.name}) has no active NVLink links")
        if not isinstance(link, int) or not 0 <= link < len(target.links):
            raise SimError(f"GPU {target.index} ({target.model.name}) has no NVLink link {link!r} "
                           f"(it has {len(target.links)})")
        down = set(target.nvlinks_down) - {link} if up else set(target.nvlinks_down) | {link}
        target.nvlinks_down = sorted(down)
        self._commit()

    @sim_control
    def sim_add_pcie_replays(self, gpu: int | str, count: int) -> None:
        """Adds PCIe replays to the GPU's counter, as a marginal link would."""
        if count < 0:
            raise SimError("a replay counter only grows")
        self._target(gpu).pcie_replays += count
        self._commit()

    @sim_control
    def sim_set_retired_pages_pending(self, gpu: int | str) -> None:
        """Marks a page retirement pending (pre-Ampere GPUs); a reset applies it."""
        target = self._target(gpu)
        if not target.model.page_retirement:
            raise SimError(f"GPU {target.index} ({target.model.name}) has no page retirement")
        target.retired_pages_pending = True
        self._commit()

    # --- fabric, reboot and the driver's versions ---------------------------------------------

    @sim_control
    def sim_set_fabric(self, gpu: int | str, state: int | None = None, status: int | None = None,
                       health_mask: int | None = None) -> None:
        """Injects a fabric fault: what nvmlDeviceGetGpuFabricInfo[V] answers for the GPU instead of the
        driver's own state (NVML_GPU_FABRIC_STATE_*), status (an nvmlReturn_t) and health mask
        (NVML_GPU_FABRIC_HEALTH_MASK_*; e.g. _fabric_calls.DEGRADED_BW_MASK). Each left None keeps the
        driver's value; all None removes the fault. It lasts until changed: a reset or a reboot does not
        mend a fabric (a switch, a tray or a cable)."""
        target = self._target(gpu)
        fault = {}
        for name, value, top in (("state", state, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED),
                                 ("status", status, 0xFFFFFFFF), ("health_mask", health_mask, 0xFFFFFFFF)):
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
                raise SimError(f"{name} must be an integer 0..{top} or None, got {value!r}")
            fault[name] = value
        target.fabric_fault = fault or None
        self._commit()

    @sim_control
    def sim_reboot(self) -> None:
        """The node reboots: every process ends (compute processes and holders), every GPU comes back as
        after a reset (lost ones too; instances gone, a pending MIG mode applied, pending remaps applied),
        recovery actions go back to NONE (NODE_REBOOT is mended only so: "Reboot the operating system",
        Error Recovery and Response Flags), the kernel module of the installed driver loads (an unfinished
        upgrade completes), a new boot id. Fabric Manager starts again if it is enabled, registering the
        GPUs; injected fabric faults stay (sim_set_fabric). Refused while this process has NVML
        initialised: a reboot would end it."""
        if self._init_count:
            raise SimError("a reboot ends every process, this one too: nvmlShutdown first")
        for target in self._gpus:
            target.reset()
            target.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
            target.fabric_registered = self._node.fabric_manager
            target.process_table = []
            target.holders.clear()
        self._node.kernel_module = None
        self._node.boot_id = str(uuid.uuid4())
        self._commit()
        self._write_procfs()

    @sim_control
    def sim_set_kernel_module(self, version: str) -> None:
        """The loaded kernel module becomes this driver version while the user-space library stays the
        simulator's (what an unfinished driver upgrade leaves: new library, old module still loaded). While
        they differ, /proc/driver/nvidia/version shows the module's version and nvmlInit raises
        NVMLError(NVML_ERROR_LIB_RM_VERSION_MISMATCH); sim_reboot loads the library's version again, as
        does setting it back."""
        module = parse_driver(version).version
        self._node.kernel_module = None if module == self._driver.version else module
        self._commit()
        self._write_procfs()

    @sim_control
    def sim_library_version(self) -> str:
        """The user-space library's version: the simulated driver's (nvmlSystemGetDriverVersion's)."""
        return self._driver.version

    @sim_control
    def sim_kernel_module_version(self) -> str:
        """The loaded kernel module's version (what /proc/driver/nvidia/version shows)."""
        return self._node.kernel_module or self._driver.version

    # --- helpers --------------------------------------------------------------------------------

    def _target(self, gpu: int | str) -> Gpu:
        if isinstance(gpu, int) and not isinstance(gpu, bool) and 0 <= gpu < len(self._gpus):
            return self._gpus[gpu]
        for candidate in self._gpus:
            if candidate.uuid == gpu:
                return candidate
        raise SimError(f"no GPU {gpu!r}: give an index 0..{len(self._gpus) - 1} or a GPU UUID")

    def _mig_device_by_uuid(self, uuid: str) -> MigDevice:
        return self._mig_device_and_gpu(uuid)[1]

    def _mig_device_and_gpu(self, uuid: str) -> tuple[Gpu, MigDevice]:
        for gpu in self._gpus:
            for mig_device in gpu.mig_devices():
                if mig_device.compute_instance.uuid == uuid:
                    return gpu, mig_device
        raise SimError(f"no MIG device {uuid!r}")

    @staticmethod
    def _check_instance_ids(gpu: Gpu, gi_id: int | None, ci_id: int | None) -> None:
        if gi_id is None:
            if ci_id is not None:
                raise SimError("a compute instance id needs its GPU instance id")
            return
        gi = gpu.gpu_instances.get(gi_id)
        if gi is None:
            raise SimError(f"GPU {gpu.index} has no GPU instance {gi_id}")
        if ci_id is not None and ci_id not in gi.compute_instances:
            raise SimError(f"GPU instance {gi_id} of GPU {gpu.index} has no compute instance {ci_id}")
