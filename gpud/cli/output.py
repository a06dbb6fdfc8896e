"""What the `gpud` command prints and how it exits: exit codes, errors (text or JSON on stderr),
tables that fit the terminal. Standard library only, and only what every command needs (textwrap when
a table wraps, no shutil, no typing): the CLI starts fast."""

from __future__ import annotations

import json
import os
import select
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_CODES = (
    (EXIT_OK, "ok"),
    (EXIT_PROBLEM, "a problem was found: the node or a GPU is not healthy, an apply failed, or gpud refused a "
                   "valid request (HTTP 403, 409, 429, 5xx)"),
    (EXIT_USAGE, "usage error or invalid input: bad arguments, a bad local file, or gpud answered 400, 404, 405, "
                 "413 or 422"),
    (EXIT_UNREACHABLE, "gpud is unreachable: no socket, connection refused, no answer in time, or gpud went "
                       "away mid-answer"),
)
SOCKET_ORDER = ("--socket PATH", "$GPUD_SOCKET", "/run/gpud/gpud.sock when it exists (the system gpud)",
                "your own runtime directory: $XDG_RUNTIME_DIR/gpud/gpud.sock, or /tmp/gpud-UID/gpud.sock where "
                "XDG_RUNTIME_DIR is unset (/run/gpud as root), only if no other user can write there")
NARROWEST_WRAPPED_COLUMN = 24


class CliError(Exception):
    """A command failed: exits with exit_code after saying what (as text, or JSON with --json)."""

    def __init__(self, exit_code: int, code: str, message: str, **details: Any):
        super().__init__(message)
        self.exit_code, self.code, self.message, self.details = exit_code, code, message, details


def exit_code_of(body: Callable[[], int], as_json: Callable[[], bool]) -> int:
    """body's exit code, or the one for how it ended: its error said (as JSON when as_json() says so at
    that point), the reader of stdout gone, Ctrl-C. Shared by `gpud` and `kubectl gpud`."""
    try:
        return body()
    except CliError as exc:
        return report_error(exc, as_json())
    except BrokenPipeError:
        drop_stdout()
        return EXIT_OK
    except KeyboardInterrupt:
        return 130  # the shell's code for Ctrl-C


def exit_for_status(status: int) -> int:
    """The exit code for an error status of the API: the request was wrong (2), or it was refused (1)."""
    if status >= 500 or status in (403, 408, 409, 429):
        return EXIT_PROBLEM
    return EXIT_USAGE


def report_error(error: CliError, as_json: bool) -> int:
    if as_json:
        document = {"error": {"code": error.code, "message": error.message, **error.details},
                    "exit_code": error.exit_code}
        print(json.dumps(document), file=sys.stderr)
    else:
        code = f" ({error.code})" if "http_status" in error.details else ""  # gpud's slug, to search its docs
        print(f"gpud: {error.message}{code}", file=sys.stderr)
        for key, value in error.details.items():
            if isinstance(value, list) and value:
                print(f"  {key.replace('_', ' ')}:", file=sys.stderr)
                for item in value:
                    print(f"    {_item_text(item)}", file=sys.stderr)
    return error.exit_code


def _item_text(item: Any) -> str:
    if isinstance(item, dict) and {"gpu", "reason"} <= item.keys():  # a reset blocker, a busy GPU
        return f"GPU {item['gpu']}: {item['reason']}"
    if isinstance(item, dict):
        return ", ".join(f"{key} {value}" for key, value in item.items())
    return str(item)


def stdout_reader_gone(wait_s: float | None = 0) -> bool:
    """Whether stdout is a pipe whose reader has closed it, waiting up to wait_s seconds for that
    (None: as long as it takes): poll(2) reports POLLERR on such a write end, before any write fails."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # no events asked: only POLLERR and POLLHUP wake it
        timeout_ms = None if wait_s is None else int(wait_s * 1000)
        return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(timeout_ms))
    except (OSError, ValueError):  # stdout closed or not a real file: nothing to tell
        return False


def drop_stdout() -> None:
    """The reader of stdout went away (`gpud watch | head -1`): what Python would flush at exit goes
    nowhere instead of failing again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def print_json(document: Any) -> None:
    print(json.dumps(document, indent=2))


def print_text(as_json: bool, text_format: str, text: str) -> None:
    """A route's text (YAML, Prometheus) as it is; with --json, inside a JSON object that says its format."""
    if as_json:
        print_json({"format": text_format, "text": text})
    else:
        print(text, end="")


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def terminal_columns(fallback: int = 100) -> int:
    """The terminal's width ($COLUMNS first); fallback when the output is not a terminal: what
    shutil.get_terminal_size((fallback, 24)) answers, without importing shutil (and its compressors)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or fallback
    except (AttributeError, ValueError, OSError):
        return fallback


def table(rows: list[tuple[str, ...]], width: int | None = None) -> str:
    """Left-aligned columns two spaces apart. With a width, the last column is wrapped so that every
    line fits it (continuation lines start under that column)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        head = "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " if len(row) > 1 else ""
        last = [row[-1]] if width is None else _wrapped(row[-1], max(width - len(head), NARROWEST_WRAPPED_COLUMN))
        lines.append((head + last[0]).rstrip())
        lines.extend((" " * len(head) + more).rstrip() for more in last[1:])
    return "\n".join(lines)


def _wrapped(text: str, width: int) -> list[str]:
    import textwrap

    pieces = [line for paragraph in text.split("\n")
              for line in (textwrap.wrap(paragraph, width, break_on_hyphens=False) or [""])]
    return pieces or [""]


def reasons_text(reasons: list[dict]) -> str:
    return "; ".join(f"{r['kind']} {r['code']}: {r['message']} (×{r['count']}, action: {r['action']})"
                     for r in reasons)
