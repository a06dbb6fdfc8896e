"""`gpud sim`: fault drills on a simulated node (gpud serve --simulate)."""

from __future__ import annotations

import argparse
import json

from gpud.cli.arguments import add_client, group
from gpud.cli.commands import command_help
from gpud.cli.output import EXIT_OK, print_json

TYPE_CHECKING = False  # annotations only: typing and the client are imported where used
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client


def add_sim(commands: Any) -> None:
    sim = group(commands.add_parser("sim", help=command_help("sim")),
                "sim commands")
    xid = add_client(sim, "xid", _sim_xid, "raise an XID event on a GPU or MIG device")
    xid.add_argument("gpu", help="GPU index or UUID")
    xid.add_argument("xid", type=int)
    xid.add_argument("--gi", type=int, help="GPU-instance id the XID is attributed to")
    xid.add_argument("--ci", type=int, help="compute-instance id the XID is attributed to")
    lost = add_client(sim, "lost", _sim_lost, "the GPU falls off the bus")
    lost.add_argument("gpu", help="GPU index or UUID")
    lost.add_argument("--how", help="how NVML reports the loss (e.g. is-lost, unknown)")
    add_client(sim, "recover", _sim_recover, "a lost GPU comes back").add_argument(
        "gpu", help="GPU index or UUID")
    processes = add_client(sim, "processes", _sim_processes,
                           "set the compute processes on a GPU or MIG device (none: end them all)")
    processes.add_argument("gpu", help="GPU index, GPU UUID, or MIG UUID on a GPU in MIG mode")
    processes.add_argument("pids", type=int, nargs="*", metavar="PID")
    ecc = add_client(sim, "ecc", _sim_ecc, "an ECC error on a GPU")
    ecc.add_argument("gpu", help="GPU index or UUID")
    ecc.add_argument("--double-bit", action="store_true", help="uncorrectable (default: single-bit, corrected)")
    holders = add_client(sim, "holders", _sim_holders, "another process holds the GPU open, or all "
                                                       "such processes let go")
    holders.add_argument("gpu", help="GPU index or UUID")
    holders.add_argument("--process", help="program name of the holder")
    holders.add_argument("--pid", type=int, help="its process id")
    holders.add_argument("--release", action="store_true", help="every holder lets go")


def _sim_xid(args: argparse.Namespace, client: Client) -> int:
    return _inject(args, client, "xid", {"xid": args.xid, "gi_id": args.gi, "ci_id": args.ci})


def _sim_lost(args: argparse.Namespace, client: Client) -> int:
    return _inject(args, client, "gpu-lost", {"how": args.how})


def _sim_recover(args: argparse.Namespace, client: Client) -> int:
    return _inject(args, client, "gpu-recover", {})


def _sim_processes(args: argparse.Namespace, client: Client) -> int:
    return _inject(args, client, "processes", {"pids": args.pids})


def _sim_ecc(args: argparse.Namespace, client: Client) -> int:
    return _inject(args, client, "ecc", {"double_bit": args.double_bit})


def _sim_holders(args: argparse.Namespace, client: Client) -> int:
    if args.release == (args.process is not None or args.pid is not None):
        args.parser.error("give either --release, or --process and --pid")
    return _inject(args, client, "holders", {"release": True} if args.release else
                   {"process": args.process, "pid": args.pid})


def _inject(args: argparse.Namespace, client: Client, what: str, fields: dict) -> int:
    body = {"gpu": gpu_ref(args.gpu), **{key: value for key, value in fields.items() if value is not None}}
    _status, answer = client.request("POST", f"/v1/sim/{what}", body)
    if args.json:
        print_json(answer)
    else:
        details = " ".join(f"{key} {json.dumps(value)}" for key, value in answer.items()
                           if key not in ("injected", "gpu"))
        print(f"simulated {answer['injected']} on GPU {answer['gpu']}" + (f": {details}" if details else ""))
    return EXIT_OK


def gpu_ref(text: str) -> int | str:
    """A GPU argument as the API takes it: an index as a number, anything else (a UUID) as text."""
    return int(text) if text.isdigit() else text
