"""The engine core through the real mesh: prefix-cache hits and preemption keep greedy
output identical to a cold, unpreempted run."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.mesh import Mesh, http_post, serving

pytestmark = pytest.mark.slow

SYSTEM = ("You are a meticulous assistant for a museum of natural history. Answer visitors' "
          "questions about fossils, minerals, and the history of life on Earth in plain words, "
          "and mention which gallery holds the relevant exhibits. ") * 3


def ask(client: openai.OpenAI, model: str, question: str, max_tokens: int = 24,
        **extra: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=model, temperature=0, max_tokens=max_tokens, extra_body=extra or None,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def test_prefix_hit_gives_identical_output_and_counts(mesh: Mesh, client: openai.OpenAI,
                                                     model_name: str) -> None:
    cold = ask(client, model_name, "Where are the trilobites?", cache_salt="cold-run")
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    hits_before = mesh.scheduler_metric("vllm:prefix_cache_hits_total")
    warm = ask(client, model_name, "Where are the trilobites?", cache_salt="cold-run")
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * (cold.usage.prompt_tokens // 16 - 1)
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert mesh.scheduler_metric("vllm:prefix_cache_hits_total") - hits_before == cached
    # Another tenant's salt never shares those blocks.
    other = ask(client, model_name, "Where are the trilobites?", cache_salt="tenant-b")
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == cold.choices[0].message.content


def test_reset_prefix_cache(mesh: Mesh, client: openai.OpenAI, model_name: str) -> None:
    ask(client, model_name, "What is amber?", cache_salt="reset")
    status, _ = http_post(f"{mesh.base_url}/reset_prefix_cache", {})
    assert status == 200
    again = ask(client, model_name, "What is amber?", cache_salt="reset")
    assert again.usage.prompt_tokens_details.cached_tokens == 0


@pytest.fixture(scope="module")
def small_kv_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A mesh whose KV cache holds ~40 blocks (640 tokens): four long requests must preempt."""
    kv_bytes = 41 * 16 * 46080  # blocks x tokens per block x fp32 KV bytes per token
    args = ["--max-model-len", "512", "--kv-cache-memory", str(kv_bytes)]
    with serving(Mesh(Path(tmp_path_factory.mktemp("small-kv")), namespace="smallkv",
                      extra_args={"worker": args, "scheduler": ["--max-model-len", "512"]}),
                 check_exit=False) as running:
        yield running


def test_preempted_requests_match_their_unpreempted_output(small_kv_mesh: Mesh) -> None:
    questions = ["Describe a volcano.", "Describe a glacier.", "Describe a desert.",
                 "Describe a rainforest."]
    with openai.OpenAI(base_url=f"{small_kv_mesh.base_url}/v1", api_key="x",
                       max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id

        def run(question: str) -> str:
            return client.completions.create(
                model=model, prompt=f"{question} Write at length.", temperature=0,
                max_tokens=200, extra_body={"ignore_eos": True}).choices[0].text

        solo = [run(q) for q in questions]
        assert small_kv_mesh.scheduler_metric("vllm:num_preemptions_total") == 0
        with ThreadPoolExecutor(len(questions)) as pool:
            together = list(pool.map(run, questions))
    assert small_kv_mesh.scheduler_metric("vllm:num_preemptions_total") > 0
    assert together == solo
