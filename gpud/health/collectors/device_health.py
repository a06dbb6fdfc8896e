"""Each GPU's and MIG device's health, and whether NVML reports the GPU lost."""

from __future__ import annotations

from typing import Iterator

from gpud.base.samples import Family
from gpud.health.collectors import LabelledGpus
from gpud.health.states import HEALTH_RANK, Health
from gpud.health.tracker import HealthTracker
from gpud.model.dcgm_labels import instance_labels


def collect(gpus: LabelledGpus, tracker: HealthTracker) -> Iterator[Family]:
    states = tracker.gpu_states()
    health = Family("gpud_gpu_health", "Device health: 0 healthy, 1 degraded, 2 unhealthy.", "gauge")
    for gpu, labels in gpus:
        health.add(labels, HEALTH_RANK.get(states.get(gpu.uuid, Health.HEALTHY), 2))
        for dev in gpu.mig.devices:
            mig_labels = {**instance_labels(labels, gpu, dev), "mig_uuid": dev.uuid}
            health.add(mig_labels, HEALTH_RANK.get(states.get(dev.uuid, Health.HEALTHY), 2))
    yield health
    lost = Family("gpud_gpu_lost", "1 when NVML reports the GPU lost.", "gauge")
    for gpu, labels in gpus:
        lost.add(labels, 1 if gpu.lost else 0)
    yield lost
