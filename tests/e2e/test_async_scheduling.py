"""Async scheduling (`--async-scheduling`, the default) through the real mesh: the scheduler
sends each step while the one before it runs, and greedy outputs stay those of the shared
mesh (whose greedy output equals HF's, tests/e2e/test_openai_api.py) through preemption,
stop strings, stop tokens, grammars and a worker killed with steps in flight. The shared
mesh never preempts these; speculative decoding's meshes (tests/spec_decode) run the
synchronous loop."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.faults.streams import StreamSet
from tests.mesh import Mesh, serving

pytestmark = pytest.mark.slow

QUESTIONS = ["Describe a volcano.", "Describe a glacier.", "Describe a desert.",
             "Describe a rainforest."]
CITY = {"type": "object", "properties": {"city": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def async_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """KV for ~40 blocks (640 tokens), as test_engine_core's: four long requests preempt."""
    kv_bytes = 41 * 16 * 46080  # blocks x tokens per block x fp32 KV bytes per token
    with serving(Mesh(Path(tmp_path_factory.mktemp("async")), namespace="asyncsched",
                      extra_args={"worker": ["--max-model-len", "512",
                                             "--kv-cache-memory", str(kv_bytes)],
                                  "scheduler": ["--max-model-len", "512",
                                                "--async-scheduling"]}),
                 check_exit=False) as running:
        yield running


def on(mesh: Mesh, ask: Callable[[openai.OpenAI, str, str], str],
       prompts: list[str]) -> list[str]:
    """Each prompt at once, through the official client."""
    with openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="x", max_retries=0,
                       timeout=300) as client:
        model = client.models.list().data[0].id
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda prompt: ask(client, model, prompt), prompts))


def completion(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 60) -> str:
    return client.completions.create(model=model, prompt=prompt, temperature=0,
                                     max_tokens=max_tokens,
                                     extra_body={"ignore_eos": True}).choices[0].text


def long_completion(client: openai.OpenAI, model: str, question: str) -> str:
    return completion(client, model, f"{question} Write at length.", max_tokens=200)


def test_preempted_requests_match_the_default_meshs_output(async_mesh: Mesh,
                                                           mesh: Mesh) -> None:
    together = on(async_mesh, long_completion, QUESTIONS)
    assert async_mesh.scheduler_metric("vllm:num_preemptions_total") > 0
    assert together == on(mesh, long_completion, QUESTIONS)
    assert all(len(text) > 400 for text in together)


def varied(client: openai.OpenAI, model: str, kind: str) -> str:
    """A request that ends early: at a stop string, at EOS, or where its grammar ends."""
    messages = [{"role": "user", "content": "Name a large city and its population."}]
    if kind == "json":
        return client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {
                "name": "city", "schema": CITY, "strict": True}}).choices[0].message.content
    if kind == "stop":
        return client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=80,
            stop=["."]).choices[0].message.content
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=120).choices[0].message.content


def test_grammars_stops_and_eos_end_where_the_default_mesh_ends(async_mesh: Mesh,
                                                                mesh: Mesh) -> None:
    kinds = ["json", "stop", "eos", "json"]
    outputs = on(async_mesh, varied, kinds)
    assert outputs == on(mesh, varied, kinds)
    city = json.loads(outputs[0])
    assert set(city) == {"city", "population"} and isinstance(city["population"], int)
    assert "." not in outputs[1]


def test_a_worker_killed_with_steps_in_flight_resumes_identically(async_mesh: Mesh,
                                                                  mesh: Mesh) -> None:
    def body(question: str) -> dict[str, object]:
        return {"model": "SmolLM2-135M-Instruct", "prompt": question, "max_tokens": 60,
                "temperature": 0, "ignore_eos": True}

    streams = StreamSet(async_mesh.base_url, [body(q) for q in QUESTIONS[:2]])
    streams.wait_for_chunks(3)
    async_mesh.restart("worker")   # SIGKILL, then start again as compose would
    results = streams.finish(120.0)
    assert [r.outcome() for r in results] == ["completed (length)"] * 2
    assert [r.text for r in results] == on(mesh, completion, QUESTIONS[:2])
