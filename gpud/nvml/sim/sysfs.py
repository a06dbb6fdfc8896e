"""The part of sysfs gpud reads about a simulated GPU: its PCI device's numa_node.

The kernel publishes /sys/bus/pci/devices/<domain:bus:device.function>/numa_node for every PCI device
(Documentation/ABI/testing/sysfs-bus-pci: "the NUMA node to which this device is attached, or -1 if the
node is unknown"). The simulator writes the same files under its own root, so gpud's reader takes the
path it takes on a real machine.
"""

from __future__ import annotations

from pathlib import Path

from .identity import pci_bus_id_legacy

UNKNOWN_NODE = -1


def write_numa_nodes(root: Path, buses: list[int], numa_nodes: tuple[int, ...] | None) -> None:
    for index, bus in enumerate(buses):
        device = root / "bus" / "pci" / "devices" / pci_bus_id_legacy(bus).lower()
        device.mkdir(parents=True, exist_ok=True)
        node = numa_nodes[index] if numa_nodes is not None else UNKNOWN_NODE
        (device / "numa_node").write_text(f"{node}\n")
