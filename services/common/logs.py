"""structlog set-up: JSON lines (or a console renderer on a terminal) with the request id
bound through contextvars, so every line logged while handling a request carries it."""

from __future__ import annotations

import logging
import sys

import structlog

bind_request_id = structlog.contextvars.bind_contextvars
clear_request_id = structlog.contextvars.clear_contextvars


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
