"""Each GPU's and MIG device's health, gpud's suggested action for each GPU, and whether NVML reports
the GPU lost."""

from __future__ import annotations

from typing import Iterator

from gpud.base.samples import Family
from gpud.health.collectors import LabelledGpus
from gpud.health.states import ACTION_RANK, HEALTH_RANK, Health
from gpud.health.tracker import HealthTracker
from gpud.model.dcgm_labels import instance_labels

# One series per GPU, its action a label (as gpud_gpu_recovery_action), valued by rank so that
# `>= 3` reads "a reset or more".
SUGGESTED_ACTION_HELP = ("gpud's suggested action for the GPU (/v1/health's suggested_action), by rank: " +
                         ", ".join(f"{rank} {action.value}" for rank, action in enumerate(ACTION_RANK)) + ".")


def collect(gpus: LabelledGpus, tracker: HealthTracker) -> Iterator[Family]:
    states = tracker.gpu_states()
    health = Family("gpud_gpu_health", "Device health: 0 healthy, 1 degraded, 2 unhealthy.", "gauge")
    for gpu, labels in gpus:
        health.add(labels, HEALTH_RANK.get(states.get(gpu.uuid, Health.HEALTHY), 2))
        for dev in gpu.mig.devices:
            mig_labels = {**instance_labels(labels, gpu, dev), "mig_uuid": dev.uuid}
            health.add(mig_labels, HEALTH_RANK.get(states.get(dev.uuid, Health.HEALTHY), 2))
    yield health
    action = Family("gpud_gpu_suggested_action", SUGGESTED_ACTION_HELP, "gauge")
    for gpu, labels in gpus:
        suggested = tracker.action_for(gpu.uuid)
        action.add({**labels, "action": str(suggested)}, ACTION_RANK.index(suggested))
    yield action
    lost = Family("gpud_gpu_lost", "1 when NVML reports the GPU lost.", "gauge")
    for gpu, labels in gpus:
        lost.add(labels, 1 if gpu.lost else 0)
    yield lost
