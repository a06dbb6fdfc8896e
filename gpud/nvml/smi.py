"""nvidia-smi, read-only: runs the few listing commands gpud doctor compares NVML against, and parses them.

Only listing options ever run here: `nvidia-smi -q -x` (the full XML report), `nvidia-smi mig -lgip`
(the GPU-instance profile table) and `nvidia-smi -L`. None of them changes a GPU (nvidia-smi(1):
they are QUERY/LIST options, not DEVICE MODIFICATION options).

nvidia-smi's own documentation says its text output is not guaranteed to stay the same across
drivers (nvidia-smi(1), DESCRIPTION), so every parser here takes what it recognises and leaves
out what it does not, rather than failing on a new field.
"""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from gpud.base import child

READ_ONLY_COMMANDS = (("-q", "-x"), ("mig", "-lgip"), ("-L",))
_TIMEOUT_S = 60
_OUTPUT_CAP = 16 << 20  # nvidia-smi -q -x of 8 GPUs with MIG devices is some hundreds of KiB


class SmiError(RuntimeError):
    """nvidia-smi could not be run, failed, or printed something that is not its report."""


@dataclass(frozen=True)
class SmiMigDevice:
    index: int
    gpu_instance_id: int | None
    compute_instance_id: int | None
    memory_total_mib: int | None


@dataclass(frozen=True)
class SmiGpu:
    bus_id: str  # the <gpu id="..."> attribute: "00000000:00:06.0"
    name: str | None
    uuid: str | None
    minor_number: int | None
    mig_current: str | None  # "enabled" | "disabled"; None where nvidia-smi prints N/A (no MIG)
    mig_pending: str | None
    memory_total_mib: int | None
    mig_devices: tuple[SmiMigDevice, ...] = ()


@dataclass(frozen=True)
class SmiReport:
    driver_version: str | None
    cuda_version: str | None
    gpus: tuple[SmiGpu, ...]


@dataclass(frozen=True)
class SmiGiProfile:
    """One row of `nvidia-smi mig -lgip`."""
    gpu: int
    name: str  # "MIG 1g.10gb", as NVML's v2 profile info names it
    id: int
    free: int
    total: int
    memory_gib: float  # printed with two decimals: 9984 MiB -> 9.75
    p2p: bool
    sm_count: int


def find() -> str | None:
    """The nvidia-smi on PATH, or None."""
    return shutil.which("nvidia-smi")


def run(smi: str, args: tuple[str, ...]) -> str:
    """The output of one read-only nvidia-smi command; refuses anything else."""
    if args not in READ_ONLY_COMMANDS:
        raise ValueError(f"nvidia-smi {' '.join(args)} is not one of the read-only commands gpud runs")
    try:
        result = child.run_sync([smi, *args], timeout_s=_TIMEOUT_S, output_cap=_OUTPUT_CAP)
    except OSError as exc:
        raise SmiError(f"could not run {smi} {' '.join(args)}: {exc}") from None
    failure = result.failure(_TIMEOUT_S, _OUTPUT_CAP)
    if failure:
        raise SmiError(f"could not run {smi} {' '.join(args)}: {failure}")
    if result.exit_code != 0:
        output = result.text(2000).strip() or "no output"
        raise SmiError(f"{smi} {' '.join(args)} exited with {result.exit_code}: {output}")
    return result.stdout.decode(errors="replace")


# -- nvidia-smi -q -x ----------------------------------------------------------------------------


def parse_query_xml(text: str) -> SmiReport:
    """The parts of `nvidia-smi -q -x` gpud compares with NVML."""
    try:
        root = ET.fromstring(text.strip())
    except ET.ParseError as exc:
        raise SmiError(f"nvidia-smi -q -x printed something that is not XML: {exc}") from None
    if root.tag != "nvidia_smi_log":
        raise SmiError(f"nvidia-smi -q -x printed <{root.tag}>, not <nvidia_smi_log>")
    return SmiReport(driver_version=_text(root, "driver_version"), cuda_version=_text(root, "cuda_version"),
                     gpus=tuple(_gpu(element) for element in root.findall("gpu")))


def _gpu(element: ET.Element) -> SmiGpu:
    devices = element.find("mig_devices")
    return SmiGpu(
        bus_id=element.get("id", ""),
        name=_text(element, "product_name"),
        uuid=_text(element, "uuid"),
        minor_number=_int(_text(element, "minor_number")),
        mig_current=_mig_mode(_text(element, "mig_mode/current_mig")),
        mig_pending=_mig_mode(_text(element, "mig_mode/pending_mig")),
        memory_total_mib=_mib(_text(element, "fb_memory_usage/total")),
        mig_devices=tuple(_mig_device(d) for d in devices.findall("mig_device")) if devices is not None else (),
    )


def _mig_device(element: ET.Element) -> SmiMigDevice:
    return SmiMigDevice(index=_int(_text(element, "index")),
                        gpu_instance_id=_int(_text(element, "gpu_instance_id")),
                        compute_instance_id=_int(_text(element, "compute_instance_id")),
                        memory_total_mib=_mib(_text(element, "fb_memory_usage/total")))


def _text(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    value = found.text.strip() if found is not None and found.text else ""
    return value or None


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _mib(value: str | None) -> int | None:
    """"81559 MiB" -> 81559; "N/A" (a MIG GPU's used memory, a masked field) -> None."""
    match = re.fullmatch(r"(\d+) MiB", value or "")
    return int(match.group(1)) if match else None


def _mig_mode(value: str | None) -> str | None:
    return {"Enabled": "enabled", "Disabled": "disabled"}.get(value or "")


# -- nvidia-smi mig -lgip ------------------------------------------------------------------------

# |   0  MIG 1g.10gb         19     7/7        9.75       No     16     1     0   |
_LGIP_ROW = re.compile(r"^\|\s*(?P<gpu>\d+)\s+(?P<name>MIG\s+\S+)\s+(?P<id>\d+)\s+(?P<free>\d+)/(?P<total>\d+)\s+"
                       r"(?P<gib>\d+(?:\.\d+)?)\s+(?P<p2p>Yes|No)\s+(?P<sm>\d+)\s+\d+\s+\d+\s*\|$")


def parse_lgip(text: str) -> list[SmiGiProfile]:
    """Every profile row of `nvidia-smi mig -lgip`; [] for "No MIG-enabled devices found." and the like.

    Each profile takes two table lines: the first carries everything compared here (the second
    only CE/JPEG/OFA counts). Column widths differ between drivers, so rows are read by their
    fields, not their columns.
    """
    profiles = []
    for line in text.splitlines():
        match = _LGIP_ROW.match(line.strip())
        if match:
            profiles.append(SmiGiProfile(
                gpu=int(match["gpu"]), name=" ".join(match["name"].split()), id=int(match["id"]),
                free=int(match["free"]), total=int(match["total"]), memory_gib=float(match["gib"]),
                p2p=match["p2p"] == "Yes", sm_count=int(match["sm"])))
    return profiles
