"""Recovery: the driver's recovery action, each GPU's NVLink fabric, and health.auto_reset's attempts."""

from __future__ import annotations

from typing import Iterator

from gpud.base.samples import Family
from gpud.health.auto_reset import AutoReset
from gpud.health.collectors import LabelledGpus, add_known
from gpud.health.driver_actions import DRIVER_ACTIONS
from gpud.health.tracker import HealthTracker
from gpud.nvml.health import Readings

_CODES = {name: code for code, name in DRIVER_ACTIONS.items()}


def collect(gpus: LabelledGpus, tracker: HealthTracker, readings: dict[str, Readings | None],
            auto_reset: AutoReset) -> Iterator[Family]:
    action = Family("gpud_gpu_recovery_action", "The driver's recovery action (NVML_GPU_RECOVERY_ACTION_*: "
                                                "0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and "
                                                "reset), where the driver reports it.", "gauge")
    for gpu, labels in gpus:
        name = tracker.driver_action(gpu.uuid)
        if name in _CODES:
            action.add({**labels, "action": name}, _CODES[name])
    yield action
    fabric_state = Family("gpud_gpu_fabric_state", "The GPU's NVLink fabric state (1 not started, 2 in "
                                                   "progress, 3 completed), on NVSwitch systems.", "gauge")
    fabric_mask = Family("gpud_gpu_fabric_health_mask", "The GPU's NVLink fabric health mask (nvml.h "
                                                        "NVML_GPU_FABRIC_HEALTH_MASK_*).", "gauge")
    for gpu, labels in gpus:
        fabric = getattr(readings.get(gpu.uuid), "fabric", None)
        if fabric is not None:
            fabric_state.add(labels, fabric.state)
            add_known(fabric_mask, labels, fabric.health_mask)
    yield fabric_state
    yield fabric_mask
    resets = Family("gpud_gpu_auto_resets_total", "GPU resets health.auto_reset tried, by result.", "counter")
    for result, count in sorted(auto_reset.results.items()):
        resets.add({"result": result}, count)
    yield resets
