"""The `gpud` command: `gpud serve` runs the daemon; the other subcommands are clients of its socket, or
check local files. The command tree: gpud.cli.parser, one module per group of commands; exit codes and
error output: gpud.cli.output."""

from __future__ import annotations

import sys

from gpud.cli.arguments import UsageError
from gpud.cli.output import EXIT_OK, EXIT_USAGE, CliError, drop_stdout, report_error


def main(argv: list[str] | None = None) -> int:
    # The command tree is imported when a command runs, not with this package: gpud.slurm.health imports
    # gpud.cli.output, and `python -m gpud.cli.doctor` runs a module of the tree (runpy warns when the
    # module it runs was imported before), neither with the tree.
    from gpud.cli.parser import build_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in (argv[:argv.index("--")] if "--" in argv else argv)
    try:
        args = build_parser().parse_args(argv)
        as_json = getattr(args, "json", False)
        args.json = as_json
        return args.run(args)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except UsageError as exc:
        if not as_json:
            print(exc.usage, end="", file=sys.stderr)
        command = exc.prog.removeprefix("gpud").strip()  # report_error says "gpud: " itself
        return report_error(CliError(EXIT_USAGE, "usage", f"{command}: {exc.message}" if command else exc.message),
                            as_json)
    except CliError as exc:
        return report_error(exc, as_json)
    except BrokenPipeError:
        drop_stdout()
        return EXIT_OK
    except KeyboardInterrupt:
        return 130  # the shell's code for Ctrl-C
