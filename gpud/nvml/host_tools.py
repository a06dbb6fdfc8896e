"""The host around the GPUs, as a GPU reset needs it: who blocks a reset, the reset itself, and
ending compute processes.

Two implementations of one small interface, chosen once in the daemon: `HostTools` for a real
node (/proc, `nvidia-smi -r`, signals) and `SimHostTools` for a simulated one, whose processes,
device holders and resets live in the simulator. Production code never asks which one it has.

Every method blocks (a /proc scan, a subprocess, a grace period): callers run them off the event
loop. None of them makes an NVML call through gpud's session: a reset runs while that session is
shut down.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from gpud.base import child, host
from gpud.base.errors import ErrorKind, GpudError
from gpud.base.hostfile import read_host_text
from gpud.model.inventory import Gpu

# `nvidia-smi -r` on an 8-GPU node takes seconds; one that hangs (a wedged GPU) must not hold the
# reset, and with it gpud's NVML session, for ever.
RESET_TIMEOUT_S = 120.0
END_GRACE_S = 10.0
RESET_OUTPUT_CAP = 1 << 20  # nvidia-smi -r prints a line per GPU


class ResetFailed(GpudError):
    """The reset was attempted and refused or failed: str() is what the tool said."""

    def __init__(self, said: str):
        super().__init__(ErrorKind.CONFLICT, "reset-failed",
                         f"{said}; gpud's NVML session is back, the GPUs are as the driver left them")
        self.said = said

    def __str__(self) -> str:
        return self.said


class HostTools:
    """A real node: blockers from /proc, resets through nvidia-smi, processes ended by signals."""

    def __init__(self, smi: str | None = None, reset_timeout_s: float = RESET_TIMEOUT_S):
        self._smi = smi
        self._reset_timeout_s = reset_timeout_s

    def blockers(self, gpu: Gpu, exclude_pids: Collection[int]) -> list[str]:
        """Why a reset of this GPU would be refused now, one line each with what to do."""
        if gpu.minor_number is None:
            # Without the minor number gpud cannot tell which /dev/nvidiaN to scan: refuse rather
            # than reset blind (nvml.h: the minor number is what names the device node).
            return [f"GPU {gpu.index}: its minor number is unknown, so gpud cannot check which processes "
                    f"hold /dev/nvidiaN; reset it by hand with nvidia-smi -r -i {gpu.pci_bus_id}"]
        return host.reset_blockers(gpu.minor_number, exclude_pids=exclude_pids)

    def fabric_manager_running(self) -> bool:
        """Whether nvidia-fabricmanager runs (/proc/<pid>/comm keeps 15 characters: proc(5))."""
        return _process_running("nv-fabricmanage")

    def reset(self, gpus: Sequence[Gpu]) -> str:
        """`nvidia-smi -r -i <bus id>,...`: every GPU in one command, as nvidia-smi(1) asks of GPUs
        that must be reset together. Returns what nvidia-smi printed; raises ResetFailed."""
        smi = self._smi or shutil.which("nvidia-smi")
        if smi is None:
            raise ResetFailed("nvidia-smi is not installed: gpud resets GPUs with nvidia-smi -r")
        ids = ",".join(gpu.pci_bus_id for gpu in gpus)
        command = [smi, "-r", "-i", ids]
        try:
            result = child.run_sync(command, timeout_s=self._reset_timeout_s, output_cap=RESET_OUTPUT_CAP)
        except OSError as exc:
            raise ResetFailed(f"cannot run {smi}: {exc.strerror or exc}") from None
        failure = result.failure(self._reset_timeout_s, RESET_OUTPUT_CAP)
        if failure:
            raise ResetFailed(f"{' '.join(command)}: {failure}")
        output = result.text().strip()
        if result.exit_code != 0:
            raise ResetFailed(f"{' '.join(command)} failed (exit status {result.exit_code}): {output[:2000]}")
        return output

    def end_processes(self, device_uuid: str, pids: Collection[int], grace_s: float = END_GRACE_S) -> None:
        """SIGTERM, then SIGKILL to whatever is left after the grace period."""
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        for pid in pids:
            _signal(pid, signal.SIGKILL)


class SimHostTools:
    """A simulated node: the simulator's holders, its `nvidia-smi -r`, its processes.

    Simulated processes are not host processes: they are never signalled.
    """

    def __init__(self, nvml: Any):
        self._nvml = nvml

    def blockers(self, gpu: Gpu, exclude_pids: Collection[int]) -> list[str]:
        node = f"/dev/nvidia{gpu.minor_number}" if gpu.minor_number is not None else f"GPU {gpu.index}"
        return [host.describe_holder(host.Holder(pid, process, node))
                for pid, process in self._nvml.sim_holders(gpu.index) if pid not in exclude_pids]

    def fabric_manager_running(self) -> bool:
        return self._nvml.sim_fabric_manager_running()

    def reset(self, gpus: Sequence[Gpu]) -> str:
        try:
            self._nvml.sim_reset_gpu([gpu.index for gpu in gpus])
        except self._nvml.NVMLError as exc:
            raise ResetFailed(f"the simulated nvidia-smi -r refused: {exc}") from None
        return f"GPU reset of {', '.join(gpu.pci_bus_id for gpu in gpus)} done (simulated)"

    def end_processes(self, device_uuid: str, pids: Collection[int], grace_s: float = END_GRACE_S) -> None:
        self._nvml.sim_set_processes(device_uuid, [])


def host_tools_for(nvml: Any, simulated: bool) -> HostTools | SimHostTools:
    return SimHostTools(nvml) if simulated else HostTools()


def _process_running(name: str, proc: Path = Path("/proc")) -> bool:
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            try:
                if read_host_text(Path(entry.path) / "comm").strip() == name:
                    return True
            except OSError:  # gone since the listing
                continue
    return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
