"""`gpud nfd` and `gpud cdi`: the files gpud keeps written for others, Node Feature Discovery's labels
and the CDI spec for container runtimes."""

from __future__ import annotations

import argparse
import time

from gpud.cli.arguments import add_client
from gpud.cli.commands import command_help
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, print_json, table, warn

TYPE_CHECKING = False  # annotations only: typing and the client are imported where used
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client


def add_nfd(commands: Any) -> None:
    add_client(commands, "nfd", _nfd, command_help("nfd"))


def _nfd(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/nfd")
    problem = EXIT_PROBLEM if view["error"] else EXIT_OK
    if args.json:
        print_json(view)
        return problem
    if not view["enabled"]:
        print(f"off (nfd.enabled is false): nothing is written to {view['path']}")
        return EXIT_OK
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(view["written_at"])) if view["written_at"] \
        else "not yet"
    print(f"file: {view['path']}  written: {written}  size: {view['bytes']} bytes")
    if view["error"]:
        print(f"error: {view['error']}")
    if view.get("waiting"):
        print(f"not written: {view['waiting']}")
        return EXIT_OK
    print(table([("LABEL", "VALUE"), *sorted(view["labels"].items())]))
    for dropped in view["dropped"]:
        warn(f"left out {dropped['label']}={dropped['value']}: {dropped['reason']}")
    return problem


def add_cdi(commands: Any) -> None:
    add_client(commands, "cdi", _cdi, command_help("cdi"))


def _cdi(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/cdi")
    if args.json:
        print_json(view)
    elif not view["enabled"]:
        print("CDI spec: off (cdi.enabled is false)")
    else:
        print(f"CDI spec: {view['path']}  kind: {view['kind']}  devices: {len(view['devices'])}")
        for name in view["devices"]:
            print(f"  {view['kind']}={name}")
        for device in view["unavailable"]:
            print(f"  left out: {device['device']}: {device['reason']}")
        if view["error"]:
            print(f"error: {view['error']}")
    return EXIT_PROBLEM if view["error"] else EXIT_OK
