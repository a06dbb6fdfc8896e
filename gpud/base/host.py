"""What else on this host uses the GPUs: processes holding NVIDIA device nodes open, loaded modules.

A GPU reset (`nvidia-smi -r`) needs the GPU free of every client: nvidia-smi(1) under -r/--gpu-reset
says no application may use the device, monitoring tools included, and refuses otherwise with
"In use by another client" (quoted in NVIDIA/mig-parted issue #181). This module finds those
clients from /proc so gpud can say who they are and what to do before it tries, instead of after.
"""

from __future__ import annotations

import os
from collections.abc import Container, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpud.base.hostfile import PROC_LIST_BYTES, read_host_text

PROC = Path("/proc")
DEV = Path("/dev")


@dataclass(frozen=True)
class Holder:
    pid: int
    process: str  # /proc/<pid>/comm: the first 15 characters of the program name (proc(5))
    device: str  # the device path it holds open, e.g. "/dev/nvidia3"


def device_holders(device_paths: Iterable[str], *, exclude_pids: Container[int] = (),
                   proc: Path = PROC) -> list[Holder]:
    """Every process with one of these paths open, by its /proc/<pid>/fd links.

    Processes that vanish during the scan, or whose fds this user may not read (another user's
    process, for a non-root caller), are skipped: the scan reports what it can see.
    """
    wanted = _path_spellings(device_paths)
    holders = set()
    for pid in _pids(proc):
        if pid in exclude_pids:
            continue
        for device in _open_paths(proc / str(pid) / "fd") & wanted.keys():
            holders.add(Holder(pid, _process_name(proc / str(pid)), wanted[device]))
    return sorted(holders, key=lambda h: (h.device, h.pid))


def loaded_modules(proc: Path = PROC) -> set[str]:
    """Names of the loaded kernel modules (first column of /proc/modules); empty if unreadable."""
    try:
        lines = read_host_text(proc / "modules", PROC_LIST_BYTES).splitlines()
    except OSError:
        return set()
    return {line.split()[0] for line in lines if line.strip()}


# Per program (as /proc/<pid>/comm spells it, cut to 15 characters): what stops it holding the GPU.
_ADVICE = {
    # Persistence mode is an attachment to the device: the reset is refused while it is on
    # (NVIDIA/NVSentinel issue #1690; NVIDIA/gpu-operator issue #118).
    "nvidia-persiste": "stop it (systemctl stop nvidia-persistenced) or turn persistence mode off for this GPU "
                       "(nvidia-smi -pm 0 -i <GPU>), and restore it after the reset",
    # DCGM's host engine and its exporter keep NVML sessions open: mig-parted's default hooks stop
    # nvidia-dcgm and dcgm-exporter before a reset (NVIDIA/mig-parted deployments/systemd/hooks.sh
    # and hooks-default.yaml, pre-apply-mode).
    "nv-hostengine": "stop DCGM (systemctl stop nvidia-dcgm) and start it again after the reset",
    "dcgm-exporter": "stop dcgm-exporter (its service or pod) and start it again after the reset",
    # nvidia-cuda-mps-control and nvidia-cuda-mps-server share these 15 characters.
    "nvidia-cuda-mps": "stop the MPS daemon (echo quit | nvidia-cuda-mps-control, as the user that started it)",
    # nvidia-smi's reset message names Fabric Manager among the clients that block it.
    "nv-fabricmanage": "stop Fabric Manager (systemctl stop nvidia-fabricmanager) and start it again after the reset",
    "nvidia-smi": "let it finish or stop it (a monitoring loop such as nvidia-smi -l or dmon)",
    "Xorg": "stop the display server (systemctl stop display-manager)",
    "Xwayland": "stop the display server (systemctl stop display-manager)",
}
_UNKNOWN_ADVICE = "stop it, or wait for it to finish"
# nvidia_drm keeps the GPUs open from the kernel: resets fail with "In use by another client" even
# with no process left (NVIDIA/mig-parted issue #181, its README "Known Issues"; ComputeCanada/
# puppet-magic_castle issue #387).
_BLOCKING_MODULES = {
    "nvidia_drm": "kernel module nvidia_drm is loaded: it keeps the GPUs open, so nvidia-smi -r answers "
                  "'In use by another client'; unload it before the reset (rmmod nvidia_drm, after stopping "
                  "any display server) and load it again after",
}


def reset_blockers(minor: int, *, exclude_pids: Container[int] = (), proc: Path = PROC,
                   dev: Path = DEV) -> list[str]:
    """Why a reset of the GPU with this minor number would be refused now, one line each, with what to do."""
    if not isinstance(minor, int) or isinstance(minor, bool) or minor < 0:
        raise ValueError(f"a GPU minor number is an integer >= 0, not {minor!r}")
    device = str(dev / f"nvidia{minor}")
    holders = device_holders([device], exclude_pids=exclude_pids, proc=proc)
    return [describe_holder(h) for h in holders] + module_blockers(proc)


def module_blockers(proc: Path = PROC) -> list[str]:
    """The loaded kernel modules that keep every GPU from being reset, one line each with what to do."""
    modules = loaded_modules(proc)
    return [text for module, text in _BLOCKING_MODULES.items() if module in modules]


def describe_holder(holder: Holder) -> str:
    """'PID 1234 (nv-hostengine) holds /dev/nvidia3: stop DCGM (...)': who, and what to do about it."""
    advice = _ADVICE.get(holder.process[:15], _UNKNOWN_ADVICE)  # comm keeps 15 characters
    return f"PID {holder.pid} ({holder.process}) holds {holder.device}: {advice}"


def _path_spellings(paths: Iterable[str]) -> dict[str, str]:
    """Each path as given and as resolved (an fd link names the real file), mapped to the path as given."""
    spellings = {}
    for path in paths:
        spellings[os.path.realpath(path)] = str(path)
        spellings[str(path)] = str(path)
    return spellings


def _pids(proc: Path) -> list[int]:
    try:
        return [int(entry.name) for entry in os.scandir(proc) if entry.name.isdigit()]
    except OSError:
        return []


def _open_paths(fd_dir: Path) -> set[str]:
    """What this process's file descriptors point at; empty if it is gone or not ours to read."""
    try:
        fds = os.listdir(fd_dir)
    except OSError:  # vanished (FileNotFoundError, ProcessLookupError) or PermissionError
        return set()
    targets = set()
    for fd in fds:
        try:
            targets.add(os.readlink(fd_dir / fd))
        except OSError:  # the fd was closed, or the process exited, since the listing
            continue
    return targets


def _process_name(pid_dir: Path) -> str:
    try:
        return read_host_text(pid_dir / "comm").strip()
    except OSError:
        return "?"


def boot_id(procfs: Path) -> str:
    """The kernel's random id of this boot (proc(5) /proc/sys/kernel/random/boot_id); "" if unreadable.
    A simulated node's procfs has its own, which `sim reboot` changes."""
    try:
        return read_host_text(procfs / "sys" / "kernel" / "random" / "boot_id", encoding="ascii").strip()[:64]
    except (OSError, UnicodeDecodeError):
        return ""
