"""Metric samples as gpud's parts report them through their `collect()`; GET /metrics writes them
out in Prometheus's text format (gpud/api/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    name: str  # the family's name, or a histogram's name with _bucket, _sum or _count
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Family:
    name: str
    help: str
    kind: str  # "gauge", "counter" or "histogram"
    samples: list[Sample] = field(default_factory=list)

    def add(self, labels: dict[str, str], value: float, name: str | None = None) -> None:
        self.samples.append(Sample(name or self.name, labels, value))
