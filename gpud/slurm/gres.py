"""Slurm's gres.conf of this node, built from what gpud knows: a pure function of the inventory snapshot,
the sharing document (GET /v1/sharing), the driver's MIG capability minors and the host's core indexes.

The records are those Slurm's own NVML autodetection makes (SchedMD/slurm src/plugins/gpu/nvml/gpu_nvml.c,
_get_system_gpu_list_nvml), with gpud's MIG profile names as the MIG devices' Type:
  Name=gpu Type=<model> File=/dev/nvidia<minor> Cores=<cores> Links=<links>       a whole GPU
  Name=gpu Type=<profile> MultipleFiles=/dev/nvidia<minor>,<gi cap>,<ci cap> ...  a MIG device
  Name=shard Count=<replicas> File=/dev/nvidia<minor>                             time-slicing replicas
  Name=mps Count=100 File=/dev/nvidia<minor>                                      an MPS-shared GPU
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from gpud.model.inventory import UNKNOWN, Gpu, Inventory, normal_bus_id

HEADER = ("# Slurm gres.conf, written by gpud from its inventory, MIG layout and sharing: edits are overwritten.\n"
          "# Regenerate it with `gpud slurm gres` (GET /v1/slurm/gres); the Gres= of this node's line in\n"
          "# slurm.conf: `gpud slurm gres --node-line`.\n")
# gres.conf(5), Count: "For MPS, typically 100 or some multiple of 100" (a percentage of the GPU).
MPS_COUNT = 100
# gres.conf keys in the order a line names them, from a record's JSON keys.
_KEYS = (("name", "Name"), ("type", "Type"), ("count", "Count"), ("file", "File"),
         ("multiple_files", "MultipleFiles"), ("cores", "Cores"), ("links", "Links"))
# The sharing strategies Slurm has a GRES for: time-slicing as shard, MPS as mps (gres.conf(5), Name).
_SHARED_GRES = {"time-slicing": "shard", "mps": "mps"}

Cores = Callable[[tuple[int, ...]], str | None]


class Gres(NamedTuple):
    text: str  # the whole gres.conf
    node_gres: str  # the value of Gres= on this node's line in slurm.conf
    records: list[dict]  # one per line: its gres.conf fields (lowercase keys) and gpud's device name
    unavailable: list[dict]  # {"device", "reason"}: devices left out, and why


def gpu_type(name: str) -> str:
    """Slurm's autodetected type of a GPU: its NVML name lowercased, spaces to underscores
    (gpu_common_underscorify_tolower): "NVIDIA A100-SXM4-40GB" -> "nvidia_a100-sxm4-40gb"."""
    return name.lower().replace(" ", "_")


def build_gres(inventory: Inventory, sharing_document: dict | None, mig_minors: dict[str, int],
               cores: Cores) -> Gres:
    """mig_minors: gpud.cdi.spec.parse_mig_minors's table; cores: a GPU's CPU affinity -> its Cores=
    value, None for nothing to say (gpud.slurm.cores.CoreIndex)."""
    records: list[dict] = []
    unavailable: list[dict] = []
    files: dict[str, str] = {}  # UUID of a whole GPU with a record -> its device file
    in_mig_mode: dict[str, int] = {}  # UUID of a GPU in MIG mode -> its index
    notes: dict[int, str] = {}  # position of a GPU's first record -> the comment line before it
    by_bus = _by_bus_id(inventory)
    for gpu in inventory.gpus:
        reason = _unusable(gpu)
        if reason:
            unavailable.append({"device": str(gpu.index), "reason": reason})
            continue
        if gpu.lost or gpu.error:
            notes[len(records)] = (f"# GPU {gpu.index} is {'lost' if gpu.lost else 'unreadable'} ({gpu.error}): its "
                                   f"records stay as last seen, so Slurm's count stays (gpud slurm health drains the node)")
        if gpu.mig.mode == "enabled":
            in_mig_mode[gpu.uuid] = gpu.index
            records += _mig_records(gpu, mig_minors, cores, unavailable)
        else:
            files[gpu.uuid] = f"/dev/nvidia{gpu.minor_number}"
            records.append(_record("gpu", str(gpu.index), gpu.uuid, type=gpu_type(gpu.name), file=files[gpu.uuid],
                                   cores=cores(gpu.cpu_affinity), links=_links(gpu, by_bus)))
    records += _shared_records(sharing_document, files, in_mig_mode, unavailable)
    lines = [(notes[position] + "\n" if position in notes else "") +
             " ".join(f"{key}={record[field]}" for field, key in _KEYS if record.get(field) is not None) + "\n"
             for position, record in enumerate(records)]
    return Gres(HEADER + "".join(lines), _node_gres(records), records, unavailable)


def _record(name: str, device: str, uuid: str, **fields) -> dict:
    return {"name": name, **fields, "device": device, "uuid": uuid}


def _unusable(gpu: Gpu) -> str | None:
    """Why a GPU has no record. A GPU lost or unreadable now keeps the records of its last description:
    dropping them would lower the count slurmd reports, and slurmctld would set the node INVALID with a
    reason of its own ("gres/gpu count reported lower than configured") over gpud's drain, which says why."""
    state = "lost, " if gpu.lost else "unreadable, " if gpu.error else ""
    if gpu.uuid == UNKNOWN:  # inventory.unknown_gpu: never described since gpud started
        return f"{state}never described by NVML since gpud started"
    if gpu.minor_number is None:
        return f"{state}NVML did not tell its minor number, so its /dev/nvidia<minor> is unknown"
    if gpu.mig.mode == "enabled" and not gpu.mig.devices:
        return "MIG mode is enabled and it has no MIG devices: Slurm can use nothing of it until a MIG layout is applied"
    return None


def _mig_records(gpu: Gpu, mig_minors: dict[str, int], cores: Cores, unavailable: list[dict]) -> list[dict]:
    """One record per MIG device: its parent's node and the nvidia-caps nodes of its GPU and compute
    instances (gpu_nvml.c _handle_mig), with the parent's Cores and no Links (Slurm links no MIG device).
    The driver's table names a GPU gpu<N> by its minor number, as gpud's CDI spec reads it
    (gpud/cdi/spec.py _mig_cap_nodes, after nvidia-container-toolkit internal/nvcaps); Slurm's own lookup
    is handed the NVML index, the same wherever index and minor number agree."""
    records = []
    for device in gpu.mig.devices:
        name = f"{gpu.index}:{device.index}"
        instance = f"gpu{gpu.minor_number}/gi{device.gi_id}"
        keys = (f"{instance}/access", f"{instance}/ci{device.ci_id}/access")
        missing = [key for key in keys if key not in mig_minors]
        if missing:
            unavailable.append({"device": name, "reason": f"{', '.join(missing)} not in the driver's MIG minors table"})
            continue
        files = [f"/dev/nvidia{gpu.minor_number}", *(f"/dev/nvidia-caps/nvidia-cap{mig_minors[key]}" for key in keys)]
        records.append(_record("gpu", name, device.uuid, type=device.profile, multiple_files=",".join(files),
                               cores=cores(gpu.cpu_affinity)))
    return records


def _by_bus_id(inventory: Inventory) -> list[Gpu]:
    """The GPUs in Slurm's device-number order (gres.conf(5), Links: "sorting the GPUs by PCI bus ID")."""
    return sorted(inventory.gpus, key=lambda other: (normal_bus_id(other.pci_bus_id) or "", other.index))


def _links(gpu: Gpu, by_bus: list[Gpu]) -> str | None:
    """gres.conf(5), Links: one entry per GPU by device number, -1 for itself, else the number of
    connections to it (active NVLinks; NVSwitch links count nothing, as in gpu_nvml.c
    _nvml_get_nvlink_info). None when it has no link to any GPU: nothing to say."""
    counts = dict(gpu.nvlink_counts)
    if not any(counts.get(other.index, 0) for other in by_bus if other.index != gpu.index):
        return None
    return ",".join("-1" if other.index == gpu.index else str(counts.get(other.index, 0)) for other in by_bus)


def _shared_records(sharing_document: dict | None, files: dict[str, str], in_mig_mode: dict[str, int],
                    unavailable: list[dict]) -> list[dict]:
    """shard (time-slicing) and mps records, per whole GPU, by GPU index. A shared GRES names its GPU by the
    GPU's File (gres.conf(5), Count: "each GPU would be identified by device file using the File parameter");
    a MIG device has no File of its own (MultipleFiles), so its replicas cannot be said to Slurm, nor can
    those of a GPU in MIG mode shared whole (migStrategy none), which has no gpu record of its own."""
    replicas: dict[str, tuple[int, int, str]] = {}  # device UUID -> (GPU index, replicas, strategy)
    for resource in (sharing_document or {}).get("resources", []):
        strategy = resource["strategy"]
        if strategy not in _SHARED_GRES:
            continue
        for entry in resource["devices"]:
            if entry["replicas"] > 1:  # one replica: an unshared device, its gpu record says it all
                replicas[entry["id"].rpartition("::")[0]] = (entry["gpu_index"], entry["replicas"], strategy)
    records = []
    for uuid, (gpu_index, count, strategy) in sorted(replicas.items(), key=lambda item: (item[1][0], item[0])):
        gres = _SHARED_GRES[strategy]
        if uuid not in files:
            why = _not_shareable(uuid, in_mig_mode)
            unavailable.append({"device": f"{gres}:{uuid}", "reason": f"{strategy} replicas of {uuid} left out: {why}"})
            continue
        records.append(_record(gres, str(gpu_index), uuid, count=MPS_COUNT if gres == "mps" else count,
                               file=files[uuid]))
    return records


def _not_shareable(uuid: str, in_mig_mode: dict[str, int]) -> str:
    """Why a shared device's replicas have no shard or mps record."""
    if uuid.startswith("MIG-"):
        return "a MIG device: Slurm's shard and mps name a GPU by its File, which a MIG device lacks"
    if uuid in in_mig_mode:
        return (f"GPU {in_mig_mode[uuid]} is in MIG mode: Slurm's shard and mps name a GPU by the File of its "
                "gpu record, and a GPU in MIG mode has none (gres.conf lists its MIG devices, by MultipleFiles)")
    return "its GPU is unavailable (left out above)"


def _node_gres(records: list[dict]) -> str:
    """slurm.conf(5) Gres=: name:type:count per GPU type (sorted), then the untyped shard and mps totals."""
    typed: dict[str, int] = {}
    untyped: dict[str, int] = {}
    for record in records:
        if record["name"] == "gpu":
            typed[record["type"]] = typed.get(record["type"], 0) + 1
        else:
            untyped[record["name"]] = untyped.get(record["name"], 0) + record["count"]
    return ",".join([f"gpu:{type_}:{count}" for type_, count in sorted(typed.items())] +
                    [f"{name}:{untyped[name]}" for name in ("shard", "mps") if name in untyped])
