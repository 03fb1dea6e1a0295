"""JetStream not answering (a NATS node paused, as while a stream elects a new leader) gives
a gateway's batch reads a 503 with Retry-After, never a 500, and the same read succeeds once
NATS answers again."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from llm_mesh.embedded import EmbeddedNats
from tests.batch.conftest import Gateway

LINE = b'{"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


async def test_a_paused_nats_answers_503_then_the_read_succeeds(
        gateway: Gateway, nats_server: EmbeddedNats) -> None:
    http = gateway([])
    uploaded = await http.post("/v1/files", files={"file": ("in.jsonl", LINE)},
                               data={"purpose": "batch"})
    created = await http.post("/v1/batches", json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]

    assert nats_server.process is not None
    os.kill(nats_server.process.pid, signal.SIGSTOP)
    try:
        await _until_stopped(nats_server.process.pid)
        paused = await http.get(f"/v1/batches/{batch_id}")
    finally:
        os.kill(nats_server.process.pid, signal.SIGCONT)
    assert paused.status_code == 503, paused.text
    assert paused.json()["error"]["code"] == "nats_unavailable"
    assert paused.headers["retry-after"] == "1"

    again = await http.get(f"/v1/batches/{batch_id}")
    assert again.status_code == 200 and again.json()["id"] == batch_id


async def _until_stopped(pid: int) -> None:
    """A group stop reaches each thread of the server on its own time: on a busy machine a
    thread can still answer just after kill() returns, so wait until every thread shows T."""
    tasks = Path(f"/proc/{pid}/task")
    for _ in range(1000):
        states = {(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                  for task in tasks.iterdir()}
        if states == {"T"}:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"nats-server {pid} did not stop: thread states {states}")
