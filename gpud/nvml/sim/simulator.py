"""SimulatedNvml: an object that stands in for the pynvml module on a machine without GPUs."""

from __future__ import annotations

import pynvml
from pynvml import NVML_ERROR_FUNCTION_NOT_FOUND, NVMLError

from ._controls import SimControls
from ._device_calls import DeviceCalls
from ._event_calls import EventCalls
from ._fabric_calls import FabricCalls
from ._gpm_calls import GpmCalls
from ._mig_calls import MigCalls
from ._process_calls import ProcessCalls
from ._telemetry_calls import TelemetryCalls

# pynvml functions that are pure Python helpers, not wrappers of the C library.
_PYNVML_HELPERS = frozenset(
    {"nvmlExceptionClass", "nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct"}
)


def _not_simulated(name: str):
    def call(*args, **kwargs):
        # What pynvml raises when the loaded driver lacks the symbol.
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)

    call.__name__ = name
    return call


class SimulatedNvml(DeviceCalls, MigCalls, EventCalls, ProcessCalls, TelemetryCalls, FabricCalls, GpmCalls,
                    SimControls):
    """A simulated NVML with the pynvml module's surface.

    Use it where code would use `pynvml`: same function names, arguments and return shapes,
    pynvml's own structs, constants and NVMLError subclasses. Anything the simulator does not
    define is looked up on pynvml (constants, struct and error classes); pynvml functions that
    would call into libnvidia-ml raise NVMLError_FunctionNotFound instead.

    `SimulatedNvml(preset, state_path, driver=None)` touches nothing. `driver` is the NVIDIA
    driver version the node runs ("535.183.01", "580.65.06"...; default models.yaml's
    drivers.default, "550.90.07"): it sets the version strings and what NVML answers by branch
    (R535, R550, R580: models.yaml `drivers`), and functions a branch lacks raise
    NVMLError_FunctionNotFound. `nvmlInit()` loads the machine state from `state_path` (or creates
    it there) and every mutation rewrites that JSON file atomically before returning, so a later or
    concurrent instance on the same file sees it. The state is read at the first nvmlInit only;
    changes another instance makes afterwards are seen after nvmlShutdown + nvmlInit.

    The `sim_*` methods drive the world outside this process's NVML session (other processes
    holding or computing on GPUs, faults, `nvidia-smi -r`, Fabric Manager); they are not part of
    the pynvml surface and work whether or not NVML is initialised here. Another SimulatedNvml on
    the same state file is invisible to them: model another NVML client with `sim_add_holder`.

    Handles are pynvml's pointer types (so they fit in pynvml's structs) that compare and hash
    by what they refer to. Errors for bad handles: not a simulator handle of the right kind ->
    NVMLError_InvalidArgument; a GI, CI or MIG device destroyed since -> NVMLError_NotFound;
    anything on a lost GPU -> NVMLError_GpuIsLost, while looking a lost GPU up answers as
    `sim_set_gpu_lost` chose (NVMLError_Unknown by default). Whole-GPU queries (PCI, power,
    temperature, ECC, compute mode, ...) raise NVMLError_NotSupported for MIG device handles.
    Privileged calls read os.geteuid() at call time and raise NVMLError_NoPermission for non-root.
    """

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(pynvml, name)
        if name.startswith("nvml") and callable(value) and not isinstance(value, type):
            return value if name in _PYNVML_HELPERS else _not_simulated(name)
        return value
