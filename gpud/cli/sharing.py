"""`gpud sharing`: the shared resources and the config in force; use, allocations, and validate (a
device-plugin sharing file, here)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from gpud.cli.arguments import CHANGE_TIMEOUT_S, add_client, client_options, local_command
from gpud.cli.commands import command_help
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, print_json, table, warn
from gpud.cli.validate import validate_file

TYPE_CHECKING = False  # annotations only: typing and the client are imported where used
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client


def add_sharing(commands: Any) -> None:
    sharing = commands.add_parser("sharing", help=command_help("sharing"))
    client_options(sharing, _sharing)
    sub = sharing.add_subparsers(title="sharing commands", metavar="COMMAND")
    use = add_client(sub, "use", _sharing_use, "put a named config of sharing.configs_dir in force "
                                               "(kept across restarts)", timeout=CHANGE_TIMEOUT_S)
    which = use.add_mutually_exclusive_group(required=True)
    which.add_argument("name", nargs="?", help="the config's name (its file in sharing.configs_dir)")
    which.add_argument("--default", action="store_true", help="back to sharing.default_config")
    use.add_argument("--reason", help="why, kept with the choice and shown by gpud sharing")
    add_client(sub, "allocations", _sharing_allocations,
               "gpu_memory's units per device: allocated/total GiB and the pods holding them, as the device "
               "plugin reported the kubelet allocated them (exit 1 on a problem)")
    validate = sub.add_parser(
        "validate", help="check a device-plugin sharing file (exit 0 valid, 2 invalid)")
    validate.add_argument("path", type=Path)
    validate.add_argument("--strict", action="store_true", help="warnings are errors (exit 2)")
    local_command(validate, _sharing_validate)


def _sharing(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/sharing")
    if args.json:
        print_json(view)
        return EXIT_PROBLEM if view["error"] else EXIT_OK
    print(f"strategy: {view['strategy']}  MIG strategy: {view['mig_strategy']}  from: {view['source'] or '(none)'}")
    print(_config_in_force(view["config"]))
    if view["config"]["problem"]:
        warn(view["config"]["problem"])
    if view["error"]:
        print(f"error: {view['error']}")
    rows = [("RESOURCE", "STRATEGY", "REPLICAS", "COUNT", "HEALTHY")]
    for resource in view["resources"]:
        healthy = sum(d["healthy"] for d in resource["devices"])
        if resource["strategy"] == "gpu-memory":  # gpu_memory's units, not replicas
            replicas = f"{resource['unit_mib']} MiB units"
        else:
            replicas = "mixed" if resource["replicas"] is None else str(resource["replicas"])
        rows.append((resource["name"], resource["strategy"], replicas, str(resource["count"]), str(healthy)))
    print(table(rows))
    for text in view.get("warnings", []):
        warn(text)
    return EXIT_PROBLEM if view["error"] else EXIT_OK


def _sharing_allocations(args: argparse.Namespace, client: Client) -> int:
    """gpu_memory's units per device, allocated of allocatable in GiB, as kubectl inspect cgpu shows them."""
    view = client.get("/v1/allocations")
    if args.json:
        print_json(view)
        return EXIT_PROBLEM if view["problems"] else EXIT_OK
    if not view["enabled"]:
        print(f"gpu_memory is not enabled (gpud.yaml gpu_memory.enabled); resource {view['resource']}")
        return EXIT_OK
    reported = "never (the device plugin has not reported)" if view["reported_at"] is None else \
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(view["reported_at"]))
    print(f"resource: {view['resource']}  unit: {view['unit_mib']} MiB  reported: {reported}")
    rows = [("DEVICE", "ALLOCATED/TOTAL (GiB)", "PODS")]
    for device in view["devices"]:
        name = f"GPU {device['gpu_index']}" + (f" {device['device']}" if device["mig"] else "")
        pods = len({(h["namespace"], h["pod"]) for h in device["holders"]})
        rows.append((name, f"{_gib(device['allocated_mib'])}/{_gib(device['allocatable_mib'])}", str(pods)))
    node = view["node"]
    rows.append(("node", f"{_gib(node['allocated_mib'])}/{_gib(node['allocatable_mib'])}", str(node["pods"])))
    print(table(rows))
    for problem in view["problems"]:
        warn(problem)
    return EXIT_PROBLEM if view["problems"] else EXIT_OK


def _gib(mib: int) -> str:
    return f"{round(mib / 1024, 1):g}"


def _sharing_use(args: argparse.Namespace, client: Client) -> int:
    _status, answer = client.request("PUT", "/v1/sharing/config", {"name": None if args.default else args.name,
                                                                  "reason": args.reason})
    if args.json:
        print_json(answer)
        return EXIT_OK
    print(_config_in_force(answer["config"]))
    if answer["config"]["problem"]:
        warn(answer["config"]["problem"])
    return EXIT_OK


def _config_in_force(config: dict) -> str:
    """"config: NAME (why)", the file where no named config is in force."""
    return f"config: {config['name'] or config['file']} ({config['why']})"


def _sharing_validate(args: argparse.Namespace) -> int:
    from gpud.sharing.config import SharingConfigError, check_sharing, check_sharing_file

    return validate_file(args, check_sharing_file, check_sharing, SharingConfigError,
                         lambda config: {"strategy": config.strategy, "mig_strategy": config.mig_strategy},
                         lambda config: f"strategy {config.strategy}, MIG strategy {config.mig_strategy}",
                         "a sharing config")
