"""`gpud mig validate` and `gpud sharing validate`: a file checked here, without the daemon."""

from __future__ import annotations

import argparse

from gpud.cli.output import EXIT_OK, EXIT_USAGE, CliError, print_json, warn


def validate_file(args: argparse.Namespace, check, error_type: type, facts, summary) -> int:
    """`gpud … validate FILE [--strict]`: exit 0 with a summary (warnings on stderr), or 2 with the
    error; with --strict, warnings are errors."""
    path = args.path
    try:
        loaded, warnings = check(path)
    except error_type as exc:
        raise CliError(EXIT_USAGE, "file-invalid", str(exc)) from None
    except OSError as exc:
        raise CliError(EXIT_USAGE, "file-unreadable", f"{path}: {exc.strerror or exc}") from None
    if args.strict and warnings:
        raise CliError(EXIT_USAGE, "file-warnings", f"{path}: {len(warnings)} warning{'s' if len(warnings) > 1 else ''} (--strict)", warnings=warnings)
    if args.json:
        print_json({"path": str(path), "valid": True, **facts(loaded), "warnings": warnings})
        return EXIT_OK
    for text in warnings:
        warn(text)
    print(f"{path}: valid, {summary(loaded)}")
    return EXIT_OK
