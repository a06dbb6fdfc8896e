"""One NVIDIA MPS control daemon (`nvidia-cuda-mps-control`), driven through its own client mode.

The control daemon is started with `-d`, so it daemonizes and outlives gpud: a gpud restart,
reload or crash never takes MPS away from running clients. Commands go the way NVIDIA documents
them: the same binary without arguments, the command on its stdin, in the daemon's environment.
"""

from __future__ import annotations

import asyncio
import errno
import os
import pwd
import select
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from gpud.base import child
from gpud.base.hostfile import PROC_LIST_BYTES, read_host_file, read_host_text
from gpud.base.safefs import UnsafePath, secure_directory

# What nvidia-cuda-mps-control answers to one command (get_server_list: a PID per line), and prints when
# it starts as a daemon (nothing): more is not read.
CONTROL_OUTPUT_CAP = 1 << 20


# Debian ships nvidia-cuda-mps in non-free, which a fresh Debian 12 lacks in both forms of apt's sources
# (sources.list(5): one-line and deb822): "E: Unable to locate package" until it is added.
INSTALL_HINT = ("Debian: add non-free to Components: in /etc/apt/sources.list.d/debian.sources (or to the deb "
                "line of /etc/apt/sources.list), apt-get update, apt-get install nvidia-cuda-mps; "
                "or set mps.control_binary")


class MpsError(Exception):
    """Something the MPS control daemon, or starting it, did not do."""


class MpsBinaryMissing(MpsError):
    pass


@dataclass(frozen=True)
class MpsDirectories:
    pipe: Path  # CUDA_MPS_PIPE_DIRECTORY: the control socket clients connect through
    log: Path  # CUDA_MPS_LOG_DIRECTORY: control.log and server.log


class MpsControl:
    def __init__(self, binary: str, directories: MpsDirectories, visible_devices: tuple[str, ...],
                 user: str | None = None, command_timeout_s: float = 5.0):
        self.binary = binary
        self.directories = directories
        self.visible_devices = visible_devices
        self.user = user
        self.command_timeout_s = command_timeout_s

    def resolve_binary(self) -> str:
        path = shutil.which(self.binary)
        if path is None:
            raise MpsBinaryMissing(f"the MPS control binary '{self.binary}' is not installed or not on PATH. "
                                   + INSTALL_HINT)
        return path

    def environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("CUDA_")}
        env.update(CUDA_MPS_PIPE_DIRECTORY=str(self.directories.pipe), CUDA_MPS_LOG_DIRECTORY=str(self.directories.log),
                   CUDA_VISIBLE_DEVICES=",".join(self.visible_devices))
        return env

    def _identity(self) -> dict:
        """Who the MPS binary runs as: mps.user with its own primary group and no other (Popen's user=
        alone changes only the uid, leaving root's gid 0 and groups); gpud's own identity without one."""
        if not self.user:
            return {}
        entry = pwd.getpwnam(self.user)
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    async def start(self, wait_s: float = 10.0) -> int:
        """Starts the daemon and waits until its control socket answers. Returns its PID."""
        binary = self.resolve_binary()
        owner = None
        if self.user:
            entry = pwd.getpwnam(self.user)
            owner = (entry.pw_uid, entry.pw_gid)
        for directory in (self.directories.pipe, self.directories.log):
            try:  # root never follows a symlink another user planted, nor chowns through one
                secure_directory(directory, 0o755, owner)
            except UnsafePath as exc:
                raise MpsError(f"not starting the MPS control daemon: {exc}") from None
        # its own session (the runner's): no signal meant for gpud reaches it
        run = await child.run([binary, "-d"], env=self.environment(), merge_stderr=True, timeout_s=wait_s,
                              output_cap=CONTROL_OUTPUT_CAP, **self._identity())
        failure = run.failure(wait_s, CONTROL_OUTPUT_CAP)
        if failure:
            raise MpsError(f"{binary} -d: {failure}")
        if run.exit_code != 0:
            raise MpsError(f"{binary} -d exited with status {run.exit_code}: {run.text(2000).strip()}")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            pid = self.find_pid()
            if pid is not None and await self.answers():
                return pid
            await asyncio.sleep(0.05)
        raise MpsError(f"the MPS control daemon for {self.directories.pipe} did not answer within {wait_s:g} s")

    async def command(self, text: str) -> str:
        """Sends one control command; returns the daemon's answer."""
        binary = self.resolve_binary()
        run = await child.run([binary], env=self.environment(), stdin=text.encode() + b"\n", merge_stderr=True,
                              timeout_s=self.command_timeout_s, output_cap=CONTROL_OUTPUT_CAP, **self._identity())
        if run.timed_out:
            raise MpsError(f"MPS command '{text}' got no answer within {self.command_timeout_s:g} s")
        if run.overflowed:
            raise MpsError(f"MPS command '{text}' answered more than {CONTROL_OUTPUT_CAP} bytes: not read")
        answer = run.stdout.decode(errors="replace").strip()
        if run.exit_code != 0:
            raise MpsError(f"MPS command '{text}' failed (exit status {run.exit_code}): {answer[:2000]}")
        return answer

    async def answers(self) -> bool:
        if not (self.directories.pipe / "control").exists():
            return False
        try:
            await self.command("get_server_list")
        except MpsError:
            return False
        return True

    async def server_pids(self) -> list[int]:
        return [int(word) for word in (await self.command("get_server_list")).split() if word.isdigit()]

    async def set_limits(self, active_thread_percentage: float | None, pinned_mib: dict[int, int]) -> None:
        """Limits for clients that set none of their own. Devices go by the index the daemon sees."""
        if active_thread_percentage is not None:
            await self.command(f"set_default_active_thread_percentage {active_thread_percentage:g}")
        for device, mib in sorted(pinned_mib.items()):
            await self.command(f"set_default_device_pinned_mem_limit {device} {mib}M")

    async def limits(self) -> tuple[float, dict[int, str]]:
        """The daemon's own view of its default limits: thread percentage, pinned memory per device."""
        threads = float(await self.command("get_default_active_thread_percentage"))
        pinned = {index: await self.command(f"get_default_device_pinned_mem_limit {index}")
                  for index in range(len(self.visible_devices))}
        return threads, pinned

    async def quit(self, wait_s: float = 10.0) -> None:
        pid = self.find_pid()
        await self.command("quit")
        deadline = time.monotonic() + wait_s
        while pid is not None and process_alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def find_pid(self) -> int | None:
        """The running control daemon that serves this pipe directory, found through /proc, so gpud
        finds (adopts) a daemon it started before a restart as well as one it just started."""
        wanted = f"CUDA_MPS_PIPE_DIRECTORY={self.directories.pipe}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if read_host_text(entry / "comm").strip() != "nvidia-cuda-mps" and \
                        not read_host_file(entry / "cmdline", PROC_LIST_BYTES).startswith(b"nvidia-cuda-mps-control"):
                    continue
                if b"-d\x00" not in read_host_file(entry / "cmdline", PROC_LIST_BYTES) + b"\x00":
                    continue
                if wanted in read_host_file(entry / "environ", PROC_LIST_BYTES).split(b"\x00") and process_alive(int(entry.name)):
                    return int(entry.name)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue  # gone meanwhile, or not ours to read; EMFILE and the like are the caller's to handle
        return None


def process_alive(pid: int) -> bool:
    """Whether the process runs, through a pidfd (Linux 5.3): it turns readable once the process has
    exited, a zombie included. False only when the kernel says so; any other failure to look (EMFILE,
    ENFILE, ENOMEM) raises OSError, for the caller to treat as "cannot tell", never as "died"."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        return _signalable(pid)  # a kernel older than 5.3
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return not poller.poll(0)
    finally:
        os.close(pidfd)


def _signalable(pid: int) -> bool:
    """kill(pid, 0): opens nothing; EPERM means a process of another user runs under that PID."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user
        pass
    return True
