"""Waiting on a batch through the OpenAI client: shared by the batch e2e tests."""

from __future__ import annotations

from typing import Any

import openai

from tests.faults.streams import poll


def wait_for(client: openai.OpenAI, batch_id: str, done: Any, timeout_s: float = 180.0) -> Any:
    """The batch once `done(batch)` holds (polled every 0.2 s, failing after `timeout_s`).
    A 503 (NATS failing over under the gateway) is polled again, as a client retries it."""
    seen: list[Any] = []

    def check() -> bool:
        try:
            seen[:] = [client.batches.retrieve(batch_id)]
        except openai.APIStatusError as exc:
            if exc.status_code != 503:
                raise
            return False
        return bool(done(seen[0]))

    poll(check, timeout_s, f"batch {batch_id}", interval_s=0.2)
    return seen[0]


def finished(batch: Any) -> bool:
    return batch.status in ("completed", "failed", "cancelled", "expired")
