"""GET /metrics: Prometheus text, with dcgm-exporter's metric and label names where they exist,
so existing dashboards and alerts keep working; gpud's own state as gpud_* metrics.

The samples come from collectors (health, MIG, MPS, request latency), each offering `collect()`.
As in node_exporter, one collector that fails does not fail the scrape: its samples are left
out, the log says why, and gpud_collector_errors_total counts it.
"""

from __future__ import annotations

import math
from typing import Iterable, Protocol

from aiohttp import web

from gpud.logs import get_logger
from gpud.samples import Family

log = get_logger("metrics")


class Collector(Protocol):
    def collect(self) -> Iterable[Family]: ...


class MetricsRoute:
    def __init__(self, collectors: dict[str, Collector]):
        self.collectors = collectors  # name (the label of its errors) -> collector, in the order written
        self.errors = dict.fromkeys(collectors, 0)

    def register(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.get)

    async def get(self, request: web.Request) -> web.Response:
        return web.Response(text=self.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    def render(self) -> str:
        lines: list[str] = []
        for name, collector in self.collectors.items():
            try:
                families = list(collector.collect())
            except Exception as exc:  # a bug or a state mid-change: the other collectors still answer
                self.errors[name] += 1
                log.error("metrics_collector_failed", collector=name, error=f"{type(exc).__name__}: {exc}")
                continue
            for family in families:
                _write(lines, family)
        errors = Family("gpud_collector_errors_total", "Scrapes that left a collector's samples out: it failed.",
                        "counter")
        for name, count in self.errors.items():
            errors.add({"collector": name}, count)
        _write(lines, errors)
        return "\n".join(lines) + "\n"


def _write(lines: list[str], family: Family) -> None:
    lines += [f"# HELP {family.name} {family.help}", f"# TYPE {family.name} {family.kind}"]
    for sample in family.samples:
        rendered = ",".join(f'{key}="{_escape(value)}"' for key, value in sample.labels.items())
        lines.append(f"{sample.name}{{{rendered}}} {_number(sample.value)}")


def _number(value: float) -> str:
    """Every digit: a counter such as the energy in mJ since boot (1e9 and more) must grow visibly
    between scrapes, which six significant digits ("%g") would hide."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2 ** 53:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
