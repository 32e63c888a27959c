"""structlog set-up shared by every elastictrain process (agent, discover, workers, launcher).

JSON lines on stderr by default; a readable console renderer when stderr is a terminal. Context such
as ``job``, ``host``, ``rank`` and ``step`` is bound with :func:`bind` and appears on every line.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

from elastictrain import envnames

_configured = False


def configure_logging(level: str | None = None, *, json: bool | None = None, **context: Any) -> None:
    """Configure structlog once per process; later calls only bind ``context``.

    ``json`` defaults to ``not sys.stderr.isatty()``; ``ELASTICTRAIN_LOG_FORMAT=json|console`` overrides
    it and ``ELASTICTRAIN_LOG_LEVEL`` sets the level (default ``info``).
    """
    global _configured
    if not _configured:
        level_name = (level or os.environ.get(envnames.LOG_LEVEL, "info")).upper()
        fmt = os.environ.get(envnames.LOG_FORMAT)
        use_json = (
            (fmt == "json") if fmt in ("json", "console") else (json if json is not None else not sys.stderr.isatty())
        )
        renderer: Any = (
            structlog.processors.JSONRenderer()
            if use_json
            else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        )
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.StackInfoRenderer(),
                structlog.processors.format_exc_info,
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=True,
        )
        _configured = True
    if context:
        bind(**context)


def bind(**context: Any) -> None:
    """Bind fields (job, host, rank, local_rank, world_size, step, ...) to every later log line."""
    structlog.contextvars.bind_contextvars(**context)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name) if name else structlog.get_logger()
