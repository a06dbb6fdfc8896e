"""InfiniBand and RoCE ports (<sysfs>/class/infiniband/<device>/ports/<port>/) as health subjects of
their own, "ib:<device>/<port>" (gpud.health.collectors.infiniband writes them as node_exporter's
infiniband metrics).

The layout and the files' formats are the kernel's (Documentation/ABI/stable/sysfs-class-infiniband):
`state` "4: ACTIVE", `phys_state` "5: LinkUp", `rate` "400 Gb/sec (4X NDR)", `link_layer`
"InfiniBand" or "Ethernet" (RoCE), and the port's PMA counters under `counters/` (kernels before 4.5 put
the 64-bit ones in `counters_ext/`). sysfs is a parameter, as node_exporter's --path.sysfs, so tests and
containers read another tree.

Reading never raises for what a port says: a file missing, unreadable (EINVAL from `rate` on an unknown
speed, a directory where a file should be), not ASCII or not of its format reads as None, and a counter
that is not a number ("N/A (no PMA)" on iWARP devices, node_exporter issue 966) is left out. A check with
nothing to judge passes: no reading is no alarm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from gpud.base.hostfile import NotARegularFile, read_host_file

Problem = tuple[str, str, str] | None  # (severity, action, message), as gpud.health.checks
KIND = "infiniband"

# IBA port states (kernel ib_port_state, the number before the colon in `state`) and physical states
# (`phys_state`): the numbers are the standard's, the names differ across kernels, so only numbers judge.
STATE_ACTIVE = 4
PHYS_DISABLED = 3
PHYS_LINK_UP = 5

# Counter growth between two checks above which a check fails. infiniband-diags' own defaults
# (rdma-core infiniband-diags/etc/error_thresholds: SymbolErrorCounter=10, LinkErrorRecoveryCounter=10,
# PortRcvErrors=10) for the error counters; any link_downed growth counts, as each is a link that
# failed to recover and went down, which a running NCCL job feels (a QP error or a hang).
DEFAULT_ERROR_DELTAS: Mapping[str, int] = {
    "link-flapped": 0,
    "symbol-errors": 10,
    "receive-errors": 10,
    "link-error-recovery": 10,
}
# check code -> (counter file, what its growth means)
_COUNTER_CHECKS = {
    "link-flapped": ("link_downed", "link went down {n} times since the last check (flapping)"),
    "symbol-errors": ("symbol_error", "{n} symbol errors since the last check: a marginal cable or transceiver"),
    "receive-errors": ("port_rcv_errors", "{n} packets received with errors since the last check"),
    "link-error-recovery": ("link_error_recovery",
                            "the link retrained {n} times since the last check: a marginal cable or transceiver"),
}


@dataclass(frozen=True)
class IbPort:
    device: str
    port: int
    state: str | None  # "ACTIVE": the text after "N: "
    state_id: int | None
    phys_state: str | None  # "LinkUp"
    phys_state_id: int | None
    rate_gbps: float | None  # 400.0 from "400 Gb/sec (4X NDR)"
    link_layer: str | None  # "InfiniBand" or "Ethernet"
    # counter file name (counters/ and counters_ext/, whose names differ) -> value as the file says it:
    # port_rcv_data and port_xmit_data are in 4-byte words there; the metrics turn them into bytes.
    counters: Mapping[str, int] = field(default_factory=dict, hash=False)
    # "state: a FIFO, not a regular file": what is at a port's file names and cannot be read as one
    unreadable: tuple[str, ...] = ()

    @property
    def subject(self) -> str:
        return f"ib:{self.device}/{self.port}"


# ---------------------------------------------------------------------------------------------- reading

def read_ports(sysfs: Path) -> list[IbPort]:
    """Every port of every RDMA device, sorted by (device, port); [] without <sysfs>/class/infiniband."""
    ports = []
    for device_dir in _entries(Path(sysfs) / "class" / "infiniband"):
        for port_dir in _entries(device_dir / "ports"):
            if port_dir.name.isdigit():
                ports.append(_read_port(device_dir.name, int(port_dir.name), port_dir))
    return sorted(ports, key=lambda p: (p.device, p.port))


def _entries(directory: Path) -> list[Path]:
    try:
        return [entry for entry in directory.iterdir() if entry.is_dir()]
    except OSError:  # absent, not a directory, unreadable
        return []


def _read_port(device: str, number: int, path: Path) -> IbPort:
    unreadable: list[str] = []

    def read(file: Path) -> str | None:
        return _read_text(file, unreadable)

    state_id, state = _parse_state(read(path / "state"))
    phys_state_id, phys_state = _parse_state(read(path / "phys_state"))
    link_layer = read(path / "link_layer")
    counters: dict[str, int] = {}
    for directory in ("counters", "counters_ext"):
        for counter in _files(path / directory):
            text = read(counter)
            value = _parse_counter(text)
            if value is not None:
                counters[counter.name] = value
            elif text and text.isdigit():
                unreadable.append(f"{counter.name}: a number of {len(text)} digits, over 64 bits")
    return IbPort(device=device, port=number, state=state, state_id=state_id, phys_state=phys_state,
                  phys_state_id=phys_state_id, rate_gbps=_parse_rate(read(path / "rate")),
                  link_layer=link_layer or None, counters=counters, unreadable=tuple(unreadable))


def _files(directory: Path) -> list[Path]:
    """The names in a counters directory; a FIFO or a device there is listed, so that it is reported."""
    try:
        return sorted(entry for entry in directory.iterdir() if not entry.is_dir())
    except OSError:
        return []


def _read_text(path: Path, unreadable: list[str]) -> str | None:
    """The file's one line, or None where it cannot be read or is not ASCII (sysfs files are). Something
    other than a regular file at the name is noted in unreadable: it is not the kernel's."""
    try:
        raw = read_host_file(path)
    except NotARegularFile as exc:
        unreadable.append(f"{path.name}: {exc.strerror}")
        return None
    except OSError:  # missing, EINVAL from the driver, permission
        return None
    try:
        return raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None


def _parse_state(text: str | None) -> tuple[int | None, str | None]:
    """"4: ACTIVE" -> (4, "ACTIVE"); anything else -> (None, None)."""
    if text is None:
        return None, None
    number, colon, name = text.partition(":")
    number, name = number.strip(), name.strip()
    if not colon or not number.isdigit() or not name or ":" in name:
        return None, None
    return int(number), name


_RATE = re.compile(r"(\d+(?:\.\d+)?) Gb/sec\b")


def _parse_rate(text: str | None) -> float | None:
    """"400 Gb/sec (4X NDR)" -> 400.0, "2.5 Gb/sec (1X SDR)" -> 2.5."""
    match = _RATE.match(text or "")
    return float(match.group(1)) if match else None


# The kernel prints a port counter from a u64 at most (drivers/infiniband/core/sysfs.c show_pma_counter,
# "%llu"): a longer number is not the kernel's, and one that large breaks whatever renders it.
_COUNTER_DIGITS = len(str(2**64 - 1))


def _parse_counter(text: str | None) -> int | None:
    if text is None or not text.isdigit() or not text.isascii() or len(text) > _COUNTER_DIGITS:
        return None  # "N/A (no PMA)", empty, garbage, more than 64 bits
    value = int(text)
    return value if value < 2**64 else None


# ----------------------------------------------------------------------------------------------- health

@dataclass
class _Seen:
    counters: Mapping[str, int]
    ever_active: bool  # seen ACTIVE and LinkUp since gpud started


class IbHealth:
    """Keeps the previous reading of each port, so counters are judged by their deltas and a port that
    goes down is told from one that never came up."""

    def __init__(self, *, error_deltas: Mapping[str, int] | None = None) -> None:
        unknown = set(error_deltas or {}) - set(DEFAULT_ERROR_DELTAS)
        if unknown:
            raise ValueError(f"unknown InfiniBand checks {sorted(unknown)}; known: {sorted(DEFAULT_ERROR_DELTAS)}")
        self.error_deltas = {**DEFAULT_ERROR_DELTAS, **(error_deltas or {})}
        negative = sorted(code for code, limit in self.error_deltas.items() if limit < 0)
        if negative:
            raise ValueError(f"InfiniBand thresholds must be 0 or more: {negative}")
        self._seen: dict[str, _Seen] = {}

    def check(self, ports: Sequence[IbPort]) -> dict[str, dict[tuple[str, str], Problem]]:
        results = {}
        for port in ports:
            seen = self._seen.get(port.subject)
            active = port.state_id == STATE_ACTIVE and port.phys_state_id == PHYS_LINK_UP
            ever_active = active or (seen is not None and seen.ever_active)
            problems: dict[tuple[str, str], Problem] = {
                (KIND, "port-down"): _port_down(port, seen is not None and seen.ever_active)}
            for code, (counter, message) in _COUNTER_CHECKS.items():
                grown = _growth(port.counters.get(counter), seen.counters.get(counter) if seen else None)
                problems[(KIND, code)] = None if grown <= self.error_deltas[code] else \
                    ("degraded", "inspect-hardware", message.format(n=grown))
            problems[(KIND, "port-unreadable")] = None if not port.unreadable else (
                "degraded", "inspect-hardware",
                f"{port.device} port {port.port} cannot be judged whole: {'; '.join(port.unreadable[:4])}"
                f"{f' (and {len(port.unreadable) - 4} more)' if len(port.unreadable) > 4 else ''}: these "
                "are not the kernel's port files; check what is mounted over sysfs")
            results[port.subject] = problems
            self._seen[port.subject] = _Seen(dict(port.counters), ever_active)
        return results

    def forget(self, subject: str) -> None:
        """A port gone for good (its HCA removed): its next appearance starts afresh."""
        self._seen.pop(subject, None)


def _growth(now: int | None, before: int | None) -> int:
    """How much a counter grew. A counter lower than before was reset (HCA reset, driver reload,
    `perfquery -R`): the reading is a new baseline, not a delta. PMA error counters saturate at their
    maximum instead of wrapping (IBA), so a stuck maximum reads as no growth."""
    if now is None or before is None or now < before:
        return 0
    return now - before


def _port_down(port: IbPort, was_active: bool) -> Problem:
    if port.state_id is None or port.phys_state_id is None:
        return None  # nothing read to judge
    if port.phys_state_id == PHYS_DISABLED:
        return None  # an administrator disabled it (ibportstate, or a port without a cable kept off): a choice
    if port.state_id == STATE_ACTIVE and port.phys_state_id == PHYS_LINK_UP:
        return None
    what = f"{port.device} port {port.port} is {port.state} (physical state {port.phys_state})"
    if port.phys_state_id == PHYS_LINK_UP:
        hint = "the link is up but the port is not ACTIVE: check the subnet manager (`sminfo`) and `ibstat " \
               f"{port.device}`" if port.link_layer != "Ethernet" else \
               f"check the switch port's configuration and `ibstat {port.device}`"
    else:
        hint = f"check the cable, the switch port and `ibstat {port.device}`"
    if was_active:
        return "unhealthy", "inspect-hardware", f"{what}, down since it was ACTIVE: {hint}"
    # Never ACTIVE since gpud started: a port never cabled or a fabric still coming up, not a link lost
    # under a job; worth a look, not a drained node.
    return "degraded", "inspect-hardware", f"{what}, not ACTIVE since gpud started: {hint}"


# ------------------------------------------------------------------------------------ GPUDirect RDMA

# GPUDirect RDMA's kernel side is either the legacy nvidia-peermem module or DMA-BUF, which NVIDIA
# recommends and which needs no nvidia-peermem ("GPUDirect RDMA and GPUDirect Storage", GPU Operator
# documentation, docs.nvidia.com/datacenter/cloud-native/gpu-operator/latest/gpu-operator-rdma.html;
# NCCL detects and uses it by itself). DMA-BUF takes NVIDIA's open kernel modules (/proc/driver/nvidia/version
# says "Open Kernel Module", NVIDIA's kernel_open README) and RDMA dma-buf memory registration, in Linux
# since 5.12 (the requirement oneCCL's "Enabling OFI/verbs/dmabuf Support" states for the same path).
DMABUF_KERNEL = (5, 12)
PROC_MODULES_BYTES = 1 << 20  # a line per loaded module, some 60 bytes each


def peermem_problem(procfs: Path, ports: Sequence[IbPort]) -> str | None:
    """What keeps GPUDirect RDMA from working on a host with RDMA ports, or None: no RDMA port, the NVIDIA
    driver not loaded (another check says so), nvidia_peermem loaded, DMA-BUF available, or
    <procfs>/modules unreadable (no reading, no alarm)."""
    if not ports:
        return None
    try:
        text = read_host_file(Path(procfs) / "modules", PROC_MODULES_BYTES).decode()
        modules = {line.split(" ", 1)[0] for line in text.splitlines()}
    except (OSError, UnicodeDecodeError):
        return None
    if "nvidia" not in modules or "nvidia_peermem" in modules:
        return None
    open_modules = "Open Kernel Module" in (_read_text(Path(procfs) / "driver" / "nvidia" / "version", []) or "")
    kernel = _kernel_version(_read_text(Path(procfs) / "sys" / "kernel" / "osrelease", []))
    if open_modules and kernel is not None and kernel >= DMABUF_KERNEL:
        return None
    devices = ", ".join(sorted({port.device for port in ports}))
    why = ("the driver's proprietary kernel modules" if not open_modules else
           f"Linux {'.'.join(map(str, kernel))}" if kernel is not None else "an unknown kernel version")
    return (f"GPUDirect RDMA over {devices} needs the nvidia_peermem kernel module, which is not loaded, and "
            f"DMA-BUF (NVIDIA's open kernel modules on Linux 5.12 or later) is not available with {why}: "
            "run `modprobe nvidia-peermem` and list it in /etc/modules-load.d/ so it loads at boot")


def _kernel_version(release: str | None) -> tuple[int, int] | None:
    """"6.8.0-45-generic" -> (6, 8)."""
    match = re.match(r"(\d+)\.(\d+)", release or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


__all__ = ["DEFAULT_ERROR_DELTAS", "IbHealth", "IbPort", "Problem", "peermem_problem", "read_ports"]
