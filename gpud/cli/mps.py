"""`gpud mps`: the MPS control daemons; status, start, stop, restart, env, and quit-all (here)."""

from __future__ import annotations

import argparse
import urllib.parse
from pathlib import Path

from gpud.cli.arguments import CHANGE_TIMEOUT_S, add_client, group, local_command, quoted
from gpud.cli.commands import command_help
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, CliError, print_json, table, terminal_columns, warn

TYPE_CHECKING = False  # annotations only: typing and the client are imported where used
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client


def add_mps(commands: Any) -> None:
    mps = group(commands.add_parser("mps", help=command_help("mps")),
                "mps commands")
    add_client(mps, "status", _mps_status, "the MPS daemons and their limits (exit 1 if one is down)")
    for action in ("start", "stop", "restart"):
        control = add_client(mps, action, _mps_control, f"{action} one MPS daemon",
                             timeout=CHANGE_TIMEOUT_S, action=action)
        control.add_argument("name")
    env = add_client(mps, "env", _mps_env, "the environment a container needs to be a client of one "
                                           "MPS daemon")
    env.add_argument("name")
    env.add_argument("--memory-mib", type=int, help="pinned device memory limit per device")
    env.add_argument("--threads-percent", type=float, help="active thread percentage")
    quit_all = local_command(mps.add_parser("quit-all", help="end every MPS control daemon gpud left running "
                                                             "(the packages' preremove runs it as root)"),
                             _mps_quit_all)
    quit_all.add_argument("--config", type=Path, help="config file (default /etc/gpud/gpud.yaml, if present)")


def _mps_status(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/mps")
    running = all(d["state"] == "running" for d in view["daemons"])
    if args.json:
        print_json(view)
        return EXIT_OK if running or not view["enabled"] else EXIT_PROBLEM
    if not view["enabled"]:
        print("MPS is not enabled (mps.enabled in gpud.yaml)")
        return EXIT_OK
    print(status_text(view, terminal_columns()))
    return EXIT_OK if running else EXIT_PROBLEM


def status_text(view: dict, width: int) -> str:
    """The daemons' table for a terminal `width` columns wide: why a daemon is down on its row where that
    fits; else the WHY column numbers the reasons, each written once below the table, wrapped between
    words; and where the rows still do not fit, without the DEVICES column (the daemon's name says its
    device; --json has the UUIDs)."""
    reasons = list(dict.fromkeys(_why(daemon) for daemon in view["daemons"] if _why(daemon)))
    lines = _wrapped_between_words(f"error: {view['error']}", width, "       ") \
        if view["error"] and view["error"] not in reasons else []
    inline = _status_table(view["daemons"], True, _why)
    if _fits(inline, width):
        return "\n".join([*lines, inline])
    numbered = lambda daemon: str(reasons.index(_why(daemon)) + 1) if _why(daemon) else ""  # noqa: E731
    rows = _status_table(view["daemons"], True, numbered)
    devices = _fits(rows, width)
    lines.append(rows if devices else _status_table(view["daemons"], False, numbered))
    for number, reason in enumerate(reasons, 1):
        lines += _wrapped_between_words(f"why {number}: {reason}", width, " " * len(f"why {number}: "))
    if not devices:
        lines.append(f"DEVICES left out to fit {width} columns (gpud mps status --json lists them)")
    return "\n".join(lines)


def _why(daemon: dict) -> str:
    return "" if daemon["state"] == "running" else daemon["last_error"] or ""


def _status_table(daemons: list[dict], devices: bool, why) -> str:
    rows = [("NAME", "STATE", "PID", "RESTARTS", "THREADS %", "PINNED MiB", *(("DEVICES",) if devices else ()),
             "WHY")]
    for daemon in daemons:
        threads = daemon["active_thread_percentage"]
        rows.append((daemon["name"], daemon["state"], str(daemon["pid"] or "-"), str(daemon["restarts"]),
                     "-" if threads is None else f"{threads:g}",
                     ",".join("-" if m is None else str(m) for m in daemon["pinned_memory_limit_mib"]),
                     *((",".join(daemon["devices"]),) if devices else ()), why(daemon)))
    return table(rows)


def _fits(text: str, width: int) -> bool:
    return all(len(line) <= width for line in text.splitlines())


def _wrapped_between_words(text: str, width: int, indent: str) -> list[str]:
    """A word longer than the line (a path) stays whole: the terminal wraps it, but nothing splits it here."""
    import textwrap

    return textwrap.wrap(text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _mps_control(args: argparse.Namespace, client: Client) -> int:
    _status, daemon = client.request("POST", f"/v1/mps/{quoted(args.name)}/{args.action}", {})
    if args.json:
        print_json(daemon)
    else:
        print(f"{daemon['name']}: {daemon['state']}, pid {daemon['pid'] or '-'}, restarts {daemon['restarts']}")
    return EXIT_OK


def _mps_env(args: argparse.Namespace, client: Client) -> int:
    limits = {key: value for key, value in (("memory_mib", args.memory_mib), ("threads_percent", args.threads_percent))
              if value is not None}
    query = f"?{urllib.parse.urlencode(limits)}" if limits else ""
    document = client.get(f"/v1/mps/{quoted(args.name)}/client-env{query}")
    daemon = next(d for d in client.get("/v1/mps")["daemons"] if d["name"] == args.name)
    if daemon["state"] != "running":  # a client of it would fail to connect
        raise CliError(EXIT_PROBLEM, "mps-daemon-not-running", f"MPS daemon {args.name} is {daemon['state']}"
                                                                + (f": {daemon['last_error']}" if daemon["last_error"] else ""))
    if args.json:
        print_json(document)
        return EXIT_OK
    for key, value in document["env"].items():
        print(f"{key}={value}")
    return EXIT_OK


def _mps_quit_all(args: argparse.Namespace) -> int:
    """Where the config cannot be read, its defaults: only root's pipe directories are acted on then."""
    import asyncio
    import pwd

    from gpud.config import Config, ConfigError, load_config
    from gpud.mps.removal import quit_all

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        warn(f"{exc}: acting on the default MPS pipe root, and on root's daemons only")
        config = Config()
    try:
        if config.mps.user:
            pwd.getpwnam(config.mps.user)
    except KeyError:
        warn(f"mps.user {config.mps.user!r} does not exist: acting on root's daemons only")
    outcomes = asyncio.run(quit_all(config.mps_pipe_root, config.mps_log_root, config.mps.control_binary,
                                    config.mps.user))
    if args.json:
        print_json([{"name": outcome.name, "refused": outcome.refused, "was_running": outcome.was_running}
                    for outcome in outcomes])
    for outcome in outcomes:
        if outcome.refused is not None:
            warn(f"left running: {outcome.name}: {outcome.refused}")
        elif not args.json:
            print(f"{'quit' if outcome.was_running else 'not running'}: {outcome.name}")
    return EXIT_OK if all(outcome.refused is None for outcome in outcomes) else EXIT_PROBLEM
