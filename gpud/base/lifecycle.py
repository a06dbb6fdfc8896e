"""Components and their lifecycle: one ordered list, started in order and stopped in reverse.

Every part of gpud the daemon runs is a Component. Its constructor only keeps what it is given (no file,
socket, lock or task); `start` does what needs no GPU, `start_with_gpus` what needs NVML up and the first
inventory read, `stop` undoes `start`. The daemon lists its components once; `Lifecycle` runs them, as
aiohttp's cleanup contexts (https://docs.aiohttp.org/en/stable/web_advanced.html#cleanup-context) and uvicorn's
startup / serve / shutdown phases (uvicorn/server.py) do: a start that fails stops what was started, in reverse.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Coroutine, Iterable

from gpud.base.logs import get_logger
from gpud.base.samples import Family

log = get_logger("lifecycle")


class Tasks:
    """The background tasks of the components: each runs as long as gpud does; one that raises is said
    loudly and in /healthz (a bug: what it keeps current stays as it was until gpud restarts)."""

    def __init__(self):
        self._running: list[asyncio.Task] = []
        self.crashed: dict[str, str] = {}  # task name -> what it raised

    def spawn(self, coroutine: Coroutine, name: str) -> None:
        task = asyncio.create_task(coroutine, name=name)
        task.add_done_callback(self._ended)
        self._running.append(task)

    def _ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        self.crashed[task.get_name()] = f"{type(error).__name__}: {error}"
        log.error("background_task_crashed", task=task.get_name(), error=self.crashed[task.get_name()],
                  consequence="what it keeps current stays as it was until gpud restarts", exc_info=error)

    def problems(self) -> list[str]:
        return [f"gpud's {name} task stopped ({error}): a bug; restart gpud" for name, error in self.crashed.items()]

    async def cancel(self) -> None:
        """Cancels them all, the last spawned first, and waits for each to end."""
        for task in reversed(self._running):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._running.clear()


class Component:
    """One part of gpud in the daemon's list. Each method is optional; the defaults do nothing."""

    name = ""

    async def start(self, tasks: Tasks) -> None:
        """Before NVML is up (the API answers 503 meanwhile): claims, files, loops that need no GPU."""

    async def start_with_gpus(self, tasks: Tasks) -> None:
        """Once NVML is up and the first inventory is read, in the list's order."""

    async def stop(self) -> None:
        """Undoes start; the background tasks are cancelled before any component stops."""

    def problems(self) -> list[str]:
        """What /healthz reports as degraded because of this component (state gpud could not use...)."""
        return []

    def collect(self) -> Iterable[Family]:
        """Its Prometheus samples."""
        return ()


class Lifecycle:
    """Runs the components of `components` in order. `gpus_ready` brings NVML up and reads the first
    inventory; until it has, only the components' `start` has run."""

    def __init__(self, components: list[Component], gpus_ready: Callable[[], Awaitable[None]]):
        self.components = components
        self.tasks = Tasks()
        self._gpus_ready = gpus_ready
        self._started: list[Component] = []

    async def start(self) -> None:
        """Starts each in order; when one raises, those started are stopped (in reverse) and it is raised.
        Then brings the GPUs up in the background, and starts each with its GPUs, in order."""
        for component in self.components:
            try:
                await component.start(self.tasks)
            except BaseException:
                await self.stop()
                raise
            self._started.append(component)
        self.tasks.spawn(self._start_with_gpus(), "node")

    async def _start_with_gpus(self) -> None:
        await self._gpus_ready()
        for component in self._started:
            await component.start_with_gpus(self.tasks)

    async def stop(self) -> None:
        await self.tasks.cancel()
        for component in reversed(self._started):
            await component.stop()
        self._started.clear()

    def problems(self) -> list[str]:
        found = [problem for component in self.components for problem in component.problems()]
        return found + self.tasks.problems()
