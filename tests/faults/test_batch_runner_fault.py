"""SIGKILL of the batch runner mid-job: the lines it had in the engines are dropped there
(the tokenizer sees the runner's heartbeat stop and the engines abort what nobody reads),
and the restarted runner finishes the job with every line exactly once."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.faults.conftest import MODEL, metric, record, wait_idle
from tests.faults.streams import poll
from tests.mesh import Mesh

pytestmark = pytest.mark.slow

NUM_LINES = 16
RUNNER_ARGS = ["--max-concurrent-lines", "8", "--job-ack-wait-s", "2"]


@pytest.fixture(scope="module")
def runner(fault_mesh: Mesh) -> Iterator[Mesh]:
    fault_mesh.add_service("batch", RUNNER_ARGS)
    yield fault_mesh
    assert fault_mesh.remove_service("batch") == 0


def line(i: int) -> dict[str, Any]:
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                     "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]}}


def test_batch_runner_killed_mid_job(runner: Mesh) -> None:
    with openai.OpenAI(base_url=f"{runner.base_url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        data = "\n".join(json.dumps(line(i)) for i in range(NUM_LINES)).encode() + b"\n"
        uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
        batch_id = client.batches.create(input_file_id=uploaded.id,
                                         endpoint="/v1/chat/completions",
                                         completion_window="24h").id

        def under_way() -> bool:
            """Some lines done and others in the engines: the moment to kill the runner."""
            completed = client.batches.retrieve(batch_id).request_counts.completed
            # NOTE: a job that ends between two looks can never be killed mid-job: say so at
            # once rather than wait out the timeout (each line's 64 tokens keep it open).
            assert completed < NUM_LINES, "the job finished before it was seen under way"
            return completed >= 1 and (metric(runner, "scheduler", "vllm:num_requests_running")
                                       + metric(runner, "scheduler-1",
                                                "vllm:num_requests_running")) > 0

        poll(under_way, 120, "the job to be under way")
        killed = time.monotonic()
        runner.services["batch"].stop(signal.SIGKILL)
        done_at_kill = client.batches.retrieve(batch_id).request_counts.completed
        # Nobody reads the killed runner's lines any more: the engines drop them.
        idle_after = wait_idle(runner, 60, "the engines to drop its lines")
        runner.restart("batch")     # the job comes back to it after its ack wait (2 s)
        finished = poll(lambda: client.batches.retrieve(batch_id).status == "completed",
                        180, "the job to complete")
        batch = client.batches.retrieve(batch_id)
        outputs = [json.loads(x) for x in
                   client.files.content(batch.output_file_id).text.splitlines()]
    assert done_at_kill < NUM_LINES
    assert sorted(e["custom_id"] for e in outputs) == sorted(f"line-{i}"
                                                             for i in range(NUM_LINES))
    assert all(e["response"]["status_code"] == 200 for e in outputs)
    assert batch.request_counts.completed == NUM_LINES and batch.error_file_id is None
    record("batch runner SIGKILL mid-job", client_saw="the batch completed, each line once",
           lines_done_at_kill=done_at_kill, engines_idle_after_s=idle_after,
           job_done_after_s=time.monotonic() - killed, restart_to_done_s=finished)
