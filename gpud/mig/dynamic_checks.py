"""The refusals of PUT /v1/mig/dynamic/{uid} that need the node's state: each asked device's GPU, profile and
placement checked against the inventory and the other instances, before anything is recorded or changed.
Pure: the request, the inventory and the records in, the plan or a GpudError out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpud.base.errors import ErrorKind, GpudError
from gpud.mig.dynamic_gpus import SETTING, DynamicGpus
from gpud.mig.dynamic_records import DynamicRecord
from gpud.mig.dynamic_view import overlaps
from gpud.model.inventory import Gpu, Inventory
from gpud.model.mig import GiProfile, Placement

if TYPE_CHECKING:
    from gpud.mig.dynamic import WantedDevice

Planned = tuple[Gpu, GiProfile, Placement]


def planned_devices(wanted: tuple[WantedDevice, ...], inventory: Inventory, gpus: DynamicGpus,
                    records: list[DynamicRecord]) -> list[Planned]:
    """Each wanted device's GPU, profile and placement, or the refusal that leaves everything as it is."""
    planned: list[Planned] = []
    for device in wanted:
        gpu = next((g for g in inventory.gpus if g.uuid == device.gpu), None)
        if gpu is None:
            raise GpudError(ErrorKind.NOT_FOUND, "gpu-not-found", f"no GPU {device.gpu} on this node")
        where = f"GPU {gpu.index} ({gpu.uuid})"
        if not gpus.selects(gpu):
            raise GpudError(ErrorKind.CONFLICT, "gpu-not-dynamic",
                            f"{where} is not a dynamic MIG GPU ({SETTING} does not select it): its MIG "
                            "layout is static, changed only by a layout (PUT /v1/mig); nothing was changed")
        if gpu.lost:
            raise GpudError(ErrorKind.CONFLICT, "gpu-lost", f"{where} is lost; it cannot be changed")
        capabilities = gpu.mig.capabilities
        if capabilities is None:
            raise GpudError(ErrorKind.CONFLICT, "mig-table-unknown",
                            f"{where} has no MIG profile table gpud knows" if gpu.mig.capable else
                            f"{where} is not MIG-capable")
        profile = capabilities.gi_profile_by_id(device.gi_profile_id)
        placement = next((p for p in profile.placements if p.start == device.placement_start), None) \
            if profile else None
        if profile is None or placement is None:
            offered = "; ".join(f"{p.id} ({p.name}): starts {', '.join(str(x.start) for x in p.placements)}"
                                for p in capabilities.gi_profiles)
            what = f"no GPU-instance profile {device.gi_profile_id}" if profile is None else \
                f"profile {profile.id} ({profile.name}) at no placement starting at {device.placement_start}"
            raise GpudError(ErrorKind.REFUSED, "bad-placement", f"{where} offers {what}; it offers {offered}",
                            valid_starts=[p.start for p in profile.placements] if profile else None)
        taken = [(_owner(records, gpu.uuid, gi.profile_id, gi.placement), gi.placement)
                 for gi in (gpu.mig.instances if gpu.mig.mode == "enabled" else ())]
        taken += [(f"device {n} of this request", p) for n, (g, _, p) in enumerate(planned, 1) if g.uuid == gpu.uuid]
        for owner, other in taken:
            if overlaps(placement, other):
                raise GpudError(ErrorKind.CONFLICT, "placement-taken",
                                f"{where}: {profile.name} at memory slices {_slices(placement)} overlaps {owner} "
                                f"(slices {_slices(other)}); nothing was changed")
        planned.append((gpu, profile, placement))
    return planned


def _owner(records: list[DynamicRecord], gpu_uuid: str, profile_id: int, placement: Placement) -> str:
    record = next((r for r in records if (r.gpu_uuid, r.gi_profile_id, r.placement) ==
                   (gpu_uuid, profile_id, placement)), None)
    return f"DRA claim {record.claim}" if record else "an instance gpud did not make"


def _slices(placement: Placement) -> str:
    return f"{placement.start}-{placement.start + placement.size - 1}"
