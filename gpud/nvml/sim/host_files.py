"""The files a driver puts on a host, made for a simulated node before the CDI spec is built from them: the
MIG minors table, the device nodes and (cdi.driver_files) the driver's libraries and binaries."""

from __future__ import annotations

from pathlib import Path

from gpud.base.lifecycle import Component, Tasks
from gpud.nvml.sim.device_nodes import write_device_nodes
from gpud.nvml.sim.driver_tree import write_driver_tree
from gpud.nvml.sim.mig_minors import write_mig_minors


class SimulatedHostFiles(Component):
    """dev_root, driver_root: None where the host's own are used (cdi.dev_root, cdi.driver_root set, or
    cdi.driver_files off)."""

    name = "simulated-host-files"

    def __init__(self, preset: str, mig_minors_path: Path, dev_root: Path | None, driver_root: Path | None,
                 driver: str | None):
        self.preset, self.mig_minors_path, self.driver = preset, mig_minors_path, driver
        self.dev_root, self.driver_root = dev_root, driver_root

    async def start(self, tasks: Tasks) -> None:
        write_mig_minors(self.mig_minors_path)
        if self.dev_root is not None:
            write_device_nodes(self.dev_root, self.preset)
        if self.driver_root is not None:
            write_driver_tree(self.driver_root, self.driver)
