"""`gpud mps`: the MPS control daemons; status, start, stop, restart, env, and quit-all (here)."""

from __future__ import annotations

import argparse
import asyncio
import urllib.parse
from pathlib import Path
from typing import Any

from gpud.cli.arguments import CHANGE_TIMEOUT_S, add_client, group, local_command, quoted
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, CliError, print_json, table, terminal_columns, warn
from gpud.client import Client
from gpud.config import Config, ConfigError, load_config


def add_mps(commands: Any) -> None:
    mps = group(commands.add_parser("mps", help="MPS control daemons: status, start, stop, restart, env"),
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
    if view["error"]:
        print(f"error: {view['error']}")
    rows = [("NAME", "STATE", "PID", "RESTARTS", "THREADS %", "PINNED MiB", "DEVICES", "WHY")]
    for daemon in view["daemons"]:
        threads = daemon["active_thread_percentage"]
        rows.append((daemon["name"], daemon["state"], str(daemon["pid"] or "-"), str(daemon["restarts"]),
                     "-" if threads is None else f"{threads:g}",
                     ",".join("-" if m is None else str(m) for m in daemon["pinned_memory_limit_mib"]),
                     ",".join(daemon["devices"]), "" if daemon["state"] == "running" else daemon["last_error"] or ""))
    print(table(rows, terminal_columns()))
    return EXIT_OK if running else EXIT_PROBLEM


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
    from gpud.mps.removal import quit_all

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        warn(f"{exc}: acting on the default MPS pipe root, and on root's daemons only")
        config = Config()
    outcomes = asyncio.run(quit_all(config.mps_pipe_root, config.mps_log_root, config.mps.control_binary,
                                    config.mps.user))
    if args.json:
        print_json([{"name": outcome.name, "refused": outcome.refused} for outcome in outcomes])
    for outcome in outcomes:
        if outcome.refused is not None:
            warn(f"left running: {outcome.name}: {outcome.refused}")
        elif not args.json:
            print(f"quit: {outcome.name}")
    return EXIT_OK if all(outcome.refused is None for outcome in outcomes) else EXIT_PROBLEM
