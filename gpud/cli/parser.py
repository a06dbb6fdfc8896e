"""The `gpud` command tree: the top-level parser, its global options and epilog, and each command (added
by a function of one module of gpud.cli, gpud.cli.commands) in the order `gpud --help` lists them.

A command line that names a command imports only its module and builds only its parser: importing and
building all 22 took longer than starting Python, on every command typed and before every Slurm job.
A line that names none (`gpud --help`, a mistyped command) gets the list of commands, each a bare
parser with its help line: argparse lists them, or says which there are with a suggestion. The whole
tree is built for the generated docs and the tests that walk it."""

from __future__ import annotations

import argparse
import importlib

from gpud import __version__
from gpud.cli.arguments import Parser, group
from gpud.cli.commands import COMMANDS
from gpud.cli.output import EXIT_CODES, SOCKET_ORDER

GLOBAL_OPTIONS_WITH_A_VALUE = ("--socket",)


def epilog() -> str:
    import textwrap

    codes = "\n".join(textwrap.fill(meaning, 78, initial_indent=f"  {code}  ", subsequent_indent="     ")
                      for code, meaning in EXIT_CODES)
    order = "\n".join(textwrap.fill(place, 78, initial_indent=f"  {n}. ", subsequent_indent="     ")
                      for n, place in enumerate(SOCKET_ORDER, 1))
    return (f"exit status:\n{codes}\n\nthe daemon's socket, first found:\n{order}\n\n"
            "--json and --socket PATH go before or after the command (gpud --socket PATH status).\n"
            "--json prints the API's JSON; metrics and mig export print {\"format\": ..., \"text\": ...},\n"
            "watch one event a line; serve, device-plugin, k8s-agent and slurm health refuse --json (exit 2).\n"
            "With --json, an error is one JSON object on stderr:\n"
            '  {"error": {"code": ..., "message": ...}, "exit_code": N}')


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for this command line: its command's branch when it names one, else the list of
    commands; without a command line, the whole tree."""
    chosen = named_command(argv) if argv is not None else None
    # allow_abbrev off: an abbreviated global option (--sock PATH) would read its value as the command
    parser = Parser(prog="gpud", description="Owns the NVIDIA GPUs of this node.",
                    epilog=epilog() if chosen is None else None,
                    formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"gpud {__version__}")
    commands = group(parser, "commands")
    for name, module, adder, text in COMMANDS:
        if argv is None or name == chosen:
            getattr(importlib.import_module(f"gpud.cli.{module}"), adder)(commands)
        elif chosen is None:
            commands.add_parser(name, help=text, add_help=False)
    return parser


def named_command(argv: list[str]) -> str | None:
    """The command argv names, if it is one of gpud's and comes before any -h/--help; else None."""
    names = {name for name, _module, _adder, _text in COMMANDS}
    takes_value = False
    for arg in argv:
        if takes_value:
            takes_value = False
        elif arg in GLOBAL_OPTIONS_WITH_A_VALUE:
            takes_value = True
        elif arg in ("-h", "--help", "--"):
            return None
        elif not arg.startswith("-"):
            return arg if arg in names else None
    return None
