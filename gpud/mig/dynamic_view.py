"""What GET /v1/mig/dynamic and the answers of PUT /v1/mig/dynamic/{uid} show: the dynamic MIG GPUs with
every placement their profiles offer (what the DRA plugin publishes as partitionable devices), and the
claims' devices. Pure: the inventory and the records in, JSON data out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpud.mig.dynamic_gpus import DynamicGpus
from gpud.mig.dynamic_records import DynamicRecord
from gpud.mig.sync import resets_to_change_mode
from gpud.model.inventory import Gpu, Inventory
from gpud.model.mig import GpuInstanceState, Placement
from gpud.processes.monitor import ProcessMonitor

if TYPE_CHECKING:
    from gpud.mig.dynamic import WantedDevice


def dynamic_view(inventory: Inventory | None, gpus: DynamicGpus, records: list[DynamicRecord]) -> dict:
    dynamic = [gpu for gpu in inventory.gpus if gpus.selects(gpu)] if inventory else []
    return {"gpus": [_gpu_view(gpu) for gpu in dynamic],
            "instances": [instance_view(record, inventory) for record in records]}


def _gpu_view(gpu: Gpu) -> dict:
    capabilities = gpu.mig.capabilities
    problem = None
    if not gpu.mig.capable:
        problem = "not MIG-capable"
    elif capabilities is None:
        problem = ("the driver answers no MIG profile table while MIG mode is off, and gpud has neither read one "
                   "on this GPU nor ships one for its model: switch MIG mode on once for gpud to read it")
    elif gpu.lost:
        problem = "the GPU is lost"
    return {"uuid": gpu.uuid, "index": gpu.index, "minor_number": gpu.minor_number,
            "mig_mode": "enabled" if gpu.mig.mode == "enabled" else "disabled",
            "mode_toggle_without_reset": gpu.mig.capable and not resets_to_change_mode(gpu),
            "memory_slices": capabilities.memory_slices if capabilities else 0, "problem": problem,
            "profiles": [{"name": p.name, "gi_profile_id": p.id, "multiprocessors": p.multiprocessors,
                          "copy_engines": p.copy_engines, "decoders": p.decoders, "encoders": p.encoders,
                          "jpeg_engines": p.jpeg_engines, "ofa_engines": p.ofa_engines, "memory_mib": p.memory_mib,
                          "placements": [{"start": x.start, "size": x.size} for x in p.placements]}
                         for p in (capabilities.gi_profiles if capabilities else ())]}


def instance_view(record: DynamicRecord, inventory: Inventory | None) -> dict:
    """A claim's device as recorded, its ids and MIG UUID as the GPU holds them now (a GPU reset
    recreates them with new ones)."""
    gpu = next((g for g in inventory.gpus if g.uuid == record.gpu_uuid), None) if inventory else None
    gi = find_instance(gpu, record) if gpu is not None else None
    ci = gi.compute_instances[0] if gi is not None and gi.compute_instances else None
    return {"claim": record.claim, "gpu_uuid": record.gpu_uuid, "gpu_index": gpu.index if gpu else None,
            "profile": record.profile, "gi_profile_id": record.gi_profile_id,
            "placement": {"start": record.placement.start, "size": record.placement.size},
            "state": record.state.value, "uuid": ci.uuid if ci else record.uuid,
            "gi_id": gi.gi_id if gi else record.gi_id, "ci_id": ci.ci_id if ci else record.ci_id}


def claim_answer(claim: str, wanted: tuple[WantedDevice, ...], records: list[DynamicRecord],
                 inventory: Inventory | None) -> dict:
    """PUT /v1/mig/dynamic/{uid}'s answer: each device asked for, in the request's order, as made."""
    by_key = {record.key: record for record in records}
    devices = []
    for device in wanted:
        made = instance_view(by_key[device.key], inventory)
        devices.append({"gpu": device.gpu, "gi_profile_id": device.gi_profile_id,
                        "placement_start": device.placement_start, "profile": made["profile"], "uuid": made["uuid"],
                        "gi_id": made["gi_id"], "ci_id": made["ci_id"]})
    return {"claim": claim, "devices": devices}


def find_instance(gpu: Gpu, record: DynamicRecord) -> GpuInstanceState | None:
    """The GPU instance at the record's profile and placement, if the GPU holds one."""
    if gpu.mig.mode != "enabled":
        return None
    return next((gi for gi in gpu.mig.instances
                 if gi.profile_id == record.gi_profile_id and gi.placement == record.placement), None)


def overlaps(a: Placement, b: Placement) -> bool:
    return a.start < b.start + b.size and b.start < a.start + a.size


def process_names(processes: ProcessMonitor | None) -> dict[int, str]:
    """PID -> command name, of the processes gpud saw on its GPUs last."""
    snapshot = processes.current if processes is not None else None
    return {p.pid: p.host.comm for device in (snapshot.devices if snapshot else ()) for p in device.processes
            if p.host.comm}


def pids_line(pids, names: dict[int, str]) -> str:
    return "PIDs " + ", ".join(f"{pid} ({names[pid]})" if pid in names else str(pid) for pid in pids)
