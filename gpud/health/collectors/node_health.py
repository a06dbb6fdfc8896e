"""What is no GPU: the node's and InfiniBand ports' health, XIDs by source, the driver's versions, and
the ports themselves."""

from __future__ import annotations

from typing import Iterator

from gpud.base.samples import Family
from gpud.health.collectors import infiniband
from gpud.health.sources.node_checks import NodeChecks
from gpud.health.states import HEALTH_RANK
from gpud.health.tracker import HealthTracker
from gpud.health.xid_counter import XidCounter


def collect(tracker: HealthTracker, xids: XidCounter, checks: NodeChecks) -> Iterator[Family]:
    health = Family("gpud_health", "The health of what is no GPU: the node, InfiniBand ports (0 healthy, "
                                   "1 degraded, 2 unhealthy).", "gauge")
    for subject, state in sorted(tracker.subject_states().items()):
        health.add({"subject": subject}, HEALTH_RANK.get(state, 2))
    yield health
    sources = Family("gpud_xids_by_source_total", "XIDs counted, by who reported them: nvml, kernel-log, "
                                                  "or both (counted once).", "counter")
    for source, count in xids.by_source.items():
        sources.add({"source": source}, count)
    yield sources
    versions = checks.driver_versions
    if versions["kernel_module"] or versions["library"]:
        info = Family("gpud_driver_info", "The NVIDIA kernel module's and NVML library's versions (they "
                                          "differ after an unfinished driver upgrade).", "gauge")
        info.add({"kernel_module": versions["kernel_module"] or "", "library": versions["library"] or ""}, 1)
        yield info
    yield from infiniband.collect(checks.ib_ports)
