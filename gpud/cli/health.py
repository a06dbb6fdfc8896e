"""`gpud health` (and health clear) and `gpud check`, DCGM's diagnostic."""

from __future__ import annotations

import argparse

from gpud.cli.arguments import add_client, client_options, quoted
from gpud.cli.commands import command_help
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, print_json, reasons_text, table

TYPE_CHECKING = False  # annotations only: typing and the client are imported where used
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client

# The kinds of health reason gpud raises (gpud/health: checks, tracker, service); a test reads them there.
HEALTH_REASON_KINDS = ("diag", "driver", "ecc", "fabric", "fabric-manager", "infiniband", "lost", "mps", "nvlink",
                       "pcie", "power", "rdma", "recovery-action", "remapped-rows", "reset-required", "retired-pages",
                       "temperature", "throttle", "xid")
# DCGM's diagnostic runs up to health.check_timeout_s (at most 2 h): the client waits that long and a minute
CHECK_TIMEOUT_S = 7200.0 + 60.0


def add_health(commands: Any) -> None:
    health = commands.add_parser("health", help=command_help("health"))
    client_options(health, _health)
    clear = add_client(health.add_subparsers(title="health commands", metavar="COMMAND"), "clear",
                       _health_clear, "clear a device's health reasons (all, or one kind)")
    clear.add_argument("id", help="GPU index, GPU or MIG UUID, or PCI bus id")
    clear.add_argument("--kind", choices=HEALTH_REASON_KINDS, metavar="KIND",
                       help=f"clear only reasons of this kind: {', '.join(HEALTH_REASON_KINDS)}")


def add_check(commands: Any) -> None:
    check = add_client(commands, "check", _check, command_help("check"), timeout=CHECK_TIMEOUT_S)
    check.add_argument("--level", type=int, choices=(1, 2), default=1,
                       help="1: quick (dcgmi diag -r 1, seconds), 2: medium (-r 2, about two minutes)")
    check.add_argument("--force", action="store_true", help="run even while compute processes use the GPUs")
    check.add_argument("--last", action="store_true", help="show the last run instead of running one")


def _health(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/health")
    if args.json:
        print_json(view)
        return EXIT_OK if view["status"] == "healthy" else EXIT_PROBLEM
    print(f"node: {view['status']}")
    node = view.get("node") or {"state": "healthy", "reasons": []}
    rows = [("DEVICE", "STATE", "ACTION (DRIVER)", "REASONS"),
            ("node", node["state"], "-", reasons_text(node["reasons"]))]
    for gpu in view["gpus"]:
        action = f"{gpu.get('suggested_action', 'none')} ({gpu.get('driver_action') or '-'})"
        rows.append((f"GPU {gpu['index']}", gpu["state"], action, reasons_text(gpu["reasons"])))
        for dev in gpu["mig_devices"]:
            rows.append((f"  └ {dev['profile']} gi {dev['gi_id']} ci {dev['ci_id']}", dev["state"], "",
                         reasons_text(dev["reasons"])))
    for subject in view.get("subjects", []):
        rows.append((subject["name"], subject["state"], "-", reasons_text(subject["reasons"])))
    print(table(rows))
    return EXIT_OK if view["status"] == "healthy" else EXIT_PROBLEM


def _check(args: argparse.Namespace, client: Client) -> int:
    if args.last:
        run = client.get("/v1/check/last")
    else:
        _status, run = client.request("POST", "/v1/check", {"level": args.level, "force": args.force})
    if args.json:
        print_json(run)
    else:
        print(f"{' '.join(run['command'])}: {run['outcome']}" + (f" — {run['error']}" if run.get("error") else ""))
        rows = [("GPU", "TEST", "RESULT", "INFO")]
        rows += [("-" if test["gpu_index"] is None else str(test["gpu_index"]), test["name"], test["result"],
                  test["info"]) for test in run["tests"] if test["result"] != "pass"]
        if len(rows) > 1:
            print(table(rows))
    return EXIT_OK if run["outcome"] == "pass" else EXIT_PROBLEM


def _health_clear(args: argparse.Namespace, client: Client) -> int:
    body = {"kind": args.kind} if args.kind else {}
    _status, device = client.request("POST", f"/v1/health/{quoted(args.id)}/clear", body)
    if args.json:
        print_json(device)
        return EXIT_OK
    print(f"{device['uuid']}: {device['state']}")
    for reason in device["reasons"]:
        print(f"  still: {reason['kind']} {reason['code']}: {reason['message']}")
    return EXIT_OK


def device_problems(gpu: dict) -> list[tuple[str, str, list]]:
    """(where, state, reasons) for a GPU and each of its MIG devices that is not healthy."""
    found = [(f"GPU {gpu['index']}", gpu["state"], gpu["reasons"])] if gpu["state"] != "healthy" else []
    return found + [(f"GPU {gpu['index']} MIG {dev.get('profile', dev['uuid'])}", dev["state"], dev["reasons"])
                    for dev in gpu.get("mig_devices", []) if dev["state"] != "healthy"]
