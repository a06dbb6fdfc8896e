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
