"""The NVIDIA driver a simulated node runs: its version strings and the branch behaviour they select."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import SimError
from .models import DriverBranch, catalog, version_tuple

# "535.183.01", "550.54.14", "580.159.04", "570.86": major.minor[.patch] as nvidia-smi prints it.
_VERSION = re.compile(r"^\d{3}\.\d{2,3}(\.\d{2})?$")


@dataclass(frozen=True)
class Driver:
    version: str
    branch: DriverBranch

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return version_tuple(self.version)

    @property
    def nvml_version(self) -> str:
        # nvmlSystemGetNVMLVersion: the NVML major, then the driver version ("13.580.159.04" on 580).
        return f"{self.branch.nvml_major}.{self.version}"

    def has_function(self, name: str) -> bool:
        added_in = catalog().functions_added_in.get(name)
        return added_in is None or self.major >= added_in

    def has_field(self, field_id: int) -> bool:
        """Whether nvmlDeviceGetFieldValues knows this field id (models.yaml fields_added_in)."""
        added_in = catalog().fields_added_in.get(field_id)
        return added_in is None or self.major >= added_in

    def takes_fabric_info_version(self, version: int) -> bool:
        added_in = catalog().fabric_info_versions_added_in.get(version)
        return added_in is not None and self.major >= added_in

    @property
    def has_recovery_action(self) -> bool:
        """The driver keeps a GPU recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) and logs Xid 154
        when it changes: both arrived with R565 (NVML change log v560 -> v565)."""
        return self.has_field(230)


def parse_driver(version: str | None) -> Driver:
    """The driver for a version string; None means the catalogue's default driver."""
    if version is None:
        version = catalog().default_driver
    if not isinstance(version, str) or not _VERSION.match(version.strip()):
        raise SimError(f"driver version {version!r} is not NNN.NN[.NN] (e.g. 535.183.01, 580.65.06)")
    version = version.strip()
    major = int(version.split(".")[0])
    branches = catalog().branches
    # Behaves like the highest branch at or below its major; anything older like the oldest branch.
    key = max((key for key in branches if key <= major), default=min(branches))
    return Driver(version, branches[key])
