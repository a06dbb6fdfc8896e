"""`gpud watch`: the daemon's event stream, one line per event, until gpud goes away or the reader of
stdout does."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import stat
import sys
import threading
import urllib.parse

from gpud.cli.arguments import add_client
from gpud.cli.commands import command_help
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, EXIT_UNREACHABLE, CliError, drop_stdout, stdout_reader_gone

TYPE_CHECKING = False  # annotations only: typing and the client are imported where used
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client


def add_watch(commands: Any) -> None:
    watch = add_client(commands, "watch", _watch, command_help("watch"))
    watch.add_argument("--since", type=int, help="replay events after this sequence number first")
    watch.add_argument("--epoch", help="the gpud run that sequence number is of (each event's 'epoch'): "
                                       "after a restart, gpud says so and replays the new run from its start")
    watch.add_argument("--types", help="comma-separated: health,mig,mps,sharing,inventory,kubernetes,allocations,claims")


class _ReaderGone(Exception):
    """The reader of stdout closed it (`gpud watch | head -1` once head has its line)."""


def _end_when_the_reader_goes() -> None:
    """Where stdout is a pipe, a thread waits for its reader to close it and then interrupts the
    main thread with SIGPIPE, which raises _ReaderGone there: the watch ends at once, even while it
    waits for the next event, rather than at the next write."""
    try:
        if not stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            return
    except (OSError, ValueError):  # stdout closed or not a real file
        return

    def gone(_signum, _frame):
        # once: the kernel's own SIGPIPE on a later write, or the thread's, must not raise again in
        # the clean-up that this one starts
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        raise _ReaderGone

    def wait_for_the_reader() -> None:
        if stdout_reader_gone(wait_s=None):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGPIPE)

    signal.signal(signal.SIGPIPE, gone)
    threading.Thread(target=wait_for_the_reader, name="stdout reader", daemon=True).start()


def _watch(args: argparse.Namespace, client: Client) -> int:
    query = urllib.parse.urlencode({key: value for key, value in (("since", args.since), ("epoch", args.epoch),
                                                                   ("types", args.types)) if value is not None})
    from gpud.client import BadAnswer, DaemonUnreachable

    epoch, seq = args.epoch, args.since
    _end_when_the_reader_goes()
    opened: list[bool] = []
    events = client.stream(f"/v1/watch?{query}" if query else "/v1/watch", _said_watching(args, client, opened))
    try:
        # closed here, not when the generator is collected: its connection's clean-up then runs where
        # the reader's going is caught
        with contextlib.closing(events):
            for event in events:
                if event.get("epoch") != epoch:  # the first line, or gpud restarted since --since
                    epoch = event.get("epoch")
                    print(f"gpud run {epoch}: resume with --since SEQ --epoch {epoch}", file=sys.stderr, flush=True)
                seq = event.get("seq", seq)
                if event.get("type") == "heartbeat":
                    continue
                if args.json:
                    print(json.dumps(event), flush=True)
                else:
                    print(f"#{event['seq']} {event['type']}: {json.dumps(event.get('data', {}))}", flush=True)
                if event.get("type") == "overflow":
                    raise CliError(EXIT_PROBLEM, "watch-overflow", event.get("data", {}).get("message", "too slow"))
    except KeyboardInterrupt:
        return EXIT_OK
    except (_ReaderGone, BrokenPipeError):
        drop_stdout()
        return EXIT_OK
    except BadAnswer:
        raise
    except DaemonUnreachable:
        if not opened:  # never reached: said as any command says it
            raise
    # The stream only ends when gpud does: at its last chunk when gpud stops, cut off when it is killed.
    resume = f" (resume with --since {seq} --epoch {epoch})" if epoch is not None and seq is not None else ""
    raise CliError(EXIT_UNREACHABLE, "daemon-gone", f"gpud on {client.socket_path} went away: the event stream "
                                                    f"ended (gpud stopped, restarted or was killed){resume}")


def _said_watching(args: argparse.Namespace, client: Client, opened: list[bool]):
    """What runs once gpud has accepted the watch (noted in opened): in text, a first line at once
    (events may be minutes apart; `gpud watch | head -1` ends with it); --json prints gpud's events only."""
    def say() -> None:
        opened.append(True)
        if not args.json:
            print(f"# watching gpud on {client.socket_path}: one line per event", flush=True)
    return say
