"""How a `gpud` command is declared: the parser that reports usage errors instead of exiting, groups of
subcommands, commands that run here, and the commands that are clients of the daemon's socket (their
options, timeouts and errors)."""

from __future__ import annotations

import argparse
import difflib
import urllib.parse
from pathlib import Path
from typing import Any

from gpud.cli.output import EXIT_UNREACHABLE, CliError, exit_for_status

CLIENT_TIMEOUT_S = 30.0
CHANGE_TIMEOUT_S = 300.0  # a GPU reset ends processes and re-reads the node: it takes longer than a read


class UsageError(Exception):
    def __init__(self, message: str, usage: str, prog: str):
        super().__init__(message)
        self.message, self.usage, self.prog = message, usage, prog


class Parser(argparse.ArgumentParser):
    """Raises UsageError instead of exiting, so that main reports it (as JSON with --json)."""

    def error(self, message: str):
        raise UsageError(message, self.format_usage(), self.prog)

    def parse_known_args(self, args=None, namespace=None):
        # Each command refuses what it does not know itself, so the error shows its own usage
        # (argparse would leave them to `gpud`, which shows the top-level usage).
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is None or value in action.choices:
            return
        choices = [str(choice) for choice in action.choices]
        close = difflib.get_close_matches(str(value), choices, n=1)
        raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {', '.join(choices)})"
                                             + (f"; did you mean {close[0]!r}?" if close else ""))


def group(parser: argparse.ArgumentParser, title: str) -> Any:
    """Subcommands under parser; given none, the command says which there are (exit 2)."""
    def missing(args: argparse.Namespace) -> int:
        raise UsageError(f"choose a command: {', '.join(sub.choices)}", parser.format_usage(), parser.prog)

    parser.set_defaults(run=missing)
    _json_option(parser)
    sub = parser.add_subparsers(title=title, metavar="COMMAND")
    return sub


def _json_option(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: an option given to `gpud gpus` is not undone by the defaults of `gpud gpus reset`
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON (errors too, on stderr)")


def local_command(parser: argparse.ArgumentParser, run) -> argparse.ArgumentParser:
    _json_option(parser)
    parser.set_defaults(run=run, parser=parser)
    return parser


def refuse_json(args: argparse.Namespace) -> None:
    """serve and device-plugin run until stopped and print logs, not a document: --json would promise
    what they do not print."""
    if args.json:
        args.parser.error("--json: it prints logs, not a JSON document (JSON logs: --log-format json)")


def add_client(commands: Any, name: str, run, text: str, timeout: float = CLIENT_TIMEOUT_S,
               **details: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=text, description=text)
    client_options(parser, run, timeout, **details)
    return parser


def client_options(parser: argparse.ArgumentParser, run, timeout: float = CLIENT_TIMEOUT_S,
                   **details: Any) -> None:
    """A subcommand that talks to the daemon's socket: the options every such command takes."""
    parser.add_argument("--socket", type=Path, default=argparse.SUPPRESS,
                        help="the daemon's socket (default: $GPUD_SOCKET, /run/gpud/gpud.sock, your own)")
    _json_option(parser)
    parser.set_defaults(run=lambda args: _client_call(args, run, timeout), parser=parser, **details)


def _client_call(args: argparse.Namespace, run, timeout: float) -> int:
    from gpud.client import ApiFailure, Client, DaemonUnreachable

    try:
        return run(args, Client(getattr(args, "socket", None), timeout=timeout))
    except DaemonUnreachable as exc:
        raise CliError(EXIT_UNREACHABLE, "daemon-unreachable", str(exc)) from None
    except ApiFailure as exc:
        details = {key: value for key, value in exc.error.items() if key not in ("code", "message")}
        raise CliError(exit_for_status(exc.status), exc.code, str(exc), http_status=exc.status,
                       **details) from None


def quoted(ident: str) -> str:
    return urllib.parse.quote(ident, safe="")
