"""The MIG mode of a dynamic MIG GPU: switched on for its first claim's device only while no process uses
the GPU, through a GPU reset where the GPU needs one (Ampere) and mig.allow_gpu_reset lets gpud do it;
switched off after its last device only where that needs no reset (Hopper and later), so the whole GPU
is usable again. NVIDIA's DRA driver does the same (kubernetes-sigs/dra-driver-nvidia-gpu
cmd/gpu-kubelet-plugin/nvlib.go: maybeEnableMigMode, maybeDisableMigMode, supportsMIGModeToggle)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gpud.base.errors import ErrorKind, GpudError
from gpud.base.logs import get_logger
from gpud.gpu_reset import GpuResetter, ResetBlocked
from gpud.inventory import InventoryService
from gpud.mig.dynamic_view import pids_line
from gpud.mig.status import ModeOutcome
from gpud.mig.sync import resets_to_change_mode
from gpud.model.inventory import Gpu, Inventory
from gpud.nvml import mig as nvml_mig
from gpud.nvml.host_tools import ResetFailed
from gpud.nvml.reset import compute_pids
from gpud.nvml.session import NvmlSession, describe_error

log = get_logger("mig")

Restore = Callable[..., Awaitable[None]]  # MigInstances.restore_after_reset


class DynamicMode:
    def __init__(self, session: NvmlSession, resetter: GpuResetter, *, allow_reset: bool, restore: Restore):
        self.session = session
        self.resetter = resetter
        self._allow_reset = allow_reset  # mig.allow_gpu_reset
        self._restore = restore  # the instances a reset took from the GPU's NVLink peers come back

    async def refuse_busy(self, gpus: list[Gpu], names: dict[int, str]) -> None:
        """Refuses, before any change, to switch on the MIG mode of a GPU processes compute on."""
        busy = []
        for gpu in gpus:
            if not _enabled(gpu):
                pids = await self.session.call(compute_pids, gpu.index)
                if pids:
                    busy.append((gpu, pids))
        if busy:
            raise GpudError(ErrorKind.CONFLICT, "gpu-in-use",
                            "; ".join(f"GPU {gpu.index} ({gpu.uuid}) is not in MIG mode and runs "
                                      f"{pids_line(pids, names)}" for gpu, pids in busy)
                            + ": its MIG mode is switched on only while no process uses it; nothing was changed",
                            busy=[{"gpu": gpu.index, "uuid": gpu.uuid, "pids": list(pids),
                                   "names": [names.get(pid) for pid in pids]} for gpu, pids in busy])

    async def enable(self, gpu: Gpu, inventory: InventoryService) -> Gpu:
        """The GPU, as read after its MIG mode is on (at once when it already is)."""
        current = next(g for g in (await inventory.refresh("dynamic MIG mode")).gpus if g.uuid == gpu.uuid)
        if _enabled(current):
            return current
        outcome = ModeOutcome(await self.session.call(nvml_mig.set_mig_mode, gpu.index, True))
        log.info("dynamic_mig_mode_set", gpu=gpu.index, uuid=gpu.uuid, enabled=True, outcome=outcome.value)
        if outcome == ModeOutcome.ACTIVE and resets_to_change_mode(gpu):
            # nvml.h, nvmlDeviceSetMigMode: it "may unbind or reset the device to activate the requested mode"
            log.warning("gpu_reset_by_driver", gpu=gpu.index, why="MIG mode change on an idle Ampere GPU")
            self.resetter.after_gpu_reset(gpu.uuid)
        elif outcome == ModeOutcome.NEEDS_RESET and self._allow_reset:
            await self._reset(gpu)
        elif outcome != ModeOutcome.ACTIVE:
            await self._take_back(gpu)
            why = "the driver applies it only at a reboot (this platform exposes no GPU reset)" \
                if outcome == ModeOutcome.NEEDS_REBOOT else \
                "it waits for a GPU reset, which mig.allow_gpu_reset: false leaves to the operator"
            raise GpudError(ErrorKind.CONFLICT, "reset-required",
                            f"GPU {gpu.index} ({gpu.uuid}) could not be switched to MIG mode: {why}; nothing was "
                            f"changed. Enable it once (nvidia-smi -i {gpu.index} -mig 1, then nvidia-smi -r -i "
                            f"{gpu.index}) for its dynamic MIG devices")
        after = next(g for g in (await inventory.refresh("dynamic MIG mode set")).gpus if g.uuid == gpu.uuid)
        if not _enabled(after):
            raise GpudError(ErrorKind.FAILED, "mode-not-changed",
                            f"GPU {gpu.index} ({gpu.uuid}) is not in MIG mode after it was switched on "
                            f"(mode {after.mig.mode}, pending {after.mig.pending_mode})")
        return after

    async def _reset(self, gpu: Gpu) -> None:
        """As a MIG apply does (gpud.mig.apply): the reset the pending mode waits for, with the NVLink peers
        it takes; their instances come back."""
        async def restore(reset: tuple[Gpu, ...], after: Inventory) -> None:
            await self._restore(reset, after, skip={gpu.uuid})

        try:
            await self.resetter.reset([gpu.index], "MIG mode switched on for a dynamic MIG device (Ampere)",
                                      restore=restore)
        except ResetBlocked as exc:
            await self._take_back(gpu)
            raise GpudError(ErrorKind.CONFLICT, "reset-blocked",
                            f"GPU {gpu.index} ({gpu.uuid}) needs a GPU reset to enter MIG mode, and {exc}; "
                            "nothing was changed") from None
        except ResetFailed as exc:
            await self._take_back(gpu)
            raise GpudError(ErrorKind.FAILED, "reset-failed",
                            f"GPU {gpu.index} ({gpu.uuid}): the reset that enters MIG mode failed: {exc}") from None

    async def _take_back(self, gpu: Gpu) -> None:
        """A pending mode change is taken back (that needs no reset): the GPU is left as it was."""
        try:
            await self.session.call(nvml_mig.set_mig_mode, gpu.index, False)
        except Exception as exc:
            log.error("dynamic_mig_mode_not_taken_back", gpu=gpu.index, error=describe_error(exc))

    async def disable_if_idle(self, gpu: Gpu) -> None:
        """Leaves MIG mode when the GPU holds no instance and that needs no reset; a refusal is logged only
        (the GPU stays in MIG mode, empty, until its next claim)."""
        if gpu.mig.mode != "enabled" or gpu.mig.instances or resets_to_change_mode(gpu):
            return
        try:
            outcome = await self.session.call(nvml_mig.set_mig_mode, gpu.index, False)
            log.info("dynamic_mig_mode_set", gpu=gpu.index, uuid=gpu.uuid, enabled=False, outcome=outcome)
        except Exception as exc:
            log.warning("dynamic_mig_mode_left_on", gpu=gpu.index, uuid=gpu.uuid, error=describe_error(exc))


def _enabled(gpu: Gpu) -> bool:
    return gpu.mig.mode == "enabled" and gpu.mig.pending_mode == "enabled"
