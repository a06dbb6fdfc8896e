"""health.auto_reset: a GPU whose driver asks for a reset is reset when nothing holds it, one GPU at a
time, each attempt drawn from the node's reset budget (gpud.health.reset_budget: at most
health.auto_reset_max_per_hour an hour, persisted, shared with remediations). Each attempt's result is
logged, counted and on the watch stream."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from gpud.base.logs import get_logger
from gpud.events import EventBus
from gpud.gpu_reset import ResetBlocked
from gpud.health.driver_actions import RESET_ACTIONS
from gpud.health.reset_budget import ResetBudget
from gpud.health.tracker import HealthTracker
from gpud.model.inventory import Gpu, Inventory
from gpud.model.named import Named

log = get_logger("health")


class AutoResetResult(Named):
    DONE = "done"
    REFUSED = "refused"  # something holds the GPU (ResetBlocked)
    FAILED = "failed"
    RATE_LIMITED = "rate-limited"


class AutoReset:
    def __init__(self, tracker: HealthTracker, bus: EventBus, budget: ResetBudget,
                 reset_gpu: Callable[[int, str], Awaitable[object]] | None):
        self._tracker = tracker
        self.bus = bus
        self.budget = budget
        self.reset_gpu = reset_gpu
        self.results: dict[str, int] = {}
        self._task: asyncio.Task | None = None
        self._last_said: tuple[str, str] | None = None

    def consider(self, inventory: Inventory) -> None:
        """One GPU at a time: the first whose driver asks for a reset, within the hourly limit."""
        if self.reset_gpu is None or (self._task and not self._task.done()):
            return
        wanting = [gpu for gpu in inventory.gpus if not gpu.lost
                   and self._tracker.driver_action(gpu.uuid) in RESET_ACTIONS]
        if not wanting:
            return
        gpu = wanting[0]
        if not self.budget.draw():
            self._said(gpu, AutoResetResult.RATE_LIMITED, f"{self.budget.used()} GPU resets in the last hour already "
                                                          "(health.auto_reset_max_per_hour, shared with "
                                                          "remediations): reset it by hand", once=True)
            return
        self._task = asyncio.ensure_future(self._reset(gpu))

    def stop(self) -> None:
        if self._task:
            self._task.cancel()

    async def _reset(self, gpu: Gpu) -> None:
        action = self._tracker.driver_action(gpu.uuid)
        log.warning("gpu_auto_reset", gpu=gpu.index, uuid=gpu.uuid, driver_action=action,
                    why="health.auto_reset: the driver asks for a GPU reset")
        try:
            await self.reset_gpu(gpu.index, f"the driver asks for a GPU reset ({action}): health.auto_reset")
        except Exception as exc:  # ResetBlocked (held, processes), OperationInProgress, ResetFailed, NVML down
            result = AutoResetResult.REFUSED if isinstance(exc, ResetBlocked) else AutoResetResult.FAILED
            self._said(gpu, result, str(exc))
            return
        self._said(gpu, AutoResetResult.DONE, "the GPU was reset")

    def _said(self, gpu: Gpu, result: AutoResetResult, message: str, once: bool = False) -> None:
        """Logged, counted and on the watch stream; `once`: only when it differs from the last said."""
        said = (gpu.uuid, result)
        if once and self._last_said == said:
            return
        self._last_said = said
        self.results[result] = self.results.get(result, 0) + 1
        (log.warning if result is AutoResetResult.DONE else log.error)(
            "gpu_auto_reset_result", gpu=gpu.index, uuid=gpu.uuid, result=result, message=message)
        self.bus.publish("health", {"device": gpu.uuid, "gpu_index": gpu.index, "auto_reset": result,
                                    "message": message, "cause": "health.auto_reset"})
