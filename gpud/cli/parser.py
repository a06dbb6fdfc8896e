"""The `gpud` command tree: the top-level parser and its epilog, and each group's commands (one module of
gpud.cli each) in the order `gpud --help` lists them."""

from __future__ import annotations

import argparse
import textwrap

from gpud import __version__
from gpud.cli import doctor, gpus, health, kubernetes, mig, mps, node_files, serve, sharing, sim, slurm, watch
from gpud.cli.arguments import Parser, group
from gpud.cli.output import EXIT_CODES, SOCKET_ORDER

COMMANDS = (serve.add_serve, kubernetes.add_device_plugin, kubernetes.add_k8s_agent, kubernetes.add_dra_plugin,
            serve.add_status, gpus.add_gpus, health.add_health, health.add_check, serve.add_reload, watch.add_watch,
            mig.add_mig, mps.add_mps, sharing.add_sharing, kubernetes.add_claims, kubernetes.add_kubernetes,
            node_files.add_nfd, node_files.add_cdi, slurm.add_slurm, serve.add_metrics, sim.add_sim, serve.add_config,
            doctor.add_doctor)


def epilog() -> str:
    codes = "\n".join(textwrap.fill(meaning, 78, initial_indent=f"  {code}  ", subsequent_indent="     ")
                      for code, meaning in EXIT_CODES)
    order = "\n".join(textwrap.fill(place, 78, initial_indent=f"  {n}. ", subsequent_indent="     ")
                      for n, place in enumerate(SOCKET_ORDER, 1))
    return (f"exit status:\n{codes}\n\nthe daemon's socket, first found:\n{order}\n\n"
            "--json prints the API's JSON; metrics and mig export print {\"format\": ..., \"text\": ...},\n"
            "watch one event a line; serve, device-plugin, k8s-agent and slurm health refuse --json (exit 2).\n"
            "With --json, an error is one JSON object on stderr:\n"
            '  {"error": {"code": ..., "message": ...}, "exit_code": N}')


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gpud", description="Owns the NVIDIA GPUs of this node.", epilog=epilog(),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gpud {__version__}")
    commands = group(parser, "commands")
    for add in COMMANDS:
        add(commands)
    return parser
