"""Two gateway replicas with one API key and one Redis join the real mesh: what a request
spends on one replica, the other replica's next request cannot spend again."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from llm_mesh.embedded import EmbeddedRedis
from services.common.ports import free_port
from tests.faults.streams import poll
from tests.mesh import Mesh, http_get

pytestmark = pytest.mark.slow

KEY = "replica-key"


@pytest.fixture(scope="module")
def replica_urls(mesh: Mesh) -> Iterator[list[str]]:
    """Two gateways limiting KEY to a 200-token bucket (refilling 1 token a second) in one
    Redis."""
    with EmbeddedRedis(password="s3cret") as redis:
        urls = []
        for i in range(2):
            port = free_port()
            mesh.add_service(f"gateway-limited-{i}", [
                "--port", str(port), "--api-key", KEY, "--rate-limit-tokens-per-minute", "60",
                "--rate-limit-burst-tokens", "200", "--redis-url", redis.url], kind="gateway")
            urls.append(f"http://127.0.0.1:{port}")
            poll(lambda: http_get(f"{urls[-1]}/health")[0] == 200, 60,
                 "the limited gateway to see the mesh")
        yield urls
        for i in range(2):
            assert mesh.remove_service(f"gateway-limited-{i}") in (0, -15), mesh.logs()


def test_a_key_spends_its_tokens_once_across_replicas(replica_urls: list[str]) -> None:
    first, second = (openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0,
                                   timeout=60) for url in replica_urls)
    model = first.models.list().data[0].id
    # A short prompt plus max_tokens 150: most of the 200-token bucket.
    ask = {"model": model, "max_tokens": 150, "temperature": 0, "prompt": "Hello"}
    started = time.monotonic()
    first.completions.create(**ask)
    with pytest.raises(openai.RateLimitError) as refused:
        second.completions.create(**ask)
    assert refused.value.body["code"] == "rate_limit_exceeded"
    # ~100 tokens short at 1 a second, less what the bucket refilled while the first ran.
    refilled = time.monotonic() - started
    assert int(refused.value.response.headers["retry-after"]) >= 90 - refilled
