"""A remediation on request (POST /v1/gpus/{id}/remediate, asked by `gpud k8s-agent` or `gpud slurm health`
once nothing uses the GPU): the GPU is reset when its health asks for one, never forced, then checked.

- What the GPU needs: where the driver reports a recovery action (R565 and later), the driver says whether
  a reset or a reboot mends it (NVIDIA's "Error Recovery and Response Flags"); else the XID catalog's action.
  So an XID 48 whose driver asks for a GPU reset is reset, though the catalog says reboot for drivers that
  say nothing. A reboot or a hardware inspection is refused: a reset does not mend it.
- The reset draws from the node's reset budget (gpud.health.reset_budget, shared with health.auto_reset),
  only once nothing refuses it: a reset refused because something holds the GPU spends nothing.
- The check: DCGM's diagnostic level 1 on the GPU where dcgmi is found (gpud.health.active_check, not
  forced), else gpud's read-back: the GPU in a fresh inventory and not lost, healthy (and its MIG
  devices) after a fresh health pass, and no XID on it since the remediation began (but those the catalog
  calls info, such as XID 154, the driver saying its recovery action changed).

Each remediation is logged (gpu_remediation), counted (gpud_gpu_remediations_total{result}) and published
on the watch stream (a health event with `remediation`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Iterable

from gpud.base.errors import ErrorKind, GpudError
from gpud.base.lifecycle import Component
from gpud.base.logs import get_logger
from gpud.base.samples import Family
from gpud.events import EventType
from gpud.gpu_reset import GpuResetter, ResetBlocked
from gpud.health.active_check import ActiveCheck
from gpud.health.catalog import Severity
from gpud.health.diag import find_dcgmi
from gpud.health.driver_actions import REBOOT_ACTIONS
from gpud.health.driver_actions import remedy as gpu_remedy
from gpud.health.service import HealthService
from gpud.health.states import Action, Health
from gpud.model.inventory import Gpu
from gpud.model.named import Named

log = get_logger("health")
CHECK_LEVEL = 1  # dcgmi diag -r 1: the quick one, seconds


class RemediationResult(Named):
    PASSED = "passed"  # reset, and the check passed
    FAILED = "failed"  # the check failed, or the reset did
    BLOCKED = "blocked"  # something holds the GPU: nothing was reset
    NEEDS_REBOOT = "needs-reboot"
    NEEDS_INSPECTION = "needs-inspection"
    BUDGET_SPENT = "budget-spent"
    NOT_NEEDED = "not-needed"  # no reset needed, and the check passed


class CheckHow(Named):
    DCGM = f"dcgm-diag-{CHECK_LEVEL}"
    READ_BACK = "read-back"


class RemediationRefused(GpudError):
    """A remediation refused before anything was done, with its result."""

    def __init__(self, result: RemediationResult, kind: ErrorKind, code: str, message: str, **details: object):
        super().__init__(kind, code, message, **details)
        self.result = result


class Remediation(Component):
    name = "remediation"

    def __init__(self, health: HealthService, resetter: GpuResetter, active_check: ActiveCheck):
        self._health = health
        self._resetter = resetter
        self._active_check = active_check
        self.budget = health.reset_budget
        self.results = {result.value: 0 for result in RemediationResult}
        self._running = asyncio.Lock()

    async def remediate(self, gpu: Gpu, requester: str | None) -> dict:
        """The remediation's answer; GpudError when it was refused (RemediationRefused, ResetBlocked, or
        the reset's own errors), having done nothing but a failed reset."""
        if self._running.locked():
            raise GpudError(ErrorKind.CONFLICT, "remediation-in-progress",
                            "a remediation is running already: ask again once it is done")
        async with self._running:
            began = time.monotonic()
            try:
                reset = await self._reset_if_needed(gpu, requester)
            except Exception as exc:
                result = exc.result if isinstance(exc, RemediationRefused) \
                    else RemediationResult.BLOCKED if isinstance(exc, ResetBlocked) else RemediationResult.FAILED
                self._said(gpu, requester, result, getattr(exc, "message", None) or str(exc))
                raise
            check = await self._check(gpu, began)
        action = self._health.tracker.worst_action(gpu)
        result = (RemediationResult.FAILED if not check["passed"] else
                  RemediationResult.PASSED if reset is not None else RemediationResult.NOT_NEEDED)
        self._said(gpu, requester, result, "; ".join(check["problems"]) or f"the {check['how']} check passed",
                   reset=reset is not None, check=check["how"], action=action)
        return {"gpu": gpu.index, "uuid": gpu.uuid, "requester": requester, "reset": reset, "check": check,
                "action": action}

    # -- the reset ---------------------------------------------------------------------------------

    async def _reset_if_needed(self, gpu: Gpu, requester: str | None) -> dict | None:
        if not self._needs_reset(gpu):
            return None
        self._refuse_unless_budget()
        outcome = await self._resetter.reset_gpus([gpu.index], why=f"remediation asked by {requester or 'the API'}",
                                                  trying=self._draw)
        return outcome.as_dict()

    def _needs_reset(self, gpu: Gpu) -> bool:
        """Whether the GPU's health asks for a reset; RemediationRefused when it asks for more."""
        tracker = self._health.tracker
        action = tracker.worst_action(gpu)
        remedy = gpu_remedy(action, tracker.driver_action(gpu.uuid))
        if remedy == Action.INSPECT_HARDWARE:
            raise RemediationRefused(RemediationResult.NEEDS_INSPECTION, ErrorKind.CONFLICT, "needs-inspection",
                                     f"GPU {gpu.index} needs its hardware inspected (GET /v1/gpus/{gpu.index}/health "
                                     "says why): a reset does not mend it. Nothing was done", action=action)
        if remedy == Action.REBOOT:
            driver = tracker.driver_action(gpu.uuid)
            said = f"the driver's recovery action is {driver}" if driver in REBOOT_ACTIONS else "its health says so"
            raise RemediationRefused(RemediationResult.NEEDS_REBOOT, ErrorKind.CONFLICT, "needs-reboot",
                                     f"GPU {gpu.index} needs a node reboot ({said}): a reset does not mend it. "
                                     "Nothing was done", action=action)
        return remedy == Action.RESET_GPU

    def _refuse_unless_budget(self) -> None:
        free_in = self.budget.next_free_in_s()
        if free_in is not None:
            raise RemediationRefused(
                RemediationResult.BUDGET_SPENT, ErrorKind.RATE_LIMITED, "reset-budget-spent",
                f"{self.budget.used()} GPU resets in the last hour already (health.auto_reset_max_per_hour: "
                f"{self.budget.max_per_hour}, shared with health.auto_reset): the next one in {free_in:.0f} s. "
                "Nothing was done", retry_after_s=round(free_in, 1))

    def _draw(self) -> None:
        """The resetter's go-ahead: the budget is drawn now that nothing refuses the reset (an automatic
        reset may have drawn the last of it meanwhile)."""
        if not self.budget.draw():
            self._refuse_unless_budget()

    # -- the check ---------------------------------------------------------------------------------

    async def _check(self, gpu: Gpu, began: float) -> dict:
        how = CheckHow.DCGM if find_dcgmi(self._health.settings.dcgmi) else CheckHow.READ_BACK
        inventory = await self._health.inventory.refresh("remediation check")
        now = inventory.find_gpu(gpu.uuid) if inventory is not None else None
        if now is None:
            problems = ["the GPU is not in a fresh read of the node"
                        + (f" (NVML: {self._health.session.error})" if self._health.session.error else "")]
        elif now.lost:
            problems = [f"the GPU is lost{f': {now.error}' if now.error else ''}"]
        else:
            await self._health.check_once()  # a fresh health pass: the driver's recovery action read again
            problems = await self._dcgm_problems(now) if how == CheckHow.DCGM else self._read_back_problems(now, began)
        return {"how": how.value, "passed": not problems, "problems": problems}

    async def _dcgm_problems(self, gpu: Gpu) -> list[str]:
        try:
            run = await self._active_check.run(CHECK_LEVEL, False, [gpu.index])
        except GpudError as exc:  # a run in progress, processes on the GPU: no verdict, no pass
            return [f"DCGM's diagnostic did not run: {exc.message}"]
        problems = [f"DCGM diag -r {CHECK_LEVEL}: test {test['name']} {test['result']}"
                    + (f": {test['info']}" if test["info"] else "")
                    for test in run["tests"] if test["result"] in ("fail", "warn")
                    and test["gpu_index"] in (gpu.index, None)]
        if run["error"]:
            problems.append(run["error"])
        if run["outcome"] != "pass" and not problems:
            problems.append(f"DCGM diag -r {CHECK_LEVEL}: {run['outcome']}")
        return problems

    def _read_back_problems(self, gpu: Gpu, began: float) -> list[str]:
        tracker, problems = self._health.tracker, []
        for uuid in (gpu.uuid, *(device.uuid for device in gpu.mig.devices)):
            view = tracker.device(uuid)
            if view["state"] != Health.HEALTHY:
                what = "the GPU" if uuid == gpu.uuid else f"MIG device {uuid}"
                problems.append(f"{what} is {view['state']}: " + "; ".join(r["message"] for r in view["reasons"]))
                if uuid == gpu.uuid:  # its MIG devices carry its reasons too: said once
                    break
        catalog = self._health.catalog
        since = sorted({xid for uuid, xid, at in self._health.xids.recent
                        if uuid == gpu.uuid and at >= began and catalog.info(xid).severity != Severity.INFO})
        if since:
            problems.append(f"XID {', '.join(map(str, since))} on the GPU since the remediation began")
        return problems

    # -- what is said ------------------------------------------------------------------------------

    def _said(self, gpu: Gpu, requester: str | None, result: RemediationResult, message: str,
              **details: object) -> None:
        self.results[result.value] += 1
        level = log.info if result in (RemediationResult.PASSED, RemediationResult.NOT_NEEDED) else log.warning
        level("gpu_remediation", gpu=gpu.index, uuid=gpu.uuid, requester=requester, result=result,
              message=message, **details)
        self._health.bus.publish(EventType.HEALTH, {"device": gpu.uuid, "gpu_index": gpu.index, "remediation": result,
                                                    "requester": requester, "message": message,
                                                    "cause": "remediation"})

    def collect(self) -> Iterable[Family]:
        remediations = Family("gpud_gpu_remediations_total", "GPU remediations (POST /v1/gpus/{id}/remediate), "
                                                             "by result.", "counter")
        for result, count in self.results.items():
            remediations.add({"result": result}, count)
        yield remediations
