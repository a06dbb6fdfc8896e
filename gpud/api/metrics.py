"""GET /metrics: Prometheus text, with dcgm-exporter's metric and label names where they exist,
so existing dashboards and alerts keep working; gpud's own state as gpud_* metrics.

The samples come from collectors (health, MIG, MPS, request latency), each offering `collect()`.
As in node_exporter, one collector that fails does not fail the scrape: its samples are left
out, the log says why, and gpud_collector_errors_total counts it.

The Kubernetes labels (pod, namespace, container, dra_*: gpud/pod_resources/labels.py) are added as the
text is written: each series of an allocated GPU or MIG instance is written once per container holding it.

The text is rendered once and served from a cache until the collectors' data changes (the daemon
says what changes it: the event bus's sequence, the latest readings) or MAX_AGE_S passes, so a
reader asking for it in a loop costs a copy, not a render: a render of 56 MIG devices is 3-5 ms
of the one event loop. Prometheus samples every 15 s or more; a value at most MAX_AGE_S old is
what it would have read between two collections anyway.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Mapping, Protocol

from aiohttp import web

from gpud.base.logs import get_logger
from gpud.base.samples import Family

log = get_logger("metrics")
MAX_AGE_S = 1.0
# Labels that name a local user's process. The TCP listener leaves out every series carrying one
# (unless metrics.listen_process_series): its peers are not authenticated (docs/security.md).
PROCESS_LABELS = frozenset({"pid"})
# (GPU UUID, GPU_I_ID or None) -> the label sets of the containers holding it (gpud.pod_resources.labels)
PodLabels = Mapping[tuple[str, "str | None"], tuple[dict[str, str], ...]]


class Collector(Protocol):
    def collect(self) -> Iterable[Family]: ...


class MetricsRoute:
    def __init__(self, collectors: Callable[[], Mapping[str, Collector]], changes: Callable[[], object] = lambda: None,
                 max_age_s: float = MAX_AGE_S, pod_labels: Callable[[], PodLabels] = dict):
        self.collectors = collectors  # name (the label of its errors) -> collector, in the order written
        self.errors: dict[str, int] = {}
        self._said_left_out: set[tuple[str, str]] = set()
        self.changes = changes  # a value that differs whenever the collectors' data may have changed
        self.max_age_s = max_age_s
        self.pod_labels = pod_labels  # read once per render
        self.renders = 0  # how many times the collectors were read (the cache's misses)
        self._cached: dict[tuple[bool, bool], tuple[object, float, bytes]] = {}  # (processes, pods) -> (changes, at, text)

    def register(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.get)

    async def get(self, request: web.Request) -> web.Response:
        return self.response(self.text(with_processes=True, with_pods=True))

    @staticmethod
    def response(text: bytes) -> web.Response:
        return web.Response(body=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    def text(self, with_processes: bool, with_pods: bool) -> bytes:
        """The rendered text, from the cache while it is fresh. Handlers run on the one event loop
        and a render never awaits, so requests arriving together share the first one's render."""
        changes, now = self.changes(), time.monotonic()
        cached = self._cached.get((with_processes, with_pods))
        if cached is not None and cached[0] == changes and now - cached[1] < self.max_age_s:
            return cached[2]
        text = self.render(with_processes, with_pods).encode()
        self._cached[(with_processes, with_pods)] = (changes, now, text)
        return text

    def render(self, with_processes: bool = True, with_pods: bool = True) -> str:
        self.renders += 1
        lines: list[str] = []
        pods = self.pod_labels() if with_pods else {}
        collectors = self.collectors()
        # A family several collectors write (each file gpud keeps says whether it is written) is written
        # once, where it first comes: the text format allows one TYPE line, and the samples of a family
        # together (https://prometheus.io/docs/instrumenting/exposition_formats/).
        families: dict[str, Family] = {}
        for name, collector in collectors.items():
            try:
                collected = list(collector.collect())
            except Exception as exc:  # a bug or a state mid-change: the other collectors still answer
                self.errors[name] = self.errors.get(name, 0) + 1
                log.error("metrics_collector_failed", collector=name, error=f"{type(exc).__name__}: {exc}")
                continue
            for family in collected:
                samples = [sample for sample in family.samples if _renderable(sample.value)]
                if len(samples) < len(family.samples):
                    self._left_out(name, family, samples)
                if family.name in families:
                    families[family.name].samples.extend(samples)
                else:
                    families[family.name] = Family(family.name, family.help, family.kind, samples)
        for family in families.values():
            _write(lines, family, with_processes, pods)
        errors = Family("gpud_collector_errors_total",
                        "Renders of /metrics (each shared by the scrapes while it is fresh) that left a "
                        "collector's samples out: it failed.", "counter")
        for name in collectors:
            errors.add({"collector": name}, self.errors.get(name, 0))
        _write(lines, errors, with_processes, {})
        return "\n".join(lines) + "\n"

    def _left_out(self, collector: str, family: Family, kept: list) -> None:
        """A sample whose value is no number Prometheus takes (a bug, or a host file gone wrong) is left
        out, and its collector counted as failed: one bad value never breaks the scrape
        (node_exporter's rule: a collector's error fails that collector only)."""
        self.errors[collector] = self.errors.get(collector, 0) + 1
        bad = next(sample for sample in family.samples if not _renderable(sample.value))
        if (collector, family.name) not in self._said_left_out:
            self._said_left_out.add((collector, family.name))
            log.error("metrics_sample_left_out", collector=collector, family=family.name,
                      samples=len(family.samples) - len(kept), value=repr(bad.value)[:80],
                      why="not a number the text format can carry")


def _renderable(value: object) -> bool:
    """A float, or an int a float can hold (a counter read from a file can be any length of digits)."""
    if not isinstance(value, (int, float)):  # bool is an int
        return False
    return isinstance(value, float) or abs(value) < 2 ** 1023


def _write(lines: list[str], family: Family, with_processes: bool, pods: PodLabels) -> None:
    lines += [f"# HELP {family.name} {family.help}", f"# TYPE {family.name} {family.kind}"]
    for sample in family.samples:
        if not with_processes and not PROCESS_LABELS.isdisjoint(sample.labels):
            continue
        for labels in _with_pods(sample.labels, pods):
            rendered = ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items())
            lines.append(f"{sample.name}{{{rendered}}} {_number(sample.value)}")


def _with_pods(labels: dict[str, str], pods: PodLabels) -> list[dict[str, str]]:
    """A series of a GPU (`UUID`) or MIG instance (`UUID`, `GPU_I_ID`) a container holds: one copy per
    container, with its labels (dcgm-exporter's PodMapper.Process); any other as it is. A process's series
    (`pid`) names its own container already: it is not copied for the others sharing its GPU."""
    uuid = labels.get("UUID")
    held = pods.get((uuid, labels.get("GPU_I_ID"))) if uuid is not None and PROCESS_LABELS.isdisjoint(labels) else None
    return [{**labels, **pod} for pod in held] if held else [labels]


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
