"""What the host's /proc says of a process: its command name and the cgroup that tells its owner.
gpud sees the PIDs NVML reports (the host's) only when it runs in the host's PID namespace."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpud.base.hostfile import PROC_LIST_BYTES, read_host_text
from gpud.processes.cgroup import CGROUPFS, UNKNOWN, Owner, owner_of

PROC = Path("/proc")


@dataclass(frozen=True)
class HostProcess:
    comm: str | None  # the kernel's command name (proc(5): at most 15 characters); None: gone or unreadable
    uid: int | None
    owner: Owner


def describe(pid: int, proc: Path = PROC, cgroupfs: Path = CGROUPFS) -> HostProcess:
    """A process that exited, or whose files cannot be read: all unknown, never an error. Its owner is
    read from its cgroup path and the owners of those cgroups' directories under `cgroupfs`."""
    base = proc / str(pid)
    try:
        comm = read_host_text(base / "comm", errors="replace").rstrip("\n")
        uid = base.stat().st_uid
        owner = owner_of(read_host_text(base / "cgroup", PROC_LIST_BYTES, errors="replace"), cgroupfs)
    except OSError:
        return HostProcess(None, None, UNKNOWN)
    return HostProcess(comm, uid, owner)
