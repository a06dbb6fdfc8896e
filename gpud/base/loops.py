"""A client process's loops (the device plugin's, the DRA plugin's), run until SIGTERM or SIGINT, or until one
of them fails: then the rest are cancelled, and the process exits non-zero so that systemd or the DaemonSet
restarts it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any


def stop_on_signals() -> asyncio.Event:
    """An event SIGTERM and SIGINT set, from now on (before the process's start-up work, so that a stop asked
    during it is a clean one)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def run_until_stopped(loops: list[Coroutine[Any, Any, Any]], stop: asyncio.Event, log: Any,
                            failed_event: str) -> bool:
    """Runs the loops until `stop` is set or one of them ends; cancels the others. True when one failed (each
    failure is logged as `failed_event`)."""
    tasks = [asyncio.create_task(loop) for loop in loops]
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
    for task in [*tasks, stopping]:
        task.cancel()
    failed = False
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            try:
                await task
            except Exception as exc:  # a loop died: exit non-zero
                failed = True
                log.exception(failed_event, error=repr(exc))
    return failed
