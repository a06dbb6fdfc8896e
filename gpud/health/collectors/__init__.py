"""Health's metrics, one collector per module as node_exporter keeps them (collector/<name>.go): each
module's collect() yields its families, for the GPUs as dcgm-exporter labels them."""

from __future__ import annotations

from gpud.base.samples import Family
from gpud.model.inventory import Gpu

LabelledGpus = list[tuple[Gpu, dict[str, str]]]  # each GPU with dcgm-exporter's labels of it


def add_known(family: Family, labels: dict[str, str], value: float | None) -> None:
    """Adds the sample where there is a value: a reading the GPU does not have is no sample."""
    if value is not None:
        family.add(labels, float(value))
