"""The `gpud` command: `gpud serve` runs the daemon; the other subcommands are clients of its socket, or
check local files. The command tree: gpud.cli.parser, one module per group of commands; exit codes and
error output: gpud.cli.output."""

from __future__ import annotations

import sys

from gpud.cli.arguments import UsageError, check_socket_option
from gpud.cli.output import EXIT_USAGE, CliError, exit_code_of


def main(argv: list[str] | None = None) -> int:
    # The command tree is imported when a command runs, not with this package: gpud.slurm.health imports
    # gpud.cli.output, and `python -m gpud.cli.doctor` runs a module of the tree (runpy warns when the
    # module it runs was imported before), neither with the tree.
    from gpud.cli.parser import build_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = ["--json" in (argv[:argv.index("--")] if "--" in argv else argv)]  # the parsed answer, once known

    def command() -> int:
        try:
            parser = build_parser(argv)
            args = parser.parse_args(argv)
            as_json[0] = args.json = getattr(args, "json", False)
            check_socket_option(args, parser)
            return args.run(args)
        except SystemExit as exc:  # --help, --version
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        except UsageError as exc:
            if not as_json[0]:
                print(exc.usage, end="", file=sys.stderr)
            command = exc.prog.removeprefix("gpud").strip()  # report_error says "gpud: " itself
            raise CliError(EXIT_USAGE, "usage", f"{command}: {exc.message}" if command else exc.message) from None

    return exit_code_of(command, lambda: as_json[0])
