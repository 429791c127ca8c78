"""structlog setup: JSON lines when stdout is not a terminal (production), console otherwise."""
from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "auto", level: str = "info") -> None:
    if fmt == "auto":
        fmt = "console" if sys.stdout.isatty() else "json"
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # One write a line: broker processes share this stdout, unbuffered under the deploy files, and print()
        # writes the line and its newline apart, so two processes' lines could mix.
        logger_factory=structlog.WriteLoggerFactory(sys.stdout),
        cache_logger_on_first_use=False,
    )
    # aio-pika/aiormq log through stdlib logging: keep their warnings, route to stderr.
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
