"""Compute-instance profiles of a GPU instance, and the MIG tables gpud ships for known GPUs.

NVML describes compute-instance profiles only through an existing GPU instance, so until one
exists gpud derives them from the GPU-instance size: which CI sizes fit by go-nvlib's rule, where they
start as NVIDIA/go-nvml's mock GPUs place them (pkg/nvml/mock/gpus/; no real `nvidia-smi mig -lcipp`
output was found).

The shipped tables (data/mig-profiles.yaml, each row with its source) stand in for a GPU whose
driver does not answer its MIG table while MIG is off (R535) and that gpud has never read; they
also carry the A30 instance counts NVML misreports.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from dataclasses import dataclass, replace
from pathlib import Path

from gpud.base.logs import get_logger
from gpud.base.persist import write_json_atomic
from gpud.base.yamlfile import load_yaml
from gpud.model.mig import CiProfile, GiProfile, MigCapabilities, Placement

log = get_logger("mig")

_DATA = "mig-profiles.yaml"


def derive_ci_profiles(gi_slices: int, constants_by_slices: dict[int, int],
                       whole_constant: int | None = None) -> tuple[CiProfile, ...]:
    """The compute-instance profiles a GPU instance of `gi_slices` compute slices offers, smallest first.

    `constants_by_slices` maps CI slices to the NVML compute-instance profile constant;
    `whole_constant` overrides the constant of the whole-GI profile (1_SLICE_REV1 in a REV2 1g GI).
    """
    if whole_constant is None:
        if gi_slices not in constants_by_slices:
            raise ValueError(f"no compute-instance profile constant for {gi_slices} slices")
        whole_constant = constants_by_slices[gi_slices]
    partial = sorted(c for c in constants_by_slices if _fits_partially(c, gi_slices))
    return tuple(CiProfile(constant=constants_by_slices[c], slices=c, starts=_ci_starts(c, gi_slices))
                 for c in partial) + (CiProfile(constant=whole_constant, slices=gi_slices, starts=(0,)),)


def _fits_partially(ci_slices: int, gi_slices: int) -> bool:
    # go-nvlib's rule (NVIDIA/go-nvlib pkg/nvlib/device/device.go, VisitMigProfiles): a CI smaller than
    # its GI takes at most about half of it.
    return 0 < ci_slices < gi_slices and 2 * ci_slices <= gi_slices + 1


def _ci_starts(ci_slices: int, gi_slices: int) -> tuple[int, ...]:
    # As NVIDIA/go-nvml pkg/nvml/mock/gpus/ places them (INFERRED: no real -lcipp output was found):
    # CIs start on boundaries of their size rounded up to a power of two (3c in a 7g GI at
    # 0 and 4, like a 3g GI on the memory axis), as long as they end inside the GI.
    alignment = 1 << (ci_slices - 1).bit_length()
    return tuple(range(0, gi_slices - ci_slices + 1, alignment))


# -- shipped tables ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShippedTable:
    model: str
    source: str  # where the rows come from: the public sources, and how sure they are
    pci_device_ids: tuple[int, ...]
    capabilities: MigCapabilities
    nvml_instance_counts_wrong: bool  # the driver misreports instanceCount: use these counts


@functools.cache
def _shipped() -> tuple[dict[int, int], dict[int, int], dict[str, ShippedTable]]:
    """(GI profile constants by name, CI constants by slice count, tables by model)."""
    source = f"gpud/nvml/data/{_DATA}"
    text = (importlib.resources.files("gpud.nvml") / "data" / _DATA).read_text()
    document = load_yaml(text, lambda reason, line: ValueError(f"{source}: line {line}: {reason}"))
    gi_constants = document["nvml_constants"]["gpu_instance"]
    ci_by_name = document["nvml_constants"]["compute_instance"]
    ci_by_slices = {int(name.split("_")[0]): value for name, value in ci_by_name.items() if name.endswith("_SLICE")}
    tables = {model: _table(model, entry, gi_constants, ci_by_slices, ci_by_name["1_SLICE_REV1"])
              for model, entry in document["models"].items()}
    return gi_constants, ci_by_slices, tables


def _table(model: str, entry: dict, gi_constants: dict[str, int], ci_by_slices: dict[int, int],
           rev1_ci: int) -> ShippedTable:
    profiles = []
    for name, constant, profile_id, slices, memory_mib, count, starts, size in entry["gpu_instance_profiles"]:
        # A double-memory 1g GI (REV2) offers its single slice as CI profile 1_SLICE_REV1 (seen once:
        # `nvidia-smi mig -cgi 15 -C` on an H100 made CI profile ID 7; `nvidia-smi mig -lcip` checks it).
        whole_ci = rev1_ci if constant == "1_SLICE_REV2" else None
        profiles.append(GiProfile(
            id=profile_id, constant=gi_constants[constant], name=name, slices=slices, memory_mib=memory_mib,
            instance_count=count, placements=tuple(Placement(start, size) for start in starts),
            ci_profiles=derive_ci_profiles(slices, ci_by_slices, whole_ci)))
    return ShippedTable(model=model, source=" ".join(entry["source"].split()),
                        pci_device_ids=tuple(entry["pci_device_ids"]),
                        capabilities=MigCapabilities(memory_slices=entry["memory_slices"], gi_profiles=tuple(profiles)),
                        nvml_instance_counts_wrong=bool(entry.get("nvml_instance_counts_wrong", False)))


def shipped_tables() -> list[ShippedTable]:
    """Every GPU model's shipped table."""
    return list(_shipped()[2].values())


def shipped_table(pci_device_id: str) -> ShippedTable | None:
    """The shipped table of the GPU with this PCI device id ("0x20B010DE"), if gpud ships one."""
    try:
        wanted = int(pci_device_id, 16)
    except (TypeError, ValueError):
        return None
    return next((t for t in shipped_tables() if wanted in t.pci_device_ids), None)


def with_true_instance_counts(capabilities: MigCapabilities, pci_device_id: str) -> MigCapabilities:
    """The table NVML answered, with the shipped instance counts where the driver misreports them
    (A30: mig-parted uses hard-coded counts for it, discovery.go @ ab1c1452)."""
    shipped = shipped_table(pci_device_id)
    if shipped is None or not shipped.nvml_instance_counts_wrong:
        return capabilities
    counts = {p.id: p.instance_count for p in shipped.capabilities.gi_profiles}
    return replace(capabilities, gi_profiles=tuple(replace(p, instance_count=counts.get(p.id, p.instance_count))
                                                   for p in capabilities.gi_profiles))


class ReadTables:
    """The MIG table gpud last read from NVML on each GPU, by GPU UUID, kept in a JSON file
    (state_dir/mig-profiles.json): what stands in when the driver stops answering it (R535 after
    MIG is turned off). No path: kept in memory only."""

    def __init__(self, path: Path | None):
        self._path = path
        self._documents: dict[str, dict] = self._load()

    def get(self, uuid: str) -> MigCapabilities | None:
        document = self._documents.get(uuid)
        try:
            return MigCapabilities.from_document(document["table"]) if document else None
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("mig_profiles_entry_unusable", uuid=uuid, path=str(self._path), error=repr(exc))
            return None

    def remember(self, uuid: str, capabilities: MigCapabilities, **context: object) -> None:
        """Keeps the table (with context: the PCI device id, the driver and MIG mode it was read under)."""
        document = {**context, "table": capabilities.to_document()}
        if self._documents.get(uuid) == document:
            return
        self._documents[uuid] = document
        if self._path is None:
            return
        try:
            write_json_atomic(self._path, self._documents)
        except OSError as exc:
            log.warning("mig_profiles_not_saved", path=str(self._path), error=str(exc))

    def _load(self) -> dict[str, dict]:
        if self._path is None:
            return {}
        try:
            documents = json.loads(self._path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("mig_profiles_unreadable", path=str(self._path), error=str(exc))
            return {}
        if not isinstance(documents, dict):
            log.warning("mig_profiles_unreadable", path=str(self._path), error="not a JSON object")
            return {}
        return {uuid: doc for uuid, doc in documents.items() if isinstance(doc, dict)}
