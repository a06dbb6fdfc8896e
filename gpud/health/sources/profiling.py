"""Each GPU's and GPU instance's profiling metrics (GPM, Hopper and later), every profiling interval, on
the NVML thread as the readings are: /metrics serves the last ones and never waits on NVML."""

from __future__ import annotations

import asyncio

from gpud.base.logs import get_logger
from gpud.health.dcgm_fields import instance_devices
from gpud.inventory import InventoryService
from gpud.model.inventory import Inventory
from gpud.nvml.gpm import GpmSampler, GpmTarget, Profile
from gpud.nvml.session import NvmlSession, NvmlUnavailable

log = get_logger("health")


def gpm_targets(inventory: Inventory) -> list[GpmTarget]:
    """Every GPU that answers, and each of its GPU instances (by the MIG device the framebuffer series name
    it by): DCGM samples a GPU instance that has compute instances only (DcgmGpmManager.cpp
    MaybeFetchNewSample: "GPU-I has no child GPU-CIs ... No data available"), and an instance without one
    has no MIG device."""
    return [target for gpu in inventory.gpus if not gpu.lost
            for target in [GpmTarget(gpu.uuid, gpu.uuid)] + [GpmTarget(dev.uuid, gpu.uuid, dev.gi_id)
                                                              for dev in instance_devices(gpu)]]


class GpmProfiling:
    def __init__(self, session: NvmlSession, inventory: InventoryService, *, interval_s: float):
        self.session = session
        self.inventory = inventory
        self.interval_s = interval_s
        self.sampler = GpmSampler()
        self.profiles: dict[str, Profile] = {}  # GPU or MIG device UUID -> its metrics over the last interval
        # A GPU reset shuts NVML down: the kept samples are freed first, and sampling starts over after.
        session.on_release(self._free_samples, self._forget)

    async def run(self) -> None:
        while True:
            await self.sample_once()
            await asyncio.sleep(self.interval_s)

    async def sample_once(self) -> None:
        inventory = self.inventory.current
        if inventory is None:
            return
        try:
            self.profiles = await self.session.call(self.sampler.sample, gpm_targets(inventory))
        except Exception as exc:  # NVML unavailable (the inventory and /healthz say so), or a shape unforeseen
            log.warning("profiling_failed", error=str(exc), retry_in_s=self.interval_s)
            self.profiles = {}

    async def stop(self) -> None:
        try:
            await self.session.call(self.sampler.free_all)
        except NvmlUnavailable:
            pass  # NVML is gone, and the samples with it

    async def _free_samples(self) -> None:
        """NVML is released already (calls through the session wait): freed from a worker thread, as the
        event thread frees its event set."""
        await asyncio.to_thread(self.sampler.free_all, self.session.nvml)

    def _forget(self) -> None:
        self.profiles = {}
