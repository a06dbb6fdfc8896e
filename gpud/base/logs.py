"""Structured logging: JSON lines on stdout for journald, key=value on a terminal."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# journald reads a leading "<N>" as the syslog priority (SyslogLevelPrefix=yes), so `journalctl -p err` works.
_SYSLOG_PRIORITY = {"critical": 2, "exception": 3, "error": 3, "warning": 4, "info": 6, "debug": 7}


def _journald_priority(logger, method_name: str, line: str) -> str:
    return f"<{_SYSLOG_PRIORITY.get(method_name, 6)}>{line}"


def configure_logging(level: str = "info", fmt: str = "auto", stream=None) -> None:
    stream = stream or sys.stdout
    console = fmt == "console" or (fmt == "auto" and stream.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if console:
        renderer = [structlog.dev.ConsoleRenderer(colors=False)]
    else:
        renderer = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
        if os.environ.get("JOURNAL_STREAM"):
            renderer.append(_journald_priority)
    structlog.configure(
        processors=shared + renderer,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    # Libraries (aiohttp, asyncio) log through the standard library: render them the same way.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared[1:] + [structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta] + renderer,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS[level], logging.WARNING) if level != "debug" else logging.DEBUG)


def get_logger(name: str):
    # Stays lazy (unlike .bind()), so module-level loggers pick up the configuration made at start-up.
    return structlog.get_logger(component=name)


def configure_log_level(level: str) -> None:
    """Changes the level of a running gpud (on reload), keeping everything else."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]))
