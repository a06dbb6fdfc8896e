"""Which sharing config is in force, and keeping the sharing document and the GPUs' time slice to it:
at start, on a reload, on PUT /v1/sharing/config, and when sharing.configs_dir changes.

Reading a config (YAML, some seconds for a file of hundreds of KiB) and looking at the directory
(thousands of names) run on a thread, never on the event loop: every client waited on them there.
One change at a time (the lock), so SharingConfigs is never used by two threads at once."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from gpud.base.lifecycle import Component, Tasks
from gpud.config import SharingFileConfig
from gpud.inventory import InventoryService
from gpud.sharing.configs import POLL_INTERVAL_S, SharingConfigs
from gpud.sharing.service import SharingView

Converge = Callable[[str], Awaitable[None]]  # brings gpud's MPS daemons to what sharing asks for


class SharingControl(Component):
    name = "sharing"

    def __init__(self, configs: SharingConfigs, view: SharingView, inventory: InventoryService,
                 converge_mps: Converge):
        self.configs, self.view, self.inventory = configs, view, inventory
        self._converge_mps = converge_mps
        self._changes = asyncio.Lock()  # a choice, a reload and the directory's poll take turns

    async def start(self, tasks: Tasks) -> None:
        """Chooses the config in force (an invalid one raises SharingConfigError: gpud does not start)."""
        await asyncio.to_thread(self.configs.load)
        await asyncio.to_thread(self.configs.select, at_start=True)
        configs = self.configs
        self.view.set_config(configs.config, None, configs.in_force.path, configs.view(), "start")
        tasks.spawn(self._follow_configs_dir(), "sharing-configs")

    async def start_with_gpus(self, tasks: Tasks) -> None:
        await self.view.apply_time_slice(self.inventory.current)

    def problems(self) -> list[str]:
        return [file.message() for file in self.configs.corrupt_files]

    async def reload(self, settings: SharingFileConfig) -> None:
        """Takes re-read settings: the config in force is chosen again (sharing.file, or a named config)."""
        async with self._changes:
            self.configs.configure(settings.file, settings.configs_dir, settings.default_config)
            await asyncio.to_thread(self.configs.select, at_start=False)
            await self._apply("reload")

    async def choose(self, name: str | None, reason: str | None) -> dict:
        """PUT /v1/sharing/config: makes `name` (None: the default) the config in force, persisted, and
        applies it as a reload does; returns the `config` block. Refusals (GpudError) change nothing."""
        async with self._changes:
            await asyncio.to_thread(self.configs.choose, name, reason)  # read once, and selected
            await self._apply("config chosen")
            view = self.configs.view()  # under the lock: a poll's thread may select next
        await self._converge_mps("sharing config chosen")
        return view

    async def _follow_configs_dir(self) -> None:
        """Re-applies the named config in force when its file changes (a ConfigMap update swaps ..data)
        or the directory's names do, without a reload: a stat and a listing every POLL_INTERVAL_S."""
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            async with self._changes:
                if not await asyncio.to_thread(self.configs.changed):
                    continue
                await asyncio.to_thread(self.configs.select, at_start=False)
                await self._apply("configs_dir changed")
            await self._converge_mps("sharing config changed")

    async def _apply(self, reason: str) -> None:
        """The sharing document recomputed from the config in force, and its time slice applied."""
        configs, inventory = self.configs, self.inventory.current
        self.view.set_config(configs.config, inventory, configs.in_force.path, configs.view(), reason)
        await self.view.apply_time_slice(inventory)
