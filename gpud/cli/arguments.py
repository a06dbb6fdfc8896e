"""How a `gpud` command is declared: the parser that reports usage errors instead of exiting, groups of
subcommands, commands that run here, and the commands that are clients of the daemon's socket (their
options, timeouts and errors)."""

from __future__ import annotations

import argparse

TYPE_CHECKING = False  # typing, difflib and urllib are imported where used: every command starts fast
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

from gpud.cli.output import EXIT_UNREACHABLE, CliError, exit_for_status, terminal_columns

CLIENT_TIMEOUT_S = 30.0
CHANGE_TIMEOUT_S = 300.0  # a GPU reset ends processes and re-reads the node: it takes longer than a read
SOCKET_HELP = "gpud's socket (default: $GPUD_SOCKET, /run/gpud/gpud.sock, your own)"


class UsageError(Exception):
    def __init__(self, message: str, usage: str, prog: str):
        super().__init__(message)
        self.message, self.usage, self.prog = message, usage, prog


class Parser(argparse.ArgumentParser):
    """Raises UsageError instead of exiting, so that main reports it (as JSON with --json)."""

    def error(self, message: str):
        raise UsageError(message, self.format_usage(), self.prog)

    def _get_formatter(self) -> argparse.HelpFormatter:
        # argparse makes a formatter for every option added (to check its metavar), and a formatter
        # without a width imports shutil (and its compressors) for the terminal's: given here, as
        # HelpFormatter computes it (the terminal's columns, else 80, less 2).
        return self.formatter_class(prog=self.prog, width=terminal_columns(80) - 2)

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
        import difflib

        choices = [str(choice) for choice in action.choices]
        close = difflib.get_close_matches(str(value), choices, n=1)
        raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {', '.join(choices)})"
                                             + (f"; did you mean {close[0]!r}?" if close else ""))


def group(parser: argparse.ArgumentParser, title: str) -> Any:
    """Subcommands under parser; given none, the command says which there are (exit 2). The global
    options are taken here too, so that they may come before the command as well as after it."""
    def missing(args: argparse.Namespace) -> int:
        raise UsageError(f"choose a command: {', '.join(sub.choices)}", parser.format_usage(), parser.prog)

    parser.set_defaults(run=missing)
    _json_option(parser)
    socket_option(parser, "the daemon's socket, for a command that talks to it", takes_it=False)
    sub = parser.add_subparsers(title=title, metavar="COMMAND")
    return sub


def _json_option(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: an option given to `gpud gpus` is not undone by the defaults of `gpud gpus reset`
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON (errors too, on stderr)")


def socket_option(parser: argparse.ArgumentParser, text: str = SOCKET_HELP, takes_it: bool = True) -> None:
    """--socket PATH, before or after the command. SUPPRESS: a value given before the command is not
    undone by the command's default (argparse copies a subcommand's defaults over its parent's); a
    command that takes it says so (takes_socket), and check_socket_option refuses it to the others."""
    parser.add_argument("--socket", default=argparse.SUPPRESS, metavar="PATH", help=text)
    if takes_it:
        parser.set_defaults(takes_socket=True)


def given_socket(args: argparse.Namespace) -> str | None:
    return getattr(args, "socket", None)


def path_argument(text: str) -> Path:
    """argparse's type for a path: pathlib is imported when a command is given one, not at every start."""
    from pathlib import Path

    return Path(text)


def check_socket_option(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if "socket" in args and not getattr(args, "takes_socket", False):
        parser = getattr(args, "parser", parser)
        raise UsageError(f"--socket: {parser.prog} does not talk to the daemon", parser.format_usage(), parser.prog)


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
    socket_option(parser)
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
    import urllib.parse

    return urllib.parse.quote(ident, safe="")
