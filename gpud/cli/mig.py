"""`gpud mig`: layouts, status, apply, export, and validate (a layouts file, here)."""

from __future__ import annotations

import argparse
import time
import urllib.parse
from pathlib import Path

from gpud.cli.arguments import CHANGE_TIMEOUT_S, add_client, group, local_command
from gpud.cli.commands import command_help
from gpud.cli.output import (EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, CliError, print_json, print_text, table,
                             terminal_columns, warn)
from gpud.cli.validate import validate_file

TYPE_CHECKING = False  # annotations only: typing and the client are imported where used
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client


def add_mig(commands: Any) -> None:
    mig = group(commands.add_parser("mig", help=command_help("mig")),
                "mig commands")
    add_client(mig, "status", _mig_status, "the desired layout and each GPU's state (exit 1 out of sync)")
    layouts = add_client(mig, "layouts", _mig_layouts, "the named layouts that fit this node, one line "
                                                       "each (* = current)")
    layouts.add_argument("--all", action="store_true", help="then the layouts that do not fit, with why")
    export = add_client(mig, "export", _mig_export, "this node's MIG layout as a mig-parted file")
    export.add_argument("--name", help="the layout's name in the file (default: current)")
    apply = add_client(mig, "apply", _mig_apply, "apply a named layout", timeout=CHANGE_TIMEOUT_S)
    apply.add_argument("layout")
    apply.add_argument("--file", type=Path, help="take the layout from this mig-parted file (sent to gpud) "
                                                 "instead of gpud's layouts file")
    apply.add_argument("--dry-run", action="store_true", help="show the plan; touch nothing")
    apply.add_argument("--force", action="store_true", help="destroy MIG devices even if processes run on them")
    apply.add_argument("--no-wait", action="store_true", help="return once the apply has started")
    validate = mig.add_parser("validate", help="check a mig-parted layouts file (exit 0 valid, 2 invalid)")
    validate.add_argument("path", type=Path)
    validate.add_argument("--strict", action="store_true", help="warnings are errors (exit 2)")
    local_command(validate, _mig_validate)


def _mig_status(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/mig")
    # dynamic MIG GPUs (dra.dynamic_mig_gpus): layouts leave them out, DRA claims make their MIG devices
    dynamic = client.get("/v1/mig/dynamic") if any(gpu.get("dynamic") for gpu in view["gpus"]) else None
    if args.json:
        print_json({**view, "dynamic_mig": dynamic} if dynamic else view)
        return EXIT_OK if view["in_sync"] else EXIT_PROBLEM
    print(f"layout: {view['layout'] or '(none)'}  state: {view['state']}  in sync: "
          f"{'yes' if view['in_sync'] else 'no'}" + (f"\nerror: {view['error']}" if view["error"] else ""))
    rows = [("GPU", "IN SYNC", "STATE", "DESIRED", "ACTUAL")]
    for gpu in view["gpus"]:
        rows.append((str(gpu["index"]), "yes" if gpu["in_sync"] else "no", gpu["state"] or "-",
                     "dynamic (DRA claims)" if gpu.get("dynamic") else devices_text(gpu["desired"]),
                     devices_text(gpu["actual"])))
    print(table(rows))
    if dynamic:
        print("\ndynamic MIG devices of DRA claims:" if dynamic["instances"] else "\nno dynamic MIG device is held")
        if dynamic["instances"]:
            print(table([("GPU", "PROFILE", "SLICES", "STATE", "MIG UUID", "CLAIM")] + [
                (str(i["gpu_index"]), i["profile"], f"{i['placement']['start']}+{i['placement']['size']}",
                 i["state"], i["uuid"] or "-", i["claim"]) for i in dynamic["instances"]]))
    return EXIT_OK if view["in_sync"] else EXIT_PROBLEM


def _mig_layouts(args: argparse.Namespace, client: Client) -> int:
    """What fits this node first, one line per layout (the current one, fitting or not, among them);
    with --all, then the rest with why each does not fit."""
    view = client.get("/v1/mig/layouts")
    if args.json:
        print_json(view)
        return EXIT_OK
    first = [layout for layout in view["layouts"] if layout["fits"] or layout["active"]]
    rest = [layout for layout in view["layouts"] if layout not in first]
    print(f"from {view['source']}: {sum(layout['fits'] for layout in view['layouts'])} of {len(view['layouts'])} "
          "layouts fit this node (* = current)")
    rows = [("  LAYOUT", "FITS", "CHANGES")]
    for layout in first:
        changes = "-" if layout["gpus_changed"] is None else f"{layout['gpus_changed']} GPUs"
        rows.append((("* " if layout["active"] else "  ") + layout["name"], _fits_text(layout),
                     changes + (", needs root" if layout.get("needs_root") else "")))
    print(table(rows))
    for sentence in dict.fromkeys(layout["needs_root"] for layout in first if layout.get("needs_root")):
        print(f"needs root: {sentence}")
    if rest and args.all:
        print("\ndo not fit this node:")
        print(table([("  LAYOUT", "FITS", "WHY NOT"),
                     *((f"  {layout['name']}", _fits_text(layout), layout["reason"] or "") for layout in rest)],
                    terminal_columns()))
    elif rest:
        print(f"{len(rest)} more do not fit this node: gpud mig layouts --all says why")
    of_layouts = {text for layout in view["layouts"] for text in layout["warnings"]}
    shown = [text for layout in first + (rest if args.all else []) for text in layout["warnings"]]
    for text in dict.fromkeys(shown + [text for text in view["warnings"] if text not in of_layouts]):
        warn(text)
    return EXIT_OK


def _fits_text(layout: dict) -> str:
    if layout.get("matching_gpus") == 0:
        return "no GPU"  # its device filters select none of this node's GPUs
    return "yes" if layout["fits"] else "no"


def _mig_export(args: argparse.Namespace, client: Client) -> int:
    path = f"/v1/mig/export?{urllib.parse.urlencode({'name': args.name})}" if args.name else "/v1/mig/export"
    _status, text = client.request_text("GET", path)
    print_text(args.json, "mig-parted-yaml", text)
    return EXIT_OK


def _mig_apply(args: argparse.Namespace, client: Client) -> int:
    body: dict[str, Any] = {"layout": args.layout, "force": args.force, "dry_run": args.dry_run}
    if args.file is not None:
        body["config"] = _local_text(args.file)
    _status, started = client.request("PUT", "/v1/mig", body)
    if args.dry_run or args.no_wait:
        if args.json:
            print_json(started)
        else:
            _print_plan(started["plan"])
            if started.get("needs_root"):
                print(f"needs root: {started['needs_root']}")
        return EXIT_OK
    if not args.json:
        _print_plan(started["plan"])
    view = _follow_apply(client, quiet=args.json)
    if args.json:
        print_json(view)
    else:
        print(f"layout {view['layout']}: {view['state']}" + (f" — {view['error']}" if view["error"] else ""))
    return EXIT_OK if view["state"] == "success" else EXIT_PROBLEM


def _local_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(EXIT_USAGE, "file-unreadable", f"{path}: {getattr(exc, 'strerror', None) or exc}") from None


def _print_plan(plan: list[dict]) -> None:
    for gpu in plan:
        print(f"GPU {gpu['index']}: keep {gpu['keep']}, destroy {len(gpu['destroy'])}, "
              f"create {', '.join(c['profile'] for c in gpu['create']) or 'nothing'} ({gpu['mutations']} changes)")


def _follow_apply(client: Client, quiet: bool) -> dict:
    """/v1/mig once the apply is over, saying each GPU's state as it changes."""
    shown: dict[int, str] = {}
    while True:
        view = client.get("/v1/mig")
        for gpu in view["gpus"]:
            if gpu["state"] and shown.get(gpu["index"]) != gpu["state"]:
                shown[gpu["index"]] = gpu["state"]
                if not quiet:
                    print(f"GPU {gpu['index']}: {gpu['state']}" + (f" — {gpu['error']}" if gpu["error"] else ""))
        if view["state"] != "applying":
            return view
        time.sleep(0.2)


def devices_text(side: dict | None) -> str:
    if side is None:
        return "(left alone)"
    if not side["mig_enabled"]:
        return "MIG off"
    return ", ".join(f"{count}× {name}" for name, count in side["devices"].items()) or "MIG on, no devices"


def _mig_validate(args: argparse.Namespace) -> int:
    from gpud.mig.layouts import LayoutError, check_layouts, check_layouts_file

    return validate_file(args, check_layouts_file, check_layouts, LayoutError,
                         lambda layouts: {"layouts": list(layouts)},
                         lambda layouts: f"{len(layouts)} layouts: {', '.join(layouts)}", "a MIG layouts file")
