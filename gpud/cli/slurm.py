"""`gpud slurm`: gres (the daemon's gres.conf for this node) and health (gpud.slurm.health, slurmd's
health check)."""

from __future__ import annotations

import argparse

from gpud.cli.arguments import add_client, group, local_command, socket_option
from gpud.cli.commands import command_help
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, print_json, warn
from gpud.slurm import health as slurm_health

TYPE_CHECKING = False  # annotations only: typing and the client are imported where used
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client


def add_slurm(commands: Any) -> None:
    slurm = group(commands.add_parser("slurm", help=command_help("slurm")), "slurm commands")
    gres = add_client(slurm, "gres", _slurm_gres, "the gres.conf gpud builds for this node (slurm.gres_file "
                                                  "holds it, if set; exit 1 if it could not be written)")
    gres.add_argument("--node-line", action="store_true",
                      help="print the Gres= of this node's line in slurm.conf instead")
    text = "slurmd's HealthCheckProgram (and Prolog with --prolog): drain this node on an unhealthy GPU, resume it " \
           "once healthy if gpud drained it"
    health = slurm.add_parser("health", help=text, description=text, epilog=slurm_health.epilog(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    socket_option(health)  # before or after the command, as every command's (gpud.cli.arguments)
    slurm_health.add_arguments(health)
    local_command(health, _slurm_health)


def _slurm_gres(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/slurm/gres")
    if args.json:
        print_json(view)
    else:
        print(f"Gres={view['node_gres'] or ''}\n" if args.node_line else view["text"] or "", end="")
        for device in view["unavailable"]:
            warn(f"left out {device['device']}: {device['reason']}")
        if view["error"]:
            warn(view["error"])
    return EXIT_PROBLEM if view["error"] else EXIT_OK


def _slurm_health(args: argparse.Namespace) -> int:
    if args.json:  # what it saw and did, a line each, for slurmd's log
        args.parser.error("--json: it prints lines for slurmd's log, not a document")
    return slurm_health.run(args)
