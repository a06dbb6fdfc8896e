"""What the API says about an inventory snapshot, rendered once per snapshot.

Requests are answered from these pre-encoded bodies: no NVML call and no JSON encoding on the
request path, so a busy client costs gpud almost nothing.
"""

from __future__ import annotations

from dataclasses import asdict

from gpud.base.encoding import encode
from gpud.model.driver import MINIMUM_BRANCH, driver_problem
from gpud.model.inventory import Gpu, Inventory, format_cpulist, normal_bus_id


def gpu_view(gpu: Gpu) -> dict:
    view = asdict(gpu)
    # As Slurm's gres.conf and the kernel write them: a cpulist, and link counts by peer index.
    view["cpu_affinity"] = format_cpulist(gpu.cpu_affinity)
    view["nvlink_counts"] = {str(peer): links for peer, links in gpu.nvlink_counts}
    if not gpu.error:
        del view["error"]
    if gpu.mig.profiles_source is None:  # no table: not MIG-capable, or nothing to go by
        del view["mig"]["profiles_source"]
    del view["mig"]["capabilities"], view["mig"]["instances"]  # planner data, served by /v1/mig
    return view


def node_view(inventory: Inventory | None, base: dict, driver_version: str | None = None) -> dict:
    """driver_version: the driver NVML reported, for when there is no inventory (an unsupported driver)."""
    driver_version = inventory.driver_version if inventory else driver_version
    view = dict(base)
    view.update(
        driver_version=driver_version,
        minimum_driver_branch=MINIMUM_BRANCH,
        driver_supported=driver_problem(driver_version) is None if driver_version else None,
        cuda_version=inventory.cuda_version if inventory else None,
        nvml_version=inventory.nvml_version if inventory else None,
        gpu_count=len(inventory.gpus) if inventory else None,
        mig_device_count=sum(len(g.mig.devices) for g in inventory.gpus) if inventory else None,
        inventory_read_at=inventory.read_at if inventory else None,
    )
    return view


class RenderedInventory:
    """The encoded bodies of one snapshot: the GPU list and each GPU under every name it answers to."""

    def __init__(self, inventory: Inventory):
        self.inventory = inventory
        views = [gpu_view(gpu) for gpu in inventory.gpus]
        self.gpus_body = encode({"gpus": views})
        self._gpu_bodies: dict[str, bytes] = {}
        for gpu, view in zip(inventory.gpus, views):
            body = encode(view)
            for key in (str(gpu.index), gpu.uuid, gpu.pci_bus_id, normal_bus_id(gpu.pci_bus_id)):
                self._gpu_bodies.setdefault(key, body)

    def gpu_body(self, ident: str) -> bytes | None:
        body = self._gpu_bodies.get(ident)
        if body is None and ":" in ident:
            body = self._gpu_bodies.get(normal_bus_id(ident) or "")
        return body
