"""The one NVML session of the daemon: loads a backend, initialises it with back-off, runs calls.

NVML calls block (a MIG create can take a second), so they all run on one dedicated thread and
never on the event loop. One thread also means NVML sees calls in a single, predictable order.

A GPU reset needs the GPU free of every NVML client, gpud's own session and event sets included
(nvidia-smi(1), "-r": "there can't be any applications using these devices"). `released()` shuts
NVML down for the length of such an operation: calls made meanwhile wait for NVML to come back
instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib
import inspect
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar, Union

from gpud.base.lifecycle import Component
from gpud.base.logs import get_logger
from gpud.model.driver import MINIMUM_BRANCH, driver_problem

T = TypeVar("T")
log = get_logger("nvml")
ReleaseHook = Callable[[], Union[None, Awaitable[None]]]


class SessionState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    UNAVAILABLE = "unavailable"
    RELEASED = "released"  # shut down on purpose (a GPU reset); calls wait for it to come back
    STOPPED = "stopped"


# nvml.h NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM detects a driver/library version mismatch"
LIB_RM_VERSION_MISMATCH = 18
# Said wherever the real NVML cannot start: the way to try gpud on a machine without a GPU.
NO_GPU_HINT = "no NVIDIA GPU or driver here? try gpud on a simulated node: gpud serve --simulate dgx-a100"


class NvmlUnavailable(RuntimeError):
    """NVML is not initialised (no driver yet, an unsupported driver, or gpud is stopping)."""


class UnsupportedDriver(RuntimeError):
    """NVML initialised, but the driver is older than gpud supports."""


def load_backend(simulate: str | None, sim_state: Path | None, driver: str | None = None) -> tuple[Any, bool]:
    """The pynvml module itself, or a simulated node offering the same surface (behaving as the
    given driver version, or the simulator's default); and whether it is the simulated node."""
    if simulate:
        from gpud.nvml.sim import SimulatedNvml

        return SimulatedNvml(simulate, sim_state, driver=driver), True
    return importlib.import_module("pynvml"), False


def describe_error(exc: BaseException) -> str:
    """'Driver Not Loaded (NVML error 9)' for NVML errors, the plain text for anything else."""
    code = getattr(exc, "value", None)
    return f"{exc} (NVML error {code})" if isinstance(code, int) else str(exc) or type(exc).__name__


class NvmlSession(Component):
    name = "nvml"

    def __init__(self, backend: Any, *, simulated: bool = False, retry_initial_s: float = 1.0,
                 retry_max_s: float = 60.0):
        self.nvml = backend
        self.simulated = simulated  # the simulator stands in for pynvml: faults can be injected
        self.state = SessionState.STARTING
        self.error: str | None = None
        self.driver_version: str | None = None  # as the driver reported it at the last nvmlInit
        self.init_attempts = 0
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")
        self._release_hooks: list[tuple[ReleaseHook, ReleaseHook]] = []
        self._release_lock = asyncio.Lock()
        self._back = asyncio.Event()  # set except while released: what waiting calls wait for
        self._back.set()
        self._reinit_task: asyncio.Task | None = None

    @property
    def backend_name(self) -> str:
        return "simulated" if self.simulated else "nvml"

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn(*args) on the NVML thread. fn receives the backend module as its first argument.
        While NVML is released for a GPU reset, waits until it is back."""
        while self.state is SessionState.RELEASED:
            await self._back.wait()
        if self.state is not SessionState.READY:
            raise NvmlUnavailable(self.error or f"NVML is {self.state.value}")
        return await self._on_nvml_thread(fn, self.nvml, *args)

    async def _on_nvml_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- initialisation --------------------------------------------------------------------------

    async def initialise(self) -> None:
        """Tries nvmlInit until it succeeds on a supported driver, doubling the pause between
        attempts up to the maximum. An unsupported driver waits the maximum between attempts: only
        an operator's upgrade changes it."""
        delay = self._retry_initial_s
        while True:
            self.init_attempts += 1
            try:
                await self._init_once()
            except UnsupportedDriver as exc:
                self._unavailable(str(exc), log.error, "nvml_driver_unsupported", self._retry_max_s)
                await asyncio.sleep(self._retry_max_s)
                continue
            except Exception as exc:  # NVMLError, OSError from ctypes, a bad simulator state file
                hint = "" if self.simulated else f" ({NO_GPU_HINT})"
                if getattr(exc, "value", None) == LIB_RM_VERSION_MISMATCH:
                    hint = (": the kernel module and the user-space driver are of different versions, an unfinished "
                            "driver upgrade; GET /v1/health's node reason names both; reboot to finish it")
                self._unavailable(f"NVML initialisation failed: {describe_error(exc)}{hint}", log.error,
                                  "nvml_init_failed", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)
                continue
            log.info("nvml_ready", backend=self.backend_name, attempts=self.init_attempts,
                     driver=self.driver_version)
            return

    async def _init_once(self) -> None:
        """nvmlInit, then the driver check; READY when both pass. Raises UnsupportedDriver (with
        NVML shut down again) for a driver older than gpud supports."""
        await self._on_nvml_thread(self.nvml.nvmlInit)
        try:
            version = await self._on_nvml_thread(_driver_version, self.nvml)
        except Exception:
            await self._shutdown_quietly()
            raise
        self.driver_version = version
        problem = driver_problem(version)
        if problem is not None:
            await self._shutdown_quietly()
            raise UnsupportedDriver(problem)
        self.state, self.error = SessionState.READY, None

    def _unavailable(self, error: str, level: Callable[..., Any], event: str, retry_in_s: float) -> None:
        # Log the first failure and a few after it, not every attempt of a long outage.
        if self.state is not SessionState.UNAVAILABLE or self.init_attempts in (2, 5) or self.init_attempts % 20 == 0:
            level(event, error=error, attempt=self.init_attempts, retry_in_s=round(retry_in_s, 2),
                  backend=self.backend_name, minimum_driver_branch=MINIMUM_BRANCH)
        self.state, self.error = SessionState.UNAVAILABLE, error

    async def _shutdown_quietly(self) -> None:
        try:
            await self._on_nvml_thread(self.nvml.nvmlShutdown)
        except Exception as exc:
            log.warning("nvml_shutdown_failed", error=describe_error(exc))

    # -- release for GPU resets ------------------------------------------------------------------

    def on_release(self, before: ReleaseHook, after: ReleaseHook) -> None:
        """`before` runs (sync or async) before NVML shuts down for a release, `after` once it is
        back. Whoever calls NVML outside `call` (the health event thread) stops and restarts here."""
        self._release_hooks.append((before, after))

    @contextlib.asynccontextmanager
    async def released(self, reason: str) -> AsyncIterator[None]:
        """NVML shut down for the body (a GPU reset). Calls through `call` wait until it is back.
        One release at a time; raises NvmlUnavailable when NVML is not ready to begin with."""
        async with self._release_lock:
            if self.state is not SessionState.READY:
                raise NvmlUnavailable(self.error or f"NVML is {self.state.value}")
            self.state, self.error = SessionState.RELEASED, f"NVML is released for a {reason}; back shortly"
            self._back.clear()
            log.info("nvml_releasing", reason=reason)
            shut_down = False
            try:
                for before, _after in self._release_hooks:
                    await _run_hook(before)
                await self._on_nvml_thread(self.nvml.nvmlShutdown)
                shut_down = True
                yield
            finally:
                await self._come_back(reason, shut_down)

    async def _come_back(self, reason: str, shut_down: bool) -> None:
        """nvmlInit after a release, then the `after` hooks; waiting calls go on. If NVML does not
        come back, the session is UNAVAILABLE and keeps trying in the background."""
        try:
            if shut_down:  # nvmlInit counts references: only undo a shutdown that happened
                await self._init_once()
            else:
                self.state, self.error = SessionState.READY, None
        except Exception as exc:
            self.state, self.error = SessionState.UNAVAILABLE, f"NVML did not come back after a {reason}: " \
                                                                f"{describe_error(exc)}"
            log.error("nvml_not_back", reason=reason, error=describe_error(exc))
            self._back.set()  # waiting calls fail now instead of waiting for ever
            self._reinit_task = asyncio.create_task(self._initialise_then_resume(), name="nvml-reinit")
            return
        self._back.set()
        log.info("nvml_back", reason=reason)
        await self._run_after_hooks()

    async def _initialise_then_resume(self) -> None:
        await self.initialise()
        await self._run_after_hooks()

    async def _run_after_hooks(self) -> None:
        for _before, after in self._release_hooks:
            try:
                await _run_hook(after)
            except Exception as exc:  # one hook failing must not keep the others from running
                log.error("nvml_release_hook_failed", hook=getattr(after, "__qualname__", repr(after)),
                          error=describe_error(exc))

    async def stop(self) -> None:
        was_ready = self.state is SessionState.READY
        self.state = SessionState.STOPPED
        self._back.set()
        if self._reinit_task is not None:
            self._reinit_task.cancel()
            await asyncio.gather(self._reinit_task, return_exceptions=True)
        if was_ready:
            await self._shutdown_quietly()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _driver_version(nvml: Any) -> str:
    version = nvml.nvmlSystemGetDriverVersion()
    return version.decode(errors="replace") if isinstance(version, bytes) else str(version)


async def _run_hook(hook: ReleaseHook) -> None:
    result = hook()
    if inspect.isawaitable(result):
        await result
