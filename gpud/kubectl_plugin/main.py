"""kubectl-gpud's command line: `kubectl gpud inspect` (the entry point kubectl-gpud, pyproject.toml)."""

from __future__ import annotations

import argparse
import json
import sys

from gpud import __version__
from gpud.cli.output import EXIT_OK, EXIT_USAGE, exit_code_of, table
from gpud.kubectl_plugin.accounting import MIB, NodeView, cluster_totals, inspect
from gpud.kubectl_plugin.kubectl import RESOURCE_GROUP, Kubectl

DEFAULT_DRIVER = "gpu.nvidia.com"  # gpud dra-plugin's default --driver-name (gpud/dra DEFAULT_DRIVER_NAME)
CONNECTION_FLAGS = ("kubeconfig", "context", "cluster", "user")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubectl gpud", description="gpud's view of the cluster's GPUs.")
    parser.add_argument("--version", action="version", version=f"kubectl-gpud {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect_ = commands.add_parser(
        "inspect", help="per node: GPUs, MIG devices and GPU memory allocated of total; the cluster's totals",
        description="Per node: the GPUs, MIG devices and GPU memory (GiB) allocated of total, the pods and DRA "
                    "claims holding them; then the cluster's totals. From the Node objects, the requests of pods "
                    "that have not terminated, and (where the cluster serves resource.k8s.io) the ResourceSlices "
                    "and ResourceClaims of gpud's DRA driver. Exit codes: 0 ok, 1 the API server refused "
                    "(403, 401) or failed, 2 usage or kubeconfig error, 3 the API server is unreachable.")
    inspect_.add_argument("--node", metavar="NAME", help="only this node (shown even without GPUs)")
    inspect_.add_argument("-l", "--selector", metavar="SELECTOR", help="only the nodes with these labels")
    inspect_.add_argument("--all-nodes", action="store_true", help="list the nodes without GPUs too")
    inspect_.add_argument("--driver", default=DEFAULT_DRIVER,
                          help=f"gpud dra-plugin's --driver-name (default {DEFAULT_DRIVER})")
    inspect_.add_argument("--json", action="store_true", help="JSON output")
    for flag in CONNECTION_FLAGS:
        inspect_.add_argument(f"--{flag}", metavar=flag.upper(), help="handed on to kubectl")
    inspect_.add_argument("--request-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                          help="each request to the API server (default 30)")
    return parser


def _seconds(text: str) -> float:
    try:
        value = float(text.removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: between 0 and 3600 seconds")
    return value


def run_inspect(args: argparse.Namespace) -> int:
    flags = [f"--{flag}={getattr(args, flag)}" for flag in CONNECTION_FLAGS if getattr(args, flag)]
    kubectl = Kubectl(flags, args.request_timeout)
    node_args = ["nodes"] + ([args.node] if args.node else []) + (["-l", args.selector] if args.selector else [])
    nodes = kubectl.items(*node_args)
    phases = "status.phase!=Succeeded,status.phase!=Failed" + (f",spec.nodeName={args.node}" if args.node else "")
    pods = kubectl.items("pods", "--all-namespaces", f"--field-selector={phases}")
    resource_api = kubectl.serves("resourceslices", RESOURCE_GROUP)
    slices = claims = []
    if resource_api:
        slices = kubectl.items(f"resourceslices.{RESOURCE_GROUP}", f"--field-selector=spec.driver={args.driver}")
        claims = kubectl.items(f"resourceclaims.{RESOURCE_GROUP}", "--all-namespaces")
    views = inspect(nodes, pods, slices, claims, args.driver, include_all=args.all_nodes or bool(args.node))
    totals = cluster_totals(views)
    if args.json:
        print(json.dumps({"nodes": [view.view() for view in views], "cluster": totals, "resource_api": resource_api,
                          "driver": args.driver}, indent=2))
    else:
        print(render(views, totals, resource_api))
    return EXIT_OK


def _gib(mib: float | None) -> str:
    if mib is None:
        return "?"
    gib = mib * MIB / (1 << 30)
    return f"{gib:.0f}" if abs(gib - round(gib)) < 0.05 else f"{gib:.1f}"


def _memory(allocated: float, total: float | None, unknown: bool) -> str:
    return f"{_gib(allocated)}{'+?' if unknown else ''}/{_gib(total)}"


def render(views: list[NodeView], totals: dict, resource_api: bool) -> str:
    if not views:
        return "no node with GPUs" + ("" if resource_api else " (the cluster has no resource.k8s.io: no DRA)")
    rows = [("NODE", "GPUS", "MIG", "GPU MEMORY (GiB)", "PODS", "CLAIMS", "PRODUCT")]
    for view in views:
        rows.append((view.name, f"{view.gpus.allocated}/{view.gpus.total}",
                     f"{view.mig_devices.allocated}/{view.mig_devices.total}",
                     _memory(view.memory_allocated_mib, view.memory_total_mib, bool(view.memory_unknown)),
                     str(len(view.pods)), str(len(view.claims)) if resource_api else "-", view.product or "-"))
    memory = totals["gpu_memory_mib"]
    share = f" ({100 * memory['allocated'] / memory['total']:.0f}%)" if memory["total"] else ""
    rows.append((f"cluster ({totals['nodes']} node{'' if totals['nodes'] == 1 else 's'})",
                 f"{totals['gpus']['allocated']}/{totals['gpus']['total']}",
                 f"{totals['mig_devices']['allocated']}/{totals['mig_devices']['total']}",
                 _memory(memory["allocated"], memory["total"], any(v.memory_unknown for v in views)) + share,
                 str(totals["pods"]), str(totals["claims"]) if resource_api else "-", ""))
    return table(rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def inspect_command() -> int:
        try:
            return run_inspect(build_parser().parse_args(argv))
        except SystemExit as exc:  # --help, --version, a usage error (argparse said why)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE

    return exit_code_of(inspect_command, lambda: "--json" in argv)
