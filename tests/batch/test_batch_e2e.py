"""Batch jobs end to end: the official openai client's batch flow through the gateway, a
batch runner process in the real mesh, SIGKILL mid-job, malformed lines, and cancel."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.batch.polling import finished, wait_for
from tests.mesh import REPO_ROOT, Mesh

pytestmark = pytest.mark.slow

MAX_CONCURRENT_LINES = 16
RUNNER_ARGS = ["--max-concurrent-lines", str(MAX_CONCURRENT_LINES), "--job-ack-wait-s", "2"]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def runner_mesh(mesh: Mesh) -> Iterator[Mesh]:
    mesh.add_service("batch", RUNNER_ARGS)
    yield mesh
    assert mesh.remove_service("batch") == 0, mesh.services["gateway"].log_tail()


@pytest.fixture(scope="module")
def client(runner_mesh: Mesh) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{runner_mesh.base_url}/v1", api_key="unused",
                       max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat_body(model: str, i: int, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}]}


def jsonl(items: list[dict[str, Any] | str]) -> bytes:
    return "\n".join(i if isinstance(i, str) else json.dumps(i) for i in items).encode() + b"\n"


def request(custom_id: str, body: dict[str, Any], url: str = CHAT) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def create_batch(client: openai.OpenAI, data: bytes) -> str:
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(data)
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                  completion_window="24h")
    assert batch.status in ("validating", "in_progress")
    return batch.id


def entries(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def finished_in_engine(mesh: Mesh) -> float:
    try:
        return mesh.scheduler_metric("vllm:request_success_total")
    except KeyError:  # no request has finished yet
        return 0.0


def test_openai_client_batch_flow(client: openai.OpenAI, model_name: str) -> None:
    bodies = {f"req-{i}": chat_body(model_name, i) for i in range(50)}
    batch_id = create_batch(client, jsonl([request(k, b) for k, b in bodies.items()]))
    batch = wait_for(client, batch_id, finished)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (50, 50, 0)
    assert batch.error_file_id is None and batch.usage.output_tokens > 0
    outputs = entries(client, batch.output_file_id)
    assert sorted(e["custom_id"] for e in outputs) == sorted(bodies)
    for entry in outputs:
        body = entry["response"]["body"]
        assert entry["response"]["status_code"] == 200 and entry["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == model_name
        assert 1 <= body["usage"]["completion_tokens"] <= 4
    # Correct: the same answers as the same requests sent interactively (greedy).
    by_id = {e["custom_id"]: e["response"]["body"] for e in outputs}
    sample = ["req-0", "req-17", "req-49"]
    with ThreadPoolExecutor(len(sample)) as pool:
        direct = list(pool.map(lambda k: client.chat.completions.create(**bodies[k]), sample))
    for custom_id, answer in zip(sample, direct):
        assert by_id[custom_id]["choices"][0]["message"]["content"] == \
            answer.choices[0].message.content
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]


def test_malformed_lines_become_error_entries(client: openai.OpenAI, model_name: str) -> None:
    items: list[dict[str, Any] | str] = [
        request("good-1", chat_body(model_name, 1)),
        "{this is not json",
        {"method": "POST", "url": CHAT, "body": chat_body(model_name, 2)},
        request("wrong-url", chat_body(model_name, 3), url="/v1/completions"),
        request("no-messages", {"model": model_name, "max_tokens": 4}),
        request("good-1", chat_body(model_name, 4)),
        request("good-2", chat_body(model_name, 5)),
    ]
    batch = wait_for(client, create_batch(client, jsonl(items)), finished)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 5)
    assert [e["custom_id"] for e in entries(client, batch.output_file_id)] == ["good-1", "good-2"]
    errors = entries(client, batch.error_file_id)
    assert [(e["custom_id"], (e["error"] or {}).get("code")) for e in errors] == [
        (None, "invalid_json"), (None, "missing_custom_id"), ("wrong-url", "mismatched_url"),
        ("no-messages", None), ("good-1", "duplicate_custom_id")]
    refused = errors[3]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "messages"


def test_runner_killed_mid_job_finishes_every_line_once(runner_mesh: Mesh,
                                                        client: openai.OpenAI,
                                                        model_name: str) -> None:
    engine_requests_before = finished_in_engine(runner_mesh)
    # Four waves of lines: the first progress report comes after the first wave, so the
    # kill lands mid-job however fast the engine is.
    custom_ids = [f"kill-{i}" for i in range(4 * MAX_CONCURRENT_LINES)]
    batch_id = create_batch(client, jsonl([request(k, chat_body(model_name, i, 8))
                                           for i, k in enumerate(custom_ids)]))
    wait_for(client, batch_id, lambda b: b.request_counts.completed >= 1)
    runner_mesh.services["batch"].stop(signal.SIGKILL)
    done_at_kill = client.batches.retrieve(batch_id).request_counts.completed
    runner_mesh.restart("batch")  # the job comes back to it once its ack wait (2 s) is over
    batch = wait_for(client, batch_id, finished)
    assert batch.status == "completed" and done_at_kill < len(custom_ids)
    outputs = entries(client, batch.output_file_id)
    assert sorted(e["custom_id"] for e in outputs) == sorted(custom_ids)
    assert batch.request_counts.completed == len(custom_ids) and batch.error_file_id is None
    # Lines finished before the kill did not run again: at most those in flight did.
    engine_requests = finished_in_engine(runner_mesh) - engine_requests_before
    assert engine_requests <= len(custom_ids) + MAX_CONCURRENT_LINES


def test_cancel_keeps_the_lines_already_finished(client: openai.OpenAI,
                                                 model_name: str) -> None:
    batch_id = create_batch(client, jsonl([request(f"c-{i}", chat_body(model_name, i))
                                           for i in range(200)]))
    wait_for(client, batch_id, lambda b: b.request_counts.completed >= 4)
    assert client.batches.cancel(batch_id).status == "cancelling"
    batch = wait_for(client, batch_id, finished)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    outputs = entries(client, batch.output_file_id)
    assert 4 <= len(outputs) == batch.request_counts.completed < 200
    assert len({e["custom_id"] for e in outputs}) == len(outputs)


def test_example_runs_a_batch_over_nats_alone(runner_mesh: Mesh) -> None:
    assert runner_mesh.nats is not None
    done = subprocess.run(
        [sys.executable, "examples/batch_over_nats.py", "--nats-url", runner_mesh.nats.url,
         "--namespace", runner_mesh.namespace, "--count", "3", "--max-tokens", "4"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "completed: 3 completed, 0 failed of 3" in done.stdout
    assert sorted(line.split(":")[0] for line in done.stdout.splitlines()
                  if line.startswith("question-")) == ["question-0", "question-1", "question-2"]
