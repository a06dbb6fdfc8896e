"""The node's own checks, which need no NVML and so run while NVML is down too: the driver's kernel
module against its library, Fabric Manager on a node with NVSwitches, its InfiniBand ports and
GPUDirect RDMA (gpud.health.node and gpud.health.infiniband say what each means)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gpud.config import HealthConfig
from gpud.health import infiniband, node
from gpud.health.reasons import Change
from gpud.health.states import Action, Health
from gpud.health.tracker import NODE, HealthTracker
from gpud.nvml.session import NvmlSession

FABRIC_MANAGER_EVERY_S = 30.0  # systemctl is asked at most this often
# A port reading takes milliseconds: every file is read non-blocking (gpud.base.hostfile). One that
# still has not finished by then (a hung filesystem under host.sysfs) is reported, and waited on
# rather than started again beside itself.
IB_READ_DEADLINE_S = 10.0


class NodeChecks:
    def __init__(self, session: NvmlSession, tracker: HealthTracker, settings: HealthConfig, *, procfs: Path,
                 sysfs: Path):
        self.session = session
        self._tracker = tracker
        self.settings = settings
        self._procfs, self._sysfs = procfs, sysfs
        self.ib_ports: list[infiniband.IbPort] = []
        self._ib = infiniband.IbHealth()
        self._ib_reading: asyncio.Future | None = None
        self._ib_reading_since = 0.0
        self.stuck: str | None = None  # a reading that has not finished, for /healthz
        self._fabric_manager_checked = 0.0
        self.driver_versions: dict[str, str | None] = {"kernel_module": None, "library": None}

    async def check(self) -> list[Change]:
        module = await asyncio.to_thread(node.module_version, self._procfs)
        # the library gpud mapped stays what it is while gpud runs: read until found
        library = self.driver_versions["library"] or await asyncio.to_thread(node.library_version, self.session.nvml)
        self.driver_versions = {"kernel_module": module, "library": library}
        changes = self._tracker.observe(NODE, "driver", "mismatch", node.driver_mismatch(module, library))
        if time.monotonic() - self._fabric_manager_checked >= FABRIC_MANAGER_EVERY_S:
            self._fabric_manager_checked = time.monotonic()
            changes += self._tracker.observe(NODE, "fabric-manager", "not-running", await self._fabric_manager())
        if self.settings.infiniband:
            changes += await self._check_infiniband()
        return changes

    async def _check_infiniband(self) -> list[Change]:
        if self._ib_reading is None:
            self._ib_reading = asyncio.ensure_future(asyncio.to_thread(infiniband.read_ports, self._sysfs))
            self._ib_reading_since = time.monotonic()
        # this pass's reading, held here: a check_node_once() beside the loop's pass waits on the same one,
        # and whichever ends first clears self._ib_reading
        reading = self._ib_reading
        left = self._ib_reading_since + IB_READ_DEADLINE_S - time.monotonic()
        done, _ = await asyncio.wait({reading}, timeout=max(left, 0.0))
        if not done:  # said on node and in /healthz: a check that cannot finish is not hidden
            self.stuck = (f"reading the InfiniBand ports under {self._sysfs / 'class' / 'infiniband'} has not "
                          f"finished in {time.monotonic() - self._ib_reading_since:.0f} s: their health is "
                          "unknown; look for a hung filesystem or a FIFO mounted there")
            return self._tracker.observe(NODE, "infiniband", "read-stuck",
                                         (Health.DEGRADED, Action.INSPECT_HARDWARE, self.stuck))
        if self._ib_reading is reading:
            self._ib_reading, self.stuck = None, None
        self.ib_ports = reading.result()
        changes = self._tracker.observe(NODE, "infiniband", "read-stuck", None)
        changes += self._tracker.set_subjects("ib:", [port.subject for port in self.ib_ports])
        for subject, problems in self._ib.check(self.ib_ports).items():
            for (kind, code), problem in problems.items():
                changes += self._tracker.observe(subject, kind, code, problem)
        if self.settings.peermem:
            missing = await asyncio.to_thread(infiniband.peermem_problem, self._procfs, self.ib_ports)
            changes += self._tracker.observe(NODE, "rdma", "peermem",
                                             (Health.DEGRADED, Action.FIX_SERVICE, missing) if missing else None)
        return changes

    async def _fabric_manager(self) -> tuple[str, str, str] | None:
        """Fabric Manager's unit, where this node has NVSwitches of its own."""
        if not await asyncio.to_thread(node.local_nvswitches, self._procfs):
            return None
        unit = self.settings.fabric_manager_unit
        nvml = self.session.nvml
        if hasattr(nvml, "sim_fabric_manager_running"):  # the simulated node's service
            running = nvml.sim_fabric_manager_running()
            properties = {"LoadState": "loaded", "ActiveState": "active" if running else "inactive",
                          "SubState": "running" if running else "dead"}
        else:
            properties = await asyncio.to_thread(node.fabric_manager_unit, unit)
        return node.fabric_manager_problem(unit, properties)
