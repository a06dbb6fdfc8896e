"""What the simulator asks the host about its processes: whether a PID still names the process it did."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def start_time(pid: int, proc: Path = PROC) -> int | None:
    """The process's start time in clock ticks after boot (proc(5), /proc/<pid>/stat field 22), which
    tells a process from a later one given the same PID; None when no such process runs. A zombie
    (state Z or X, field 3) has exited: only its parent has not collected its status yet."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:  # gone, or never was
        return None
    # comm (field 2) may hold spaces and parentheses: the fields after it follow the last ") ".
    fields = stat.rsplit(") ", 1)[-1].split()
    try:
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (IndexError, ValueError):
        return None
