"""The DRA plugin's record of prepared claims, kept so that a kill at any step converges at the restart.

The kubelet does not call NodePrepareResources again for a claim it marked prepared, and calls
NodeUnprepareResources with only the claim's namespace, name and UID (the claim may be gone): what was
prepared must outlive the plugin (k8s.io/dynamic-resource-allocation kubeletplugin draplugin.go, the
DRAPlugin interface's documentation). Every change is written whole, atomically (gpud/base/persist.py), before
the step it records is taken or right after it, so that each possible kill leaves one of:
- a claim `preparing`: its spec may or may not be written; the next Prepare (the kubelet retries one that
  failed or timed out) does it again, an Unprepare removes whatever was written;
- a claim `prepared`: spec written, devices handed out; Prepare answers the same devices again;
- no claim: Unprepare finished (or never began).
A claim recorded in another boot is dropped at load: CDI specs in /var/run/cdi and the driver's state do
not survive a reboot, and the kubelet prepares the pods again (NVIDIA's checkpointv.go NodeBootID does
the same). A file gpud cannot read (corrupt, another format such as NVIDIA's plugin's, newer) is set
aside and reported, and the plugin starts from the CDI specs its claims left (`rebuild`), never crash-looping.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile, read_json, write_json_atomic

log = get_logger("dra_plugin")

FORMAT = "gpud-dra-checkpoint/v1"
FILE_NAME = "gpud-checkpoint.json"
PREPARING, PREPARED = "preparing", "prepared"


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    uuid: str  # the GPU's or MIG device's UUID
    gpu_uuid: str  # the GPU it is on
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    state: str  # PREPARING | PREPARED
    devices: tuple[PreparedDevice, ...] = ()
    shared: bool = False  # its config lets other claims share its devices (a sharing strategy)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(document: dict) -> PreparedClaim:
        if document["state"] not in (PREPARING, PREPARED):
            raise ValueError(f"claim state {document['state']!r}")
        devices = tuple(PreparedDevice(tuple(str(r) for r in d["request_names"]), str(d["pool"]), str(d["device"]),
                                       str(d["uuid"]), str(d["gpu_uuid"]), tuple(str(i) for i in d["cdi_device_ids"]),
                                       None if d.get("share_id") is None else str(d["share_id"]))
                        for d in document["devices"])
        return PreparedClaim(str(document["uid"]), str(document["namespace"]), str(document["name"]),
                             document["state"], devices, bool(document.get("shared", False)))


@dataclass
class Checkpoint:
    path: Path
    boot_id: str | None
    claims: dict[str, PreparedClaim] = field(default_factory=dict)

    def save(self) -> None:
        # atomic (a kill leaves the old file or the new), not fsynced: only a power loss would need that, and
        # after one the boot id differs and the record is dropped anyway
        write_json_atomic(self.path, {"format": FORMAT, "boot_id": self.boot_id,
                                      "claims": {uid: c.to_json() for uid, c in sorted(self.claims.items())}},
                          durable=False)

    def put(self, claim: PreparedClaim) -> None:
        self.claims[claim.uid] = claim
        self.save()

    def remove(self, uid: str) -> None:
        if self.claims.pop(uid, None) is not None:
            self.save()


def _parse(document: Any) -> tuple[str | None, dict[str, PreparedClaim]]:
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"not a {FORMAT} checkpoint (format: {found!r}; NVIDIA's plugin's checkpoint.json "
                         "is another file and format)")
    return document.get("boot_id"), {uid: PreparedClaim.from_json(c) for uid, c in document["claims"].items()}


def load(path: Path, boot_id: str | None) -> tuple[Checkpoint, CorruptFile | None, int]:
    """The checkpoint at path for this boot, what was wrong with the file (set aside), and how many claims
    of an earlier boot were dropped."""
    parsed, corrupt = read_json(path, _parse)
    checkpoint = Checkpoint(path, boot_id)
    if parsed is None:
        return checkpoint, corrupt, 0
    saved_boot, claims = parsed
    if boot_id is not None and saved_boot is not None and saved_boot != boot_id:
        log.info("checkpoint_from_earlier_boot", path=str(path), claims=len(claims), saved_boot_id=saved_boot,
                 boot_id=boot_id, consequence="its claims are dropped: the kubelet prepares them again")
        return checkpoint, None, len(claims)
    checkpoint.claims = claims
    return checkpoint, None, 0
