"""Shared machinery of the simulator: lifecycle, locking, persistence and handle resolution."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pynvml import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
    NVML_ERROR_UNKNOWN,
    NVMLError,
)

from gpud.base.persist import write_json_atomic

from .drivers import parse_driver
from .errors import SimError
from .events import Event, EventSet
from .handles import SERIAL_MASK, HandleRef, Kind, decode, make_handle
from .presets import PresetError, canonical_preset, parse_preset, preset_numa_nodes
from .state import (
    ComputeInstance,
    Gpu,
    GpuInstance,
    MigDevice,
    Node,
    dump_state,
    new_gpus,
    read_state_file,
    restore_gpus,
    restore_node,
)
from .identity import pci_bus_id_legacy
from .kernel import write_procfs
from .sysfs import write_pci_devices

Method = TypeVar("Method", bound=Callable)
# Crash tests set this to N: the process is killed right after the N-th change to the simulated GPUs.
CRASH_AFTER_COMMITS_ENV = "GPUD_SIM_CRASH_AFTER_COMMITS"
# Failure tests set this to N: the N-th MIG-changing call fails with NVML_ERROR_UNKNOWN, changing nothing.
FAIL_MIG_CALL_ENV = "GPUD_SIM_FAIL_MIG_CALL"


def nvml_call(method: Method) -> Method:
    """An NVML call: serialized under the simulator lock, Uninitialized before nvmlInit, and
    FunctionNotFound where the driver branch lacks the function (models.yaml functions_added_in)."""

    @functools.wraps(method)
    def locked(self: SimCore, *args, **kwargs):
        with self._lock:
            if not self._init_count:
                raise NVMLError(NVML_ERROR_UNINITIALIZED)
            if not self._driver.has_function(method.__name__):
                raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)  # what pynvml raises for a missing symbol
            self._injected_failure(method.__name__)
            return method(self, *args, **kwargs)

    return locked


def sim_control(method: Method) -> Method:
    """A sim_* control: the world outside this process, so it works whether or not NVML is initialised
    here. Initialised, it acts on the live state; otherwise it loads the state file, changes it and
    writes it back (every change commits), as `nvidia-smi -r` in another process would."""

    @functools.wraps(method)
    def locked(self: SimCore, *args, **kwargs):
        with self._lock:
            if self._init_count:
                return method(self, *args, **kwargs)
            self._load()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._gpus = []

    return locked


def require_root() -> None:
    """NVML's privileged calls answer NO_PERMISSION to other users (read per call, so a test can run
    the simulator as another uid)."""
    if os.geteuid() != 0:
        raise NVMLError(NVML_ERROR_NO_PERMISSION)


class SimCore:
    def __init__(self, preset: str, state_path: str | os.PathLike, driver: str | None = None) -> None:
        self._preset = canonical_preset(preset)
        self._models = parse_preset(preset)
        self._driver = parse_driver(driver)
        self._state_path = Path(state_path)
        # The simulated node's sysfs (the real one is /sys), where Config.sysfs_path points on a simulated node.
        self.sysfs_root = self._state_path.with_name(self._state_path.name + ".sysfs")
        # This real host's sysfs, where the simulated GPUs' local CPUs come from (sysfs.local_cpus); tests
        # point it at a fake one.
        self.host_sysfs_root = Path("/sys")
        # The simulated node's kernel log, a regular file of /dev/kmsg records (kernel.py), where gpud's
        # kmsg path points on a simulated node; and its procfs (the real one is /proc).
        self.sim_kmsg_path = self._state_path.with_name(self._state_path.name + ".kmsg")
        self.sim_procfs_root = self._state_path.with_name(self._state_path.name + ".procfs")
        with contextlib.suppress(OSError):  # the kernel's log is there from boot, before any driver loads
            self.sim_kmsg_path.parent.mkdir(parents=True, exist_ok=True)
            self.sim_kmsg_path.touch(exist_ok=True)
        # One lock for everything; event waits release it through the condition.
        self._lock = threading.RLock()
        self._event_signal = threading.Condition(self._lock)
        self._init_count = 0
        self._gpus: list[Gpu] = []
        self._node = Node()
        self._event_sets: dict[int, EventSet] = {}
        self._event_set_ids = itertools.count(1)
        # GPM sample buffers (serial -> what was read into one, None before a read) and each device's last
        # read: process memory, as event sets (_gpm_calls.py)
        self._gpm_samples: dict = {}
        self._gpm_serials = itertools.count(1)
        self._gpm_last: dict = {}
        self._serials = itertools.count(1)
        self._commits = 0
        self._crash_after_commits = int(os.environ.get(CRASH_AFTER_COMMITS_ENV, "0") or 0)
        self._mig_calls = 0
        self.fail_mig_call = int(os.environ.get(FAIL_MIG_CALL_ENV, "0") or 0)
        self._failing_calls: dict[str, list[int]] = {}  # name prefix -> [NVML error code, calls left]

    # --- lifecycle ----------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        # Init/shutdown nest like NVML's reference count; the state loads on the first init.
        with self._lock:
            self._injected_failure("nvmlInitWithFlags")
            if not self._init_count:
                self._load()
                if self._node.kernel_module not in (None, self._driver.version):
                    # nvml.h: "NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18, RM detects a driver/library
                    # version mismatch": the library is the new driver's, the loaded module the old one's.
                    self._gpus = []
                    raise NVMLError(NVML_ERROR_LIB_RM_VERSION_MISMATCH)
            self._init_count += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            if not self._init_count:
                raise NVMLError(NVML_ERROR_UNINITIALIZED)
            self._init_count -= 1
            if not self._init_count:
                self._gpus = []
                self._event_sets.clear()
                self._gpm_samples.clear()
                self._gpm_last.clear()
                self._event_signal.notify_all()  # waiters wake up to Uninitialized

    def _load(self) -> None:
        """The machine state from the state file, which is created on first use."""
        self._load_state()
        self._write_sysfs()
        self._write_procfs()

    def _write_sysfs(self) -> None:
        """The GPUs' PCI device files as the node is now: bare metal, or a VM's vGPUs."""
        write_pci_devices(self.sysfs_root, self._gpus, preset_numa_nodes(self._preset), self._node.vgpu_host)

    def _write_procfs(self) -> None:
        """The driver's procfs files as the node is now: the loaded module's version, the boot id, and
        the NVSwitch devices the GPUs' NVLinks reach (the NVSwitch driver lists each one)."""
        switches = sorted({link.remote_bus for gpu in self._gpus for link in gpu.links if link.peer is None})
        write_procfs(self.sim_procfs_root, self._node.kernel_module or self._driver.version, self._node.boot_id,
                     [pci_bus_id_legacy(bus).lower() for bus in switches])

    def _load_state(self) -> None:
        document = read_state_file(self._state_path)
        if document is None:
            self._gpus, self._node = new_gpus(self._preset, self._models), Node()
            self._save()
            return
        saved_preset = document.get("preset")
        if saved_preset != self._preset:
            raise PresetError(
                f"state file {self._state_path} was made for preset {saved_preset!r}, "
                f"but this simulator runs preset {self._preset!r}: use that preset or another state file"
            )
        try:
            self._gpus = restore_gpus(document, self._preset, self._models, self._next_serial)
        except (KeyError, ValueError, TypeError, AttributeError) as error:
            raise SimError(
                f"{self._state_path}: state does not fit preset {self._preset!r}: {error!r}"
            ) from None
        self._node = restore_node(document)
        if "boot_id" not in document:  # a state file of an older gpud: the boot id it gets now is kept
            self._save()

    def _dump(self) -> dict:
        return dump_state(self._preset, self._gpus, self._node)

    def _save(self) -> None:
        # Atomic, not durable: the simulated machine must survive a killed process (the crash
        # tests), which the rename guarantees; no test cuts the power, so fsync would only cost time.
        write_json_atomic(self._state_path, self._dump(), durable=False)

    def _commit(self) -> None:
        """Persist after a mutation, before the call returns."""
        self._save()
        self._commits += 1
        if self._commits == self._crash_after_commits:
            # Fault injection for crash tests: the process dies right after the GPU changed,
            # before the caller learns of it (a kill -9 or power loss at the worst moment).
            os.kill(os.getpid(), signal.SIGKILL)

    def sim_fail_mig_call(self, after: int) -> None:
        """Fault injection: the after-th MIG-changing call from now fails with NVML_ERROR_UNKNOWN."""
        self.fail_mig_call = self._mig_calls + after

    def _fault_point(self) -> None:
        """Called first by every MIG-changing call: fails the one a failure test chose."""
        self._mig_calls += 1
        if self._mig_calls == self.fail_mig_call:
            raise NVMLError(NVML_ERROR_UNKNOWN)

    def sim_fail_calls(self, prefix: str, error: int, count: int) -> None:
        """Fault injection: the next `count` NVML calls whose name starts with `prefix` raise
        NVMLError(error) before doing anything; later ones work again (a transient fault that heals).
        `prefix` picks a call class: "nvmlInit" (nvmlInit and nvmlInitWithFlags), "nvmlDevice" (device
        reads and MIG mode), "nvmlDeviceGetTemperature" (one reading), "nvmlGpuInstance" (MIG
        changes), "nvmlEventSet" (events)... One fault per prefix: a second call replaces it, count 0
        removes it. Works whether or not NVML is initialised here (an init fault is set before init)."""
        if not isinstance(prefix, str) or not prefix.startswith("nvml"):
            raise SimError(f"prefix must start an NVML function name (nvml...), got {prefix!r}")
        if not isinstance(error, int) or isinstance(error, bool) or error <= 0:
            raise SimError(f"error must be an NVML error code (a positive integer), got {error!r}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise SimError(f"count must be a non-negative integer, got {count!r}")
        with self._lock:
            if count:
                self._failing_calls[prefix] = [error, count]
            else:
                self._failing_calls.pop(prefix, None)

    def _injected_failure(self, name: str) -> None:
        """Raises the error `sim_fail_calls` chose for this call, counting it; called under the lock."""
        for prefix, fault in self._failing_calls.items():
            if name.startswith(prefix):
                error, fault[1] = fault[0], fault[1] - 1
                if not fault[1]:
                    del self._failing_calls[prefix]
                raise NVMLError(error)

    def _next_serial(self) -> int:
        return next(self._serials) & SERIAL_MASK

    def _publish(self, event: Event) -> None:
        for event_set in self._event_sets.values():
            if event_set.accepts(event):
                event_set.pending.append(event)
        self._event_signal.notify_all()

    # --- handles out ----------------------------------------------------------------------------

    @staticmethod
    def _gpu_handle(gpu: Gpu):
        return make_handle(HandleRef(Kind.GPU, gpu.index))

    @staticmethod
    def _mig_handle(gpu: Gpu, gi: GpuInstance, ci: ComputeInstance):
        return make_handle(HandleRef(Kind.MIG_DEVICE, gpu.index, gi.id, ci.id, ci.serial))

    @staticmethod
    def _gpu_instance_handle(gpu: Gpu, gi: GpuInstance):
        return make_handle(HandleRef(Kind.GPU_INSTANCE, gpu.index, gi.id, 0, gi.serial))

    @staticmethod
    def _compute_instance_handle(gpu: Gpu, gi: GpuInstance, ci: ComputeInstance):
        return make_handle(HandleRef(Kind.COMPUTE_INSTANCE, gpu.index, gi.id, ci.id, ci.serial))

    # --- handles in -----------------------------------------------------------------------------
    # Not a simulator handle of the expected kind -> INVALID_ARGUMENT. A GI, CI or MIG device
    # that has been destroyed since the handle was made -> NOT_FOUND (the code the *ById calls
    # give for it too). Anything on a lost GPU through a handle obtained before -> GPU_IS_LOST (what
    # long-running NVML clients see: leptonai/gpud#604; NVIDIA/k8s-dra-driver-gpu's event loop,
    # cmd/gpu-kubelet-plugin/device_health.go).

    def _ref(self, handle: object, *kinds: Kind) -> HandleRef:
        ref = decode(handle)
        if ref is None or ref.kind not in kinds or ref.gpu >= len(self._gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return ref

    def _reachable(self, gpu: Gpu) -> Gpu:
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return gpu

    @staticmethod
    def _found(gpu: Gpu) -> Gpu:
        """A GPU a handle lookup (by index, UUID or bus id) found: a lost one fails the lookup with
        UNKNOWN or GPU_IS_LOST, as it lost itself (sim_set_gpu_lost `how`)."""
        if gpu.lost:
            raise NVMLError(NVML_ERROR_UNKNOWN if gpu.lost == "unknown" else NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _gpu_at(self, index: int) -> Gpu:
        if not isinstance(index, int) or not 0 <= index < len(self._gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._found(self._gpus[index])

    def _device(self, handle: object) -> tuple[Gpu, MigDevice | None]:
        """The GPU of a GPU or MIG device handle, and the MIG device if it is one."""
        ref = self._ref(handle, Kind.GPU, Kind.MIG_DEVICE)
        gpu = self._reachable(self._gpus[ref.gpu])
        if ref.kind is Kind.GPU:
            return gpu, None
        return gpu, self._live_mig_device(gpu, ref)

    def _gpu(self, handle: object, on_mig_handle: int = NVML_ERROR_NOT_SUPPORTED) -> Gpu:
        """The GPU of a whole-GPU handle; a MIG device handle raises `on_mig_handle`."""
        gpu, mig_device = self._device(handle)
        if mig_device is not None:
            raise NVMLError(on_mig_handle)
        return gpu

    def _gpu_instance(self, handle: object) -> tuple[Gpu, GpuInstance]:
        ref = self._ref(handle, Kind.GPU_INSTANCE)
        gpu = self._reachable(self._gpus[ref.gpu])
        gi = gpu.gpu_instances.get(ref.gpu_instance)
        if gi is None or gi.serial != ref.serial:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return gpu, gi

    def _compute_instance(self, handle: object) -> tuple[Gpu, MigDevice]:
        ref = self._ref(handle, Kind.COMPUTE_INSTANCE)
        gpu = self._reachable(self._gpus[ref.gpu])
        return gpu, self._live_mig_device(gpu, ref)

    def _gi_memory_mb(self, gpu: Gpu, gi: GpuInstance) -> int:
        """A GPU instance's memory as the running driver sizes its profile (it changes by driver: models.yaml)."""
        return gpu.model.mig.memory_mb(gi.profile, self._driver.version_tuple)

    @staticmethod
    def _live_mig_device(gpu: Gpu, ref: HandleRef) -> MigDevice:
        gi = gpu.gpu_instances.get(ref.gpu_instance)
        ci = gi.compute_instances.get(ref.compute_instance) if gi else None
        if ci is None or ci.serial != ref.serial:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return MigDevice(gi, ci)

    def _event_set(self, handle: object) -> EventSet:
        ref = decode(handle)
        event_set = self._event_sets.get(ref.serial) if ref and ref.kind is Kind.EVENT_SET else None
        if event_set is None:  # never created, or freed already
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return event_set
