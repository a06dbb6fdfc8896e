"""The part of sysfs gpud reads about a simulated GPU: its PCI device's numa_node, vendor, class and
config space.

The kernel publishes /sys/bus/pci/devices/<domain:bus:device.function>/ for every PCI device
(Documentation/ABI/testing/sysfs-bus-pci): `numa_node` ("the NUMA node to which this device is attached,
or -1 if the node is unknown"), `vendor`, `device` and `class` as hexadecimal numbers, and `config`, the
device's configuration space (drivers/pci/pci-sysfs.c). The simulator writes the same files under its own
root, so gpud's readers take the path they take on a real machine, and NVIDIA's GPU feature discovery reads
them as it reads a real node's.

The config space is a type 0 header (PCI Local Bus Specification 3.0, 6.1: ids at 0x00, status at 0x06
with bit 4 "Capabilities List", class code at 0x09, subsystem ids at 0x2c, the capabilities pointer at
0x34) and a linked list of capabilities (id, next, data). A GPU on bare metal, or passed through to a VM,
has NVIDIA's chain (as lspci shows it, and NVIDIA/k8s-device-plugin internal/vgpu/pciutil.go
NewMockNvidiaPCI gpuPassThroughConfig at 1b826acc holds it): Power Management at 0x60, MSI at 0x68, PCI
Express at 0x78 and a vendor-specific capability (id 0x09) of 20 bytes at 0xb4, 4096 bytes in all (PCIe's
extended space, empty here). A vGPU in a VM has instead, first in its chain at 0xd0, the vendor-specific
capability the vGPU manager presents (the same file's vgpuConfig; internal/vgpu/vgpu.go reads it): "VF"
at bytes 3 and 4, then the host driver record (id 0, 22 bytes long) of the hypervisor's driver version
and branch, 10 NUL-padded bytes each; then MSI. It sits on the VM's conventional PCI bus, without a PCI
Express capability, so the kernel gives 256 bytes (drivers/pci/probe.c pci_cfg_space_size).

The simulated GPUs sit on this real host, so the CPUs local to one are the host's own: read from the
host's sysfs (local_cpus below).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

from pynvml import NVML_BRAND_GEFORCE

from .identity import pci_bus_id_legacy

UNKNOWN_NODE = -1
NVIDIA_VENDOR = 0x10DE
# A GeForce board is a VGA controller (lspci: "VGA compatible controller: ... [GeForce RTX 2080 Ti]"); a
# data-center GPU a 3D controller (the H200 capture: GFD labelled it gpu.mode=compute)
VGA_CONTROLLER, DISPLAY_3D_CONTROLLER = 0x030000, 0x030200
STATUS_CAPABILITY_LIST = 0x0010
POWER_MANAGEMENT, MSI, PCI_EXPRESS, VENDOR_SPECIFIC = 0x01, 0x05, 0x10, 0x09
PCI_CONFIG_BYTES, PCIE_CONFIG_BYTES = 256, 4096
VGPU_SIGNATURE = b"VF"
HOST_DRIVER_RECORD, HOST_DRIVER_FIELD_BYTES = 0, 10


class VgpuHost(NamedTuple):
    """The NVIDIA vGPU manager of the hypervisor a simulated VM runs on: "550.54.16", "r550_40"."""

    driver_version: str
    driver_branch: str


def write_pci_devices(root: Path, gpus: list, numa_nodes: tuple[int, ...] | None, vgpu: VgpuHost | None) -> None:
    """Each GPU's PCI device files, as a bare-metal GPU's or, with `vgpu`, as a VM's vGPUs'. Writes only
    what differs: a node staged by one user (root) is opened by another (a reader), who may not write
    there, as nobody may write the real sysfs."""
    for index, gpu in enumerate(gpus):
        device = root / "bus" / "pci" / "devices" / pci_bus_id_legacy(gpu.bus).lower()
        pci_class = VGA_CONTROLLER if gpu.model.brand == NVML_BRAND_GEFORCE else DISPLAY_3D_CONTROLLER
        numa_node = numa_nodes[index] if numa_nodes is not None else UNKNOWN_NODE
        for name, data in (("numa_node", f"{numa_node}\n".encode()), ("vendor", f"0x{NVIDIA_VENDOR:04x}\n".encode()),
                           ("device", f"0x{gpu.model.pci_device_id >> 16:04x}\n".encode()),
                           ("class", f"0x{pci_class:06x}\n".encode()),
                           ("config", config_space(gpu.model.pci_device_id >> 16, gpu.model.pci_subsystem_id >> 16,
                                                   pci_class, vgpu))):
            _write_if_changed(device / name, data)


def config_space(device_id: int, subsystem_id: int, pci_class: int, vgpu: VgpuHost | None) -> bytes:
    """A GPU's configuration space as root reads it from sysfs (the module docstring has the layout)."""
    if vgpu is None:
        size, first, capabilities = PCIE_CONFIG_BYTES, 0x60, (
            (0x60, POWER_MANAGEMENT, bytes([0x03, 0x00, 0x08, 0x00])),  # PMC version 3; PMCSR No_Soft_Reset
            (0x68, MSI, bytes([0x80, 0x00])),  # Message Control: 64-bit address capable
            (0x78, PCI_EXPRESS, bytes([0x02, 0x00])),  # capability version 2, a PCI Express endpoint
            (0xB4, VENDOR_SPECIFIC, bytes([0x14, 0x01])))  # length 20, as NVIDIA's GPUs show it
    else:
        record = (bytes([HOST_DRIVER_RECORD, 2 + 2 * HOST_DRIVER_FIELD_BYTES]) + _field(vgpu.driver_version)
                  + _field(vgpu.driver_branch))
        size, first, capabilities = PCI_CONFIG_BYTES, 0xD0, (
            (0xD0, VENDOR_SPECIFIC, bytes([3 + len(VGPU_SIGNATURE) + len(record)]) + VGPU_SIGNATURE + record),
            (0x68, MSI, bytes([0x80, 0x00])))
    config = bytearray(size)
    # command: memory space and bus master enabled
    struct.pack_into("<HHHH", config, 0x00, NVIDIA_VENDOR, device_id, 0x0006, STATUS_CAPABILITY_LIST)
    struct.pack_into("<I", config, 0x08, pci_class << 8 | 0xA1)  # class code above the revision id
    struct.pack_into("<HH", config, 0x2C, NVIDIA_VENDOR, subsystem_id)
    config[0x34], config[0x3D] = first, 0x01  # the capabilities pointer; interrupt pin INTA#
    for number, (offset, identifier, data) in enumerate(capabilities):
        following = capabilities[number + 1][0] if number + 1 < len(capabilities) else 0
        config[offset:offset + 2 + len(data)] = bytes([identifier, following]) + data
    return bytes(config)


def _field(text: str) -> bytes:
    """A NUL-padded field of the host driver record."""
    return text.encode("ascii").ljust(HOST_DRIVER_FIELD_BYTES, b"\0")


def _write_if_changed(path: Path, data: bytes) -> None:
    try:
        if path.read_bytes() == data:
            return
    except OSError:  # not there yet
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


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
