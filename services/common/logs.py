"""structlog set-up: JSON lines (or a console renderer on a terminal) with the request id
bound through contextvars, so every line logged while handling a request carries it."""

from __future__ import annotations

import logging
import sys
from contextlib import AbstractContextManager

import structlog



def request_log_context(request_id: str) -> AbstractContextManager[object]:
    """Every line logged inside it (in this task, and in tasks it starts) carries
    `request_id`; the binding ends with the block, so a loop serving many requests one
    after another never tags a line with the wrong one."""
    return structlog.contextvars.bound_contextvars(request_id=request_id)


def bind_request_id(request_id: str) -> None:
    """Tags every later line of this task with `request_id`, for a task that serves one
    request to its end (an HTTP response stream: an async generator may be closed from
    another context, where a scoped binding could not be undone)."""
    structlog.contextvars.bind_contextvars(request_id=request_id)


def configure_logging(service: str, instance_id: str, level: str = "info",
                      log_format: str = "auto") -> structlog.stdlib.BoundLogger:
    if log_format == "auto":
        log_format = "console" if sys.stderr.isatty() else "json"
    renderer = (structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
                if log_format == "console" else structlog.processors.JSONRenderer())
    numeric_level = logging.getLevelName(level.upper())
    def add_identity(_: object, __: str, event: dict) -> dict:
        # A processor, not a contextvar: lines logged from worker threads carry it too.
        event.setdefault("service", service)
        event.setdefault("instance", instance_id)
        return event

    structlog.configure(
        processors=[
            add_identity,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries that use stdlib logging (uvicorn, nats) go to the same stream.
    logging.basicConfig(level=max(numeric_level, logging.WARNING), stream=sys.stderr,
                        format=f"%(asctime)s {service} %(name)s %(levelname)s %(message)s")
    return structlog.get_logger(service)
