"""A client process's loops (the device plugin's, the DRA plugin's), run until SIGTERM or SIGINT, or until one
of them fails: then the rest are cancelled, and the process exits non-zero so that systemd or the DaemonSet
restarts it. And `within`, the one way gpud's loops wait with a time limit."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # its backport, which aiohttp requires on 3.10 as well
    from async_timeout import timeout

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float | None) -> T:
    """awaitable's result, or asyncio.TimeoutError once `seconds` have passed (None: no limit).

    Not asyncio.wait_for: before Python 3.12 it awaits in a second task, and when that task ends in the
    same loop turn as a cancellation of the caller, it hands back the task's result or error instead of
    the CancelledError (python/cpython#86296, gone with 3.12's rewrite on asyncio.timeout,
    python/cpython#98518). A loop calling it carries on as if never cancelled, and a stop that cancels it
    once waits for it for ever: a Kubernetes watch cancelled as its connection closed did so (CI, 3.11).
    This awaits in the caller's own task, where a cancellation always arrives."""
    async with timeout(seconds):
        return await awaitable


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
