"""Where gpud keeps its files by default, and the names of settings the command line offers before
any configuration is read: importable without gpud.config (YAML, the config model), so that a
command that only talks to the socket starts fast. Paths are str: importing pathlib (with
urllib.parse and ipaddress) costs a command a quarter of the interpreter's own start."""

from __future__ import annotations

import os

DEFAULT_CONFIG_PATH = "/etc/gpud/gpud.yaml"
SYSTEM_RUNTIME_DIR = "/run/gpud"
SYSTEM_STATE_DIR = "/var/lib/gpud"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


def user_runtime_dir() -> str:
    """/run/gpud for root; $XDG_RUNTIME_DIR/gpud (or a private /tmp directory) for anyone else."""
    if os.geteuid() == 0:
        return SYSTEM_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(xdg, "gpud") if xdg else f"/tmp/gpud-{os.geteuid()}"
