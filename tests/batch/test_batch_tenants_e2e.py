"""Batches per API key in the real mesh: a gateway and a batch runner given two keys join it;
a batch runs as the key that created it (its lines hit that key's prefix cache and no other
key's), and the other key cannot see the batch or its output; a batch sent straight over
NATS with a key's id as its owner is that key's."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from services.common.ports import free_port
from tests.batch.polling import finished, wait_for
from tests.faults.streams import poll
from tests.mesh import REPO_ROOT, Mesh, http_get

pytestmark = pytest.mark.slow

ALPHA, BETA = "alpha-key", "beta-key"
KEYS = ["--api-key", ALPHA, "--api-key", BETA]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def keyed_url(mesh: Mesh) -> Iterator[str]:
    """The address of a gateway with both keys, and a batch runner with the same keys."""
    port = free_port()
    mesh.add_service("gateway-keyed", ["--port", str(port), *KEYS], kind="gateway")
    mesh.add_service("batch-keyed", [*KEYS, "--job-ack-wait-s", "2"], kind="batch")
    url = f"http://127.0.0.1:{port}"
    poll(lambda: http_get(f"{url}/health")[0] == 200, 60, "the keyed gateway to see the mesh")
    yield url
    assert mesh.remove_service("batch-keyed") == 0, mesh.logs()
    assert mesh.remove_service("gateway-keyed") in (0, -15), mesh.logs()


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def run_batch(api: openai.OpenAI, body: dict[str, Any]) -> Any:
    line = {"custom_id": "probe", "method": "POST", "url": CHAT, "body": body}
    uploaded = api.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = api.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                               completion_window="24h")
    batch = wait_for(api, batch.id, finished, timeout_s=120)
    assert batch.status == "completed" and batch.request_counts.completed == 1, batch
    return batch


def cached_tokens(api: openai.OpenAI, batch: Any) -> int:
    [entry] = [json.loads(x) for x in api.files.content(batch.output_file_id).text.splitlines()]
    return entry["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_batch_runs_as_its_key_and_stays_its_keys(keyed_url: str) -> None:
    with client(keyed_url, ALPHA) as alpha, client(keyed_url, BETA) as beta:
        model = alpha.models.list().data[0].id
        # ~100 tokens no other test sends: only alpha's request below can have cached them.
        words = " ".join(f"tenant-probe-{i}" for i in range(25))
        body = {"model": model, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": f"Repeat: {words}"}]}
        alpha.chat.completions.create(**body)
        alpha_batch = run_batch(alpha, body)
        # Alpha's batch line carried alpha's salt: it reused the blocks of alpha's request.
        assert cached_tokens(alpha, alpha_batch) >= 64
        # Beta's carried beta's: the same prompt found nothing of alpha's.
        beta_batch = run_batch(beta, body)
        assert cached_tokens(beta, beta_batch) == 0

        assert alpha_batch.id not in [b.id for b in beta.batches.list(limit=100).data]
        for call in (lambda: beta.batches.retrieve(alpha_batch.id),
                     lambda: beta.batches.cancel(alpha_batch.id),
                     lambda: beta.files.content(alpha_batch.output_file_id),
                     lambda: beta.files.retrieve(alpha_batch.input_file_id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert alpha.files.retrieve(alpha_batch.output_file_id).purpose == "batch_output"


def test_a_batch_sent_over_nats_with_a_key_is_that_keys(mesh: Mesh, keyed_url: str) -> None:
    assert mesh.nats is not None
    done = subprocess.run(
        [sys.executable, "examples/batch_over_nats.py", "--nats-url", mesh.nats.url,
         "--namespace", mesh.namespace, "--count", "2", "--max-tokens", "2",
         "--api-key", ALPHA], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "completed: 2 completed, 0 failed of 2" in done.stdout
    batch_id = done.stdout.split()[1]   # "submitted <batch id> (2 requests)"
    with client(keyed_url, ALPHA) as alpha, client(keyed_url, BETA) as beta:
        batch = alpha.batches.retrieve(batch_id)
        assert batch.status == "completed"
        assert alpha.files.retrieve(batch.input_file_id).purpose == "batch"
        with pytest.raises(openai.NotFoundError):
            beta.batches.retrieve(batch_id)
