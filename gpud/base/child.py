"""Running a program gpud needs (scontrol, dcgmi, nvidia-smi, systemctl, ldconfig, MPS control, MIG
hooks): one deadline over the whole exchange and one cap on what it may print.

Reading a child's output whole let one that floods grow gpud by gigabytes (scontrol 1.78 GB in one
reconfigure), and a deadline on the wait alone let one that trickles outlive it. Here the child
starts in a process group of its own; its input is written, and its output read, as it comes, by
one selector loop that ends at the deadline or as soon as the output passes the cap; then the whole
group is killed (a grandchild holding the pipes included) and reaped. The caller gets a ChildRun
saying what happened, never an exception for what the child did; OSError only where it could not
start. The loop is synchronous (no asyncio: the CLI and `gpud slurm health` use it, and start fast);
`run` runs it on a thread for the event loop, stopping the child when the caller is cancelled. For the
same reason asyncio, the thread pool and typing are imported only by what uses them.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
import time
from collections import namedtuple

TYPE_CHECKING = False
if TYPE_CHECKING:
    import concurrent.futures
    from collections.abc import Mapping, Sequence

DEFAULT_OUTPUT_CAP = 1 << 20  # 1 MiB: every tool gpud runs answers in kilobytes
READ_CHUNK = 65536
REAP_S = 5.0  # after SIGKILL of its group: a child still not reaped by then is left, and said
# Threads of their own for children waited on from the event loop: a dcgmi diagnostic can run for
# half an hour, and in the default pool (a few threads on a small machine) it would hold back every
# other piece of work gpud moves off the loop.
_children: concurrent.futures.ThreadPoolExecutor | None = None
_children_made = threading.Lock()


class ChildRun(namedtuple("ChildRun", "argv exit_code stdout stderr elapsed_s timed_out overflowed cancelled",
                          defaults=(False, False, False))):
    """argv: a tuple; exit_code: None when gpud killed it (deadline, cap, cancelled); stdout: at most
    the cap, stdout and stderr together when merged; stderr: b"" when it went into stdout; overflowed:
    it printed more than the cap, was killed and the rest left unread."""

    __slots__ = ()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def text(self, limit: int | None = None) -> str:
        """stdout then stderr, decoded, cut to limit characters with a marker."""
        text = (self.stdout + self.stderr).decode("utf-8", "replace")
        return text if limit is None or len(text) <= limit else text[:limit] + " ... (cut)"

    def failure(self, timeout_s: float, cap: int) -> str | None:
        """Why the run did not complete, in words, or None when it exited by itself."""
        name = os.path.basename(self.argv[0]) if self.argv else "the program"
        if self.timed_out:
            return f"{name} did not finish within {timeout_s:g} s; gpud killed it and its process group"
        if self.overflowed:
            return f"{name} printed more than {cap} bytes; gpud stopped reading and killed it"
        if self.cancelled:
            return f"{name} was stopped: gpud no longer waited for it"
        return None


def run_sync(argv: Sequence[str], *, timeout_s: float, output_cap: int = DEFAULT_OUTPUT_CAP,
             stdin: bytes | None = None, merge_stderr: bool = False, env: Mapping[str, str] | None = None,
             shell: bool = False, stop: threading.Event | None = None, **spawn) -> ChildRun:
    """Runs argv (a command line when shell) to its end, its deadline or its cap. `spawn`: Popen's
    identity arguments (user, group, extra_groups). OSError when it cannot start."""
    started = time.monotonic()
    deadline = started + timeout_s
    process = subprocess.Popen(
        argv if not shell else argv[0], shell=shell, env=None if env is None else dict(env),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, start_new_session=True, **spawn)
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    timed_out = overflowed = cancelled = False
    with selectors.DefaultSelector() as selector:
        for name in ("stdout", "stderr"):
            stream = getattr(process, name)
            if stream is not None:
                os.set_blocking(stream.fileno(), False)
                selector.register(stream, selectors.EVENT_READ, name)
        pending = memoryview(stdin or b"")
        if process.stdin is not None:
            os.set_blocking(process.stdin.fileno(), False)
            if pending:
                selector.register(process.stdin, selectors.EVENT_WRITE, "stdin")
            else:
                process.stdin.close()
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if stop is not None and stop.is_set():
                cancelled = True
                break
            for key, _ in selector.select(min(left, 0.1 if stop is not None else left)):
                if key.data == "stdin":
                    try:
                        written = os.write(key.fd, pending[:READ_CHUNK])
                    except BlockingIOError:
                        continue
                    except OSError:  # EPIPE: it stopped reading; its output says why
                        written = len(pending)
                    pending = pending[written:]
                    if not pending:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
                    continue
                try:
                    chunk = os.read(key.fd, READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                room = output_cap - len(kept["stdout"]) - len(kept["stderr"])
                kept[key.data] += chunk[:max(room, 0)]
                if len(chunk) > room:
                    overflowed = True
                    break
            if overflowed:
                break
    exit_code = None
    if timed_out or overflowed or cancelled:
        _kill_group(process)
    else:
        try:
            exit_code = process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:  # closed its output, still running
            timed_out = True
            _kill_group(process)
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None and not stream.closed:
            stream.close()
    return ChildRun(tuple(argv), exit_code, bytes(kept["stdout"]), bytes(kept["stderr"]),
                    time.monotonic() - started, timed_out, overflowed, cancelled)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone, or it changed identity (setuid): its own pid
        try:
            process.kill()
        except ProcessLookupError:
            pass
    try:
        process.wait(REAP_S)
    except subprocess.TimeoutExpired:
        pass


def _children_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _children
    with _children_made:
        if _children is None:
            import concurrent.futures

            _children = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="child")
        return _children


async def run(argv: Sequence[str], **options) -> ChildRun:
    """run_sync on a thread of the children's pool, for the event loop: a cancelled caller stops the
    child (killed with its group) before the cancellation goes on."""
    import asyncio
    import functools

    stop = threading.Event()
    call = functools.partial(run_sync, argv, stop=stop, **options)
    running = asyncio.get_running_loop().run_in_executor(_children_pool(), call)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.gather(running, return_exceptions=True)
        raise
