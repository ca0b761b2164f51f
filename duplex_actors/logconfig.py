"""structlog set-up for duplex_actors' own entry points.

The library only *uses* structlog; applications that configured it keep their set-up. When
nothing is configured (a bare ``import``), :func:`ensure_configured` installs a level filter so
per-transition debug events cost a no-op call instead of a rendered line.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info", *, json: bool = False, stream=None) -> None:
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def ensure_configured(level: str = "warning") -> None:
    if not structlog.is_configured():
        configure(level)
