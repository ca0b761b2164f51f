"""structlog set-up for duplex_actors' own entry points.

The library only *uses* structlog: importing it configures nothing. The entry points call
:func:`ensure_configured` (the ``duplex-actors`` command, serve's worker and engine processes,
the Ray Serve deployer), and so does a :class:`~duplex_actors.Runtime` made while structlog is
unconfigured: a level filter (warnings and up), so that structlog's defaults do not render
every event. Applications that configured structlog keep their set-up. The session core logs
its transitions (debug) only when structlog is configured to show them.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of each write, not the stream it was
    when logging was configured: a server replaces it once it runs (server/lossy_output.py),
    and a test's capture replaces it for a while."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str = "info", *, json: bool = False, stream: TextIO | None = None) -> None:
    """Configure structlog for duplex_actors' events: ``level`` and up, rendered as JSON lines
    or for the console, to ``stream`` (stderr, as it is at each write, by default)."""
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        # print() needs only write and flush of its file
        logger_factory=structlog.PrintLoggerFactory(stream or cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=False,
    )


def ensure_configured(level: str = "warning") -> None:
    """:func:`configure` at ``level``, unless structlog is configured already."""
    if not structlog.is_configured():
        configure(level)
