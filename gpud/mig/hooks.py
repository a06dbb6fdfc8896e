"""The operator's MIG hooks (mig.hooks): shell commands run before and after gpud changes MIG layouts."""

from __future__ import annotations

import os

from gpud.base import child
from gpud.base.logs import get_logger

log = get_logger("mig")
HOOK_OUTPUT_CAP = 1 << 20  # of a hook's stdout and stderr read; its last 500 characters are logged


class MigHooks:
    """pre_apply runs before the first change and stops the apply when a command fails; post_apply
    runs once the GPUs are changed. Each command gets GPUD_MIG_LAYOUT and GPUD_MIG_GPUS (indices)."""

    def __init__(self, pre_apply: tuple[str, ...] = (), post_apply: tuple[str, ...] = (), timeout_s: float = 300.0):
        self._commands = {"pre_apply": pre_apply, "post_apply": post_apply}
        self._timeout_s = timeout_s

    async def run(self, name: str, layout: str | None, gpus: list[int]) -> str | None:
        """Runs hook `name`'s commands in order; None when all succeeded, else what failed (the last
        failure: pre_apply stops at the first, post_apply runs every command).

        What failed says which command by its number and how (its exit status), never its command
        line or output: it is shown by read routes, to users who may not see the operator's
        commands (which can hold tokens or hosts). The log, root's to read, has both."""
        failed = None
        env = {**os.environ, "GPUD_MIG_LAYOUT": layout or "", "GPUD_MIG_GPUS": ",".join(map(str, gpus))}
        commands = self._commands[name]
        for number, command in enumerate(commands, 1):
            failure, output = await self._run_command(command, env)
            log.info("mig_hook", hook=name, command=command, ok=failure is None, error=failure, output=output)
            if failure:
                failed = (f"{name} hook command {number} of {len(commands)} failed ({failure}); "
                          "its command line and output are in gpud's log")
                if name == "pre_apply":
                    break
        return failed

    async def _run_command(self, command: str, env: dict[str, str]) -> tuple[str | None, str]:
        """(None, output) when the command succeeded, else (how it failed, output): the last 500
        characters of its stdout and stderr."""
        try:
            run = await child.run([command], shell=True, env=env, merge_stderr=True, timeout_s=self._timeout_s,
                                  output_cap=HOOK_OUTPUT_CAP)
        except OSError as exc:
            return f"could not start: {exc.strerror}", ""
        text = run.text()[-500:]
        if run.timed_out:  # killed with its process group: a hook never outlives its deadline
            return f"timed out after {self._timeout_s:g} s", text
        if run.overflowed:
            return f"printed more than {HOOK_OUTPUT_CAP} bytes: stopped", text
        return (None if run.exit_code == 0 else f"exit status {run.exit_code}"), text
