"""The CDI (Container Device Interface) spec of this node, built from what gpud knows: a pure function
of the inventory snapshot, the sharing document, the MPS clients and the device nodes on the host.

Device names (kind gpud/gpu, so they never collide with nvidia-ctk's nvidia.com/gpu spec):
  "0", "GPU-<uuid>"        a whole GPU, by index and by UUID
  "0:1", "MIG-<uuid>"      a MIG device, by "<GPU index>:<MIG index>" (nvidia-ctk's index names: NVIDIA
                           Container Toolkit docs, "Support for Container Device Interface") and by UUID
  "<uuid>::<n>"            a replica of /v1/sharing (time-slicing or MPS)
  "all"                    every GPU and MIG device
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, NamedTuple

from gpud.cdi.version import minimum_version
from gpud.model.inventory import Gpu, Inventory, MigDevice

KIND = "gpud/gpu"
SPEC_FILE = "gpud-gpu.json"  # <vendor>-<class>.json, as NVIDIA's device plugin names its specs
# Every CUDA client opens these besides its GPU's node (nvidia-ctk puts them in every spec).
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
ALL = "all"
_MIG_MINORS_LINE = re.compile(r"(config|monitor|gpu[0-9]+/gi[0-9]+(?:/ci[0-9]+)?/access) ([0-9]+)")


@dataclass(frozen=True)
class HostDevices:
    """The NVIDIA device nodes present on the host: their path in a container ("/dev/nvidia0") -> the
    character device itself on the host; and the driver's MIG capability minors ("gpu0/gi1/access" -> 12)."""

    present: Mapping[str, str] = field(default_factory=dict)
    mig_minors: Mapping[str, int] = field(default_factory=dict)

    def node(self, path: str) -> dict:
        host = self.present[path]
        return {"path": path} if host == path else {"path": path, "hostPath": host}


class CdiSpec(NamedTuple):
    spec: dict  # the CDI document; its devices list is empty when no device can be handed out
    unavailable: list[dict]  # {"device", "reason"}: devices left out, and why


def read_host_devices(dev_root: Path, mig_minors_path: Path) -> HostDevices:
    """Scans <dev_root>/dev for NVIDIA character devices and reads the MIG minors table (absent on a
    host without MIG support: no table, as nvidia-container-toolkit internal/nvcaps takes it).
    A symbolic link to a character device counts as the device it resolves to: the CDI library reads a
    hostPath with lstat (pkg/cdi container-edits_unix.go deviceInfoFromPath) and refuses a link ("not a
    device node"), so the spec names the device itself (a simulated node's links to /dev/null)."""
    present = {}
    for directory, prefix in ((dev_root / "dev", "/dev/"), (dev_root / "dev" / "nvidia-caps", "/dev/nvidia-caps/")):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if name.startswith("nvidia") and _is_char_device(directory / name):
                present[prefix + name] = os.path.realpath(directory / name)
    try:
        minors = parse_mig_minors(mig_minors_path.read_text())
    except OSError:
        minors = {}
    return HostDevices(present, minors)


def parse_mig_minors(text: str) -> dict[str, int]:
    """'<capability> <minor>' per line (kernel-open/nvidia/nv-caps.c); lines of any other shape are
    skipped, as nvidia-container-toolkit's parser (internal/nvcaps) skips them."""
    minors = {}
    for line in text.splitlines():
        match = _MIG_MINORS_LINE.fullmatch(line)
        if match:
            minors[match[1]] = int(match[2])
    return minors


def build_spec(inventory: Inventory, sharing: dict | None, mps_clients: Mapping[str, dict],
               host: HostDevices, driver_edits: Mapping[str, list] | None = None) -> CdiSpec:
    """mps_clients: device UUID -> what GET /v1/mps/{name}/client-env serves for the daemon of that device;
    driver_edits: the driver's files (driver_files.DriverFiles.edits), which every device needs."""
    devices: list[dict] = []
    unavailable: list[dict] = []
    nodes_of: dict[str, list[str]] = {}  # device UUID -> its device node paths, for replicas and "all"
    for gpu in inventory.gpus:
        for uuid, names, paths in _whole_devices(gpu, host):
            missing = [path for path in paths if path not in host.present]
            if missing:
                unavailable += [{"device": name, "reason": f"no device node {', '.join(missing)} on the host"}
                                for name in names]
                continue
            nodes_of[uuid] = paths
            devices += [_device(name, host, paths) for name in names]
    devices += _replicas(sharing, mps_clients, nodes_of, host, unavailable)
    if nodes_of:
        devices.append(_device(ALL, host, list(dict.fromkeys(p for paths in nodes_of.values() for p in paths))))
    spec = {"kind": KIND, "devices": devices}
    control = [host.node(path) for path in CONTROL_NODES if path in host.present]
    common = {"deviceNodes": control, **(driver_edits or {})}
    if any(common.values()):
        spec["containerEdits"] = {key: value for key, value in common.items() if value}
    # In every configuration: device names such as "0" alone need 0.5.0, with or without a hostPath.
    return CdiSpec({"cdiVersion": minimum_version(spec), **spec}, unavailable)


def _whole_devices(gpu: Gpu, host: HostDevices) -> list[tuple[str, list[str], list[str]]]:
    """(UUID, names, device node paths) of a GPU and of each of its MIG devices."""
    if gpu.lost or gpu.minor_number is None:
        return []  # no node to hand out: a lost GPU, or one whose /dev/nvidia<minor> NVML did not tell
    gpu_node = f"/dev/nvidia{gpu.minor_number}"
    found = [(gpu.uuid, [str(gpu.index), gpu.uuid], [gpu_node])]
    if gpu.mig.mode == "enabled":
        found += [(dev.uuid, [f"{gpu.index}:{dev.index}", dev.uuid], [gpu_node, *_mig_cap_nodes(gpu, dev, host)])
                  for dev in gpu.mig.devices]
    return found


def _mig_cap_nodes(gpu: Gpu, device: MigDevice, host: HostDevices) -> list[str]:
    """The nvidia-caps nodes that grant access to a MIG device's GPU instance and compute instance;
    the table is keyed by the GPU's minor number (nvidia-container-toolkit internal/nvcaps)."""
    keys = (f"gpu{gpu.minor_number}/gi{device.gi_id}/access", f"gpu{gpu.minor_number}/gi{device.gi_id}/ci{device.ci_id}/access")
    # A key the table lacks names a node that cannot exist: the device is reported unavailable.
    return [f"/dev/nvidia-caps/nvidia-cap{host.mig_minors[key]}" if key in host.mig_minors
            else f"/dev/nvidia-caps/<{key}: not in the MIG minors table>" for key in keys]


def _replicas(sharing: dict | None, mps_clients: Mapping[str, dict], nodes_of: dict[str, list[str]],
              host: HostDevices, unavailable: list[dict]) -> list[dict]:
    devices = []
    for resource in (sharing or {}).get("resources", []):
        if resource["strategy"] == "gpu-memory":
            continue  # units of GPU memory: a container gets its device's own CDI device, already in the spec
        mps = resource["strategy"] == "mps"
        for replica in resource["devices"]:
            if replica["replicas"] == 1:
                continue  # an unshared device: its ID is the device UUID, already in the spec
            uuid = replica["id"].rpartition("::")[0]
            if uuid not in nodes_of:
                unavailable.append({"device": replica["id"], "reason": f"its device {uuid} is unavailable"})
            elif mps and uuid not in mps_clients:
                unavailable.append({"device": replica["id"], "reason": f"no MPS daemon serves {uuid}"})
            else:
                devices.append(_device(replica["id"], host, nodes_of[uuid], mps_clients.get(uuid) if mps else None))
    return devices


def _device(name: str, host: HostDevices, paths: list[str], mps_client: dict | None = None) -> dict:
    edits: dict = {"deviceNodes": [host.node(path) for path in paths]}
    if mps_client:
        edits["env"] = [f"{key}={value}" for key, value in sorted(mps_client["env"].items())]
        edits["mounts"] = [{"hostPath": mount["source"], "containerPath": mount["target"],
                            "options": ["ro" if mount["read_only"] else "rw", "nosuid", "nodev", "bind"]}
                           for mount in mps_client["mounts"]]
    return {"name": name, "containerEdits": edits}


def _is_char_device(path: Path) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False
