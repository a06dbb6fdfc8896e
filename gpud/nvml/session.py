"""The one NVML session of the daemon: loads a backend, initialises it with back-off, runs calls.

NVML calls block (a MIG create can take a second), so they all run on one dedicated thread and
never on the event loop. One thread also means NVML sees calls in a single, predictable order.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from gpud.logs import get_logger

T = TypeVar("T")
log = get_logger("nvml")


class SessionState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    UNAVAILABLE = "unavailable"
    STOPPED = "stopped"


class NvmlUnavailable(RuntimeError):
    """NVML is not initialised (no driver yet, or gpud is stopping)."""


def load_backend(simulate: str | None, sim_state: Path | None) -> Any:
    """The pynvml module itself, or a simulated node offering the same surface."""
    if simulate:
        from gpud.nvml.sim import SimulatedNvml

        return SimulatedNvml(simulate, sim_state)
    return importlib.import_module("pynvml")


def describe_error(exc: BaseException) -> str:
    """'Driver Not Loaded (NVML error 9)' for NVML errors, the plain text for anything else."""
    code = getattr(exc, "value", None)
    return f"{exc} (NVML error {code})" if isinstance(code, int) else str(exc) or type(exc).__name__


class NvmlSession:
    def __init__(self, backend: Any, *, retry_initial_s: float = 1.0, retry_max_s: float = 60.0):
        self.nvml = backend
        self.simulated = hasattr(backend, "sim_inject_xid")
        self.state = SessionState.STARTING
        self.error: str | None = None
        self.init_attempts = 0
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")

    @property
    def backend_name(self) -> str:
        return "simulated" if self.simulated else "nvml"

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn(*args) on the NVML thread. fn receives the backend module as its first argument."""
        if self.state is not SessionState.READY:
            raise NvmlUnavailable(self.error or f"NVML is {self.state.value}")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, self.nvml, *args)

    async def initialise(self) -> None:
        """Tries nvmlInit until it succeeds, doubling the pause between attempts up to the maximum."""
        delay = self._retry_initial_s
        loop = asyncio.get_running_loop()
        while True:
            self.init_attempts += 1
            try:
                await loop.run_in_executor(self._executor, self.nvml.nvmlInit)
            except Exception as exc:  # NVMLError, OSError from ctypes, a bad simulator state file
                self.error = f"NVML initialisation failed: {describe_error(exc)}"
                if self.state is not SessionState.UNAVAILABLE or self.init_attempts in (2, 5) or \
                        self.init_attempts % 20 == 0:
                    log.error("nvml_init_failed", error=describe_error(exc), attempt=self.init_attempts,
                              retry_in_s=round(delay, 2), backend=self.backend_name)
                self.state = SessionState.UNAVAILABLE
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)
                continue
            self.state, self.error = SessionState.READY, None
            log.info("nvml_ready", backend=self.backend_name, attempts=self.init_attempts)
            return

    async def close(self) -> None:
        was_ready = self.state is SessionState.READY
        self.state = SessionState.STOPPED
        if was_ready:
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor, self.nvml.nvmlShutdown)
            except Exception as exc:
                log.warning("nvml_shutdown_failed", error=describe_error(exc))
        self._executor.shutdown(wait=False, cancel_futures=True)
