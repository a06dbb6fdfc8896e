"""The part of sysfs gpud reads about a simulated GPU: its PCI device's numa_node.

The kernel publishes /sys/bus/pci/devices/<domain:bus:device.function>/numa_node for every PCI device
(Documentation/ABI/testing/sysfs-bus-pci: "the NUMA node to which this device is attached, or -1 if the
node is unknown"). The simulator writes the same files under its own root, so gpud's reader takes the
path it takes on a real machine.

The simulated GPUs sit on this real host, so the CPUs local to one are the host's own: read from the
host's sysfs (local_cpus below).
"""

from __future__ import annotations

from pathlib import Path

from .identity import pci_bus_id_legacy

UNKNOWN_NODE = -1


def write_numa_nodes(root: Path, buses: list[int], numa_nodes: tuple[int, ...] | None) -> None:
    """Writes only what differs: a node staged by one user (root) is opened by another (a reader), who
    may not write there, as nobody may write the real sysfs."""
    for index, bus in enumerate(buses):
        path = root / "bus" / "pci" / "devices" / pci_bus_id_legacy(bus).lower() / "numa_node"
        text = f"{numa_nodes[index] if numa_nodes is not None else UNKNOWN_NODE}\n"
        try:
            if path.read_text() == text:
                continue
        except OSError:  # not there yet
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def local_cpus(host_sysfs: Path, numa_node: int) -> tuple[int, ...]:
    """The CPUs local to a PCI device on `numa_node` of this host, as the kernel gives them in the device's
    local_cpulist (drivers/pci/pci-sysfs.c local_cpus_show): cpumask_of_node(dev_to_node(dev)), which is
    node<N>/cpulist (drivers/base/node.c node_read_cpumap), and cpu_online_mask for NUMA_NO_NODE (-1).
    A node this host lacks (a simulated 2-socket board on a 1-node machine) gets the online CPUs too."""
    node_cpus = host_sysfs / "devices" / "system" / "node" / f"node{numa_node}" / "cpulist"
    if numa_node != UNKNOWN_NODE:
        try:
            return parse_cpulist(node_cpus.read_text())
        except FileNotFoundError:
            pass
    try:
        return parse_cpulist((host_sysfs / "devices" / "system" / "cpu" / "online").read_text())
    except OSError:
        return ()


def parse_cpulist(text: str) -> tuple[int, ...]:
    """CPU ids of a Linux cpulist, "0-3,8,10-11" (lib/bitmap-str.c bitmap_parselist); "" is none."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    return tuple(sorted(set(cpus)))
