"""The simulator's own control surface (sim_*): fault injection and the outside world."""

from __future__ import annotations

import pynvml
from pynvml import NVML_ERROR_IN_USE, NVMLError

from ._core import SimCore, sim_control
from .errors import SimError
from .events import NOT_ATTRIBUTED, Event, GpuLost
from .state import Gpu, MigDevice


def _validated_pids(pids: list[int]) -> list[int]:
    if not all(isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 for pid in pids):
        raise SimError(f"pids must be positive integers, got {pids!r}")
    return list(pids)


class SimControls(SimCore):
    @sim_control
    def sim_resolve(self, gpu: int | str) -> int:
        """The index of a GPU given by index or GPU UUID."""
        if isinstance(gpu, int) and not isinstance(gpu, bool) and 0 <= gpu < len(self._gpus):
            return gpu
        for candidate in self._gpus:
            if candidate.uuid == gpu:
                return candidate.index
        raise SimError(f"no GPU {gpu!r}: give an index 0..{len(self._gpus) - 1} or a GPU UUID")

    @sim_control
    def sim_inject_xid(
        self, gpu: int | str, xid: int, gi_id: int | None = None, ci_id: int | None = None
    ) -> None:
        """Deliver an Xid event, attributed to a GI/CI when given, to every set that wants it."""
        target = self._target(gpu)
        if not isinstance(xid, int) or xid < 0:
            raise SimError(f"an Xid is a non-negative integer, got {xid!r}")
        self._check_instance_ids(target, gi_id, ci_id)
        self._publish(
            Event(
                target.index,
                pynvml.nvmlEventTypeXidCriticalError,
                xid,
                NOT_ATTRIBUTED if gi_id is None else gi_id,
                NOT_ATTRIBUTED if ci_id is None else ci_id,
            )
        )

    @sim_control
    def sim_inject_ecc(self, gpu: int | str, double_bit: bool) -> None:
        """Count one ECC error and deliver its event; a double-bit error also remaps a row."""
        target = self._target(gpu)
        if not target.model.ecc:
            raise SimError(f"GPU {target.index} ({target.model.name}) has no ECC memory")
        target.ecc.record(double_bit)
        if double_bit and target.model.row_remapping:
            target.remapped_rows.uncorrectable += 1
            target.remapped_rows.pending = True  # applied by the next reset
        self._commit()
        event_type = (
            pynvml.nvmlEventTypeDoubleBitEccError if double_bit else pynvml.nvmlEventTypeSingleBitEccError
        )
        self._publish(Event(target.index, event_type))

    @sim_control
    def sim_set_gpu_lost(self, gpu: int | str) -> None:
        """The GPU fell off the bus: its handles raise GpuIsLost until `sim_reset_gpu`."""
        target = self._target(gpu)
        if target.lost:
            return
        target.lost = True
        self._commit()
        self._publish(GpuLost(target.index))

    @sim_control
    def sim_set_processes(self, target: int | str, pids: list[int]) -> None:
        """Replace the compute processes of a GPU (index or UUID) or of a MIG device (MIG UUID)."""
        pids = _validated_pids(pids)
        if isinstance(target, str) and target.startswith("MIG-"):
            self._mig_device_by_uuid(target).compute_instance.processes = pids
        else:
            gpu = self._target(target)
            if gpu.mig_enabled:
                raise SimError(
                    f"GPU {gpu.index} is in MIG mode: processes run on MIG devices, pass a MIG UUID"
                )
            gpu.processes = pids
        self._commit()

    @sim_control
    def sim_reset_gpu(self, gpu: int | str) -> None:
        """What `nvidia-smi -r` does.

        Refuses with NVMLError_InUse while processes run. Otherwise applies a pending MIG mode,
        recovers a lost GPU, clears the volatile ECC counters and applies pending row remaps.
        All GPU and compute instances are destroyed, whether the MIG mode changes or not: MIG
        instances are driver state that does not survive a GPU reset.
        """
        target = self._target(gpu)
        if target.running_processes():
            raise NVMLError(NVML_ERROR_IN_USE)
        target.gpu_instances.clear()
        target.mig_current = target.mig_pending
        target.lost = False
        target.ecc.clear_volatile()
        target.remapped_rows.pending = False
        target.retired_pages_pending = False
        target.nvlinks_down.clear()  # link training runs again
        self._commit()

    @sim_control
    def sim_set_nvlink(self, gpu: int | str, link: int, up: bool) -> None:
        """Takes an NVLink link down (or brings it back), as a failed link or cable would."""
        target = self._target(gpu)
        if not 0 <= link < target.model.nvlinks:
            raise SimError(f"GPU {target.index} ({target.model.name}) has no NVLink link {link} "
                           f"(it has {target.model.nvlinks})")
        down = set(target.nvlinks_down) - {link} if up else set(target.nvlinks_down) | {link}
        target.nvlinks_down = sorted(down)
        self._commit()

    @sim_control
    def sim_add_pcie_replays(self, gpu: int | str, count: int) -> None:
        """Adds PCIe replays to the GPU's counter, as a marginal link would."""
        if count < 0:
            raise SimError("a replay counter only grows")
        self._target(gpu).pcie_replays += count
        self._commit()

    @sim_control
    def sim_set_retired_pages_pending(self, gpu: int | str) -> None:
        """Marks a page retirement pending (pre-Ampere GPUs); a reset applies it."""
        target = self._target(gpu)
        if not target.model.page_retirement:
            raise SimError(f"GPU {target.index} ({target.model.name}) has no page retirement")
        target.retired_pages_pending = True
        self._commit()

    # --- helpers --------------------------------------------------------------------------------

    def _target(self, gpu: int | str) -> Gpu:
        return self._gpus[self.sim_resolve(gpu)]

    def _mig_device_by_uuid(self, uuid: str) -> MigDevice:
        for gpu in self._gpus:
            for mig_device in gpu.mig_devices():
                if mig_device.compute_instance.uuid == uuid:
                    return mig_device
        raise SimError(f"no MIG device {uuid!r}")

    @staticmethod
    def _check_instance_ids(gpu: Gpu, gi_id: int | None, ci_id: int | None) -> None:
        if gi_id is None:
            if ci_id is not None:
                raise SimError("a compute instance id needs its GPU instance id")
            return
        gi = gpu.gpu_instances.get(gi_id)
        if gi is None:
            raise SimError(f"GPU {gpu.index} has no GPU instance {gi_id}")
        if ci_id is not None and ci_id not in gi.compute_instances:
            raise SimError(f"GPU instance {gi_id} of GPU {gpu.index} has no compute instance {ci_id}")
