"""Slurm's logical core indexes of the host's CPUs, for gres.conf's Cores=.

gres.conf(5), Cores: "a logical core index must be specified instead of the physical core index ...
Core 0 will be the first core on the first socket, while core 1 will be the second core on the first
socket. This numbering coincides with the logical core number (Core L#) seen in lstopo -l". A core is
a (physical_package_id, core_id) pair of the kernel's topology; cores are numbered socket by socket
(by package id), within a socket by their lowest CPU id, as hwloc orders them."""

from __future__ import annotations

from pathlib import Path

from gpud.base.hostfile import read_host_text
from gpud.model.inventory import format_cpulist


def read_core_indexes(sysfs: Path) -> dict[int, int]:
    """OS CPU id -> Slurm's logical core index, from <sysfs>/devices/system/cpu/cpu<N>/topology.
    An offline CPU has no topology directory: it counts nothing, as hwloc leaves it out."""
    core_of_cpu: dict[int, tuple[int, int]] = {}
    for entry in (sysfs / "devices" / "system" / "cpu").glob("cpu[0-9]*"):
        try:
            cpu = int(entry.name[3:])
            core_of_cpu[cpu] = (int(read_host_text(entry / "topology" / "physical_package_id")),
                                int(read_host_text(entry / "topology" / "core_id")))
        except (OSError, ValueError):
            continue
    first_cpu: dict[tuple[int, int], int] = {}
    for cpu, core in sorted(core_of_cpu.items()):
        first_cpu.setdefault(core, cpu)
    ordered = sorted(first_cpu, key=lambda core: (core[0], first_cpu[core]))
    index = {core: n for n, core in enumerate(ordered)}
    return {cpu: index[core] for cpu, core in core_of_cpu.items()}


class CoreIndex:
    """Maps a GPU's CPU affinity (OS CPU ids) to its Cores= value. The topology is read once: CPUs
    come and go only by hotplug, and every inventory refresh would otherwise re-read two files per CPU."""

    def __init__(self, sysfs: Path):
        self.core_of_cpu = read_core_indexes(sysfs)
        self._all_cores = set(self.core_of_cpu.values())

    def __call__(self, cpus: tuple[int, ...]) -> str | None:
        """None where there is nothing to say: the affinity unknown, or every core of the host."""
        cores = {self.core_of_cpu[cpu] for cpu in cpus if cpu in self.core_of_cpu}
        if not cores or cores == self._all_cores:
            return None
        return format_cpulist(sorted(cores))  # Cores= takes the same list form: "0-2,5,7-8"
