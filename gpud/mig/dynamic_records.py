"""The MIG devices DRA claims had gpud make, as persisted in state_dir/mig-dynamic.json.

Each record is written before the NVML change it announces (state creating or destroying) and
updated after it (present, or dropped): a crash between the two leaves a record that says what may
be half done, and start-up converges on it (gpud.mig.dynamic). Kept with the boot id: MIG instances
do not survive a reboot (nvml.h, nvmlDeviceCreateGpuInstance: "GPU instances are not persistent
across reboots"), so records of an earlier boot are dropped, as the DRA plugin's checkpoint drops
its claims. A file that cannot be read is set aside and reported (gpud.base.persist.read_json).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile, read_json, write_failed, write_json_atomic
from gpud.model.mig import Placement
from gpud.model.named import Named

log = get_logger("mig")


class RecordState(Named):
    CREATING = "creating"  # written before the GPU instance is made: it may exist, whole or without its CI
    PRESENT = "present"  # made: gi_id, ci_id and uuid say which
    DESTROYING = "destroying"  # written before it is destroyed: it may be gone, or half gone


@dataclass(frozen=True)
class DynamicRecord:
    claim: str
    gpu_uuid: str
    gi_profile_id: int
    placement: Placement
    profile: str  # the GPU-instance profile's name, e.g. "1g.10gb"
    state: RecordState
    gi_id: int | None = None
    ci_id: int | None = None
    uuid: str | None = None  # the MIG device's UUID

    @property
    def key(self) -> tuple[str, int, int]:
        """What a claim's device is asked as: (GPU UUID, GPU-instance profile id, placement start)."""
        return self.gpu_uuid, self.gi_profile_id, self.placement.start

    def document(self) -> dict:
        return {**asdict(self), "placement": {"start": self.placement.start, "size": self.placement.size},
                "state": self.state.value}

    def made(self, gi_id: int, ci_id: int, uuid: str | None) -> DynamicRecord:
        return replace(self, state=RecordState.PRESENT, gi_id=gi_id, ci_id=ci_id, uuid=uuid)


def _record(document: dict) -> DynamicRecord:
    optional = lambda key, kind: None if document.get(key) is None else kind(document[key])  # noqa: E731
    return DynamicRecord(str(document["claim"]), str(document["gpu_uuid"]), int(document["gi_profile_id"]),
                         Placement(int(document["placement"]["start"]), int(document["placement"]["size"])),
                         str(document["profile"]), RecordState(document["state"]), optional("gi_id", int),
                         optional("ci_id", int), optional("uuid", str))


def _parse(document: object) -> tuple[str | None, list[DynamicRecord]]:
    if not isinstance(document, dict):
        raise TypeError(f"a JSON object was expected, got {type(document).__name__}")
    return document.get("boot_id"), [_record(d) for d in document["devices"]]


class DynamicRecords:
    """mig-dynamic.json: load at start, drop an earlier boot's, save on every change (refusing loudly when
    the disk will not take it: nothing is changed on the GPU before its record is saved)."""

    def __init__(self, path: Path, boot_id: Callable[[], str]):
        self.path = path
        self._boot_id = boot_id  # read when needed: a simulated node's exists once NVML is up
        self.records: list[DynamicRecord] = []
        self.corrupt_files: list[CorruptFile] = []
        self._saved_boot: str | None = None

    def load(self) -> None:
        parsed, corrupt = read_json(self.path, _parse)
        self.corrupt_files = [corrupt] if corrupt else []
        self._saved_boot, self.records = parsed or (None, [])

    def drop_earlier_boots(self) -> None:
        now = self._boot_id()
        if self.records and self._saved_boot != now:
            log.info("dynamic_mig_records_of_an_earlier_boot_dropped", devices=len(self.records),
                     saved_boot_id=self._saved_boot, boot_id=now)
            self.records = []
            self.save()

    def of_claim(self, claim: str) -> list[DynamicRecord]:
        return [r for r in self.records if r.claim == claim]

    def put(self, *records: DynamicRecord) -> None:
        """Adds or replaces (by claim and key) the records, and saves."""
        keys = {(r.claim, r.key) for r in records}
        self.save([r for r in self.records if (r.claim, r.key) not in keys] + list(records))

    def drop(self, record: DynamicRecord) -> None:
        self.save([r for r in self.records if (r.claim, r.key) != (record.claim, record.key)])

    def save(self, records: list[DynamicRecord] | None = None) -> None:
        """Saves records (default: those held). Raises GpudError (disk-full when the disk is full) having
        changed nothing."""
        records = self.records if records is None else records
        boot = self._boot_id()
        try:
            write_json_atomic(self.path, {"boot_id": boot, "devices": [r.document() for r in records]})
        except OSError as exc:
            log.error("dynamic_mig_records_not_saved", path=str(self.path), error=str(exc))
            raise write_failed(self.path, exc, "the dynamic MIG devices") from None
        self.records, self._saved_boot = records, boot
