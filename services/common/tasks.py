"""Owned background tasks.

A task made with `asyncio.create_task` and dropped can be garbage collected mid-flight, and
its exception vanishes with it. Every long-lived task in a service is spawned through a
`BackgroundTasks`: it keeps the reference, logs a task that fails, and cancels what is left
when its owner closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

T = TypeVar("T")


class BackgroundTasks:
    def __init__(self, log: Any = None) -> None:
        self._log = log if log is not None else structlog.get_logger(__name__)
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._log.error("background task failed", task=task.get_name(),
                            error=f"{type(exc).__name__}: {exc}", exc_info=exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        """Cancels every task still running and waits for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
