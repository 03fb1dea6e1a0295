"""`make test-compose`: compose/ as a user runs it, for real. The image builds (the C++ CPU
kernels compiled in it), `docker compose up -d` brings every container to healthy, the API
answers a chat completion and a streamed one, /metrics carries the engine's series, a
stream survives `docker compose restart worker` and the prefix cache is still warm after
it, and `docker compose down -v` leaves nothing behind. Not part of `make test` (its file
name is not test_*.py): it needs a Docker engine and builds a 3 GB image.

Its timings go to the terminal and to bench-results/test-compose.json."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from services.common.ports import free_port
from tests.compose.compose_stack import ComposeStack, require_docker
from tests.faults.streams import StreamSet
from tests.mesh import REPO_ROOT, http_get, metric_value

MODEL = "SmolLM2-135M-Instruct"
IMAGE = "llm-mesh:cpu"
HEALTHY_TIMEOUT_S = 600
# Several KV blocks of one prompt: the prefix cache and the kvstore hold them.
LONG_PROMPT = "Repeat these words: " + " ".join(f"word-{i}" for i in range(60))


@pytest.fixture(scope="module")
def timings(pytestconfig: pytest.Config) -> Iterator[dict[str, Any]]:
    measured: dict[str, Any] = {}
    yield measured
    out = REPO_ROOT / "bench-results" / "test-compose.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(measured, indent=2) + "\n")
    with pytestconfig.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print(f"\ntest-compose timings ({out}): {json.dumps(measured)}")


@pytest.fixture(scope="module")
def stack(timings: dict[str, Any]) -> Iterator[ComposeStack]:
    require_docker()
    stack = ComposeStack("llm-mesh-check", free_port())
    stack.prepare()
    try:
        started = time.monotonic()
        stack.compose("build", "gateway", timeout_s=3600)   # the one image every service runs
        timings["image_build_s"] = round(time.monotonic() - started, 1)
        timings["image_size_bytes"] = stack.image_size_bytes(IMAGE)
        started = time.monotonic()
        stack.compose("up", "--detach")
        timings["up_to_all_healthy_s"] = round(
            time.monotonic() - started + stack.wait_healthy(HEALTHY_TIMEOUT_S), 1)
        yield stack
        stack.compose("down", "--volumes", "--timeout", "60")
        assert stack.containers() == [] and stack.volumes() == []
    finally:
        if stack.containers():   # a failure above: leave nothing running
            stack.compose("down", "--volumes", "--timeout", "60")
        stack.release()


@pytest.fixture(scope="module")
def client(stack: ComposeStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.gateway_port}/v1", api_key="unused",
                       max_retries=0, timeout=120) as client:
        yield client


def _log_lines(log: str, event: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.splitlines() if f'"event": "{event}"' in line]


def test_the_worker_runs_the_kernels_built_into_the_image(stack: ComposeStack,
                                                          timings: dict[str, Any]) -> None:
    log = stack.logs("worker")
    assert "compiling CPU kernels" not in log and "CPU kernels unavailable" not in log, log
    loaded = _log_lines(log, "model weights loaded")
    assert loaded and all(line["attention_backend"] == "cpu" for line in loaded), loaded
    [ready] = _log_lines(log, "ready")
    timings["worker_first_start_s"] = ready["startup_s"]
    timings["worker_first_start_phases_s"] = ready["phases"]


def test_chat_completions_plain_and_streamed(client: openai.OpenAI,
                                             timings: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                         temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens >= 1
    started = time.monotonic()
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    first, pieces = None, []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            pieces.append(chunk.choices[0].delta.content)
    assert first is not None
    timings["streamed_first_token_s"] = round(first - started, 3)
    assert "".join(pieces) == out.choices[0].message.content   # greedy: the same answer


def test_metrics_carry_the_engines_series(stack: ComposeStack, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    status, body = http_get(f"http://127.0.0.1:{stack.gateway_port}/metrics")
    assert status == 200
    text = body.decode()
    engine = {"engine": "engine-0"}
    assert metric_value(text, "vllm:time_to_first_token_seconds_count", **engine) >= 1
    assert metric_value(text, "llm_mesh:engine_step_seconds_count", **engine) > 0
    assert metric_value(text, "vllm:num_requests_running", **engine) >= 0


def test_a_stream_and_the_prefix_cache_survive_a_worker_restart(
        stack: ComposeStack, client: openai.OpenAI, timings: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": LONG_PROMPT}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    streams = StreamSet(f"http://127.0.0.1:{stack.gateway_port}", [{
        "model": MODEL, "prompt": "Count from one to one thousand:", "max_tokens": 256,
        "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}])
    streams.wait_for_chunks(2)
    started = time.monotonic()
    stack.compose("restart", "worker", timeout_s=120)
    timings["worker_restart_to_healthy_s"] = round(
        time.monotonic() - started + stack.wait_healthy(300, {"worker"}), 1)
    [result] = streams.finish(timeout_s=300)
    assert result.completed and result.finish_reason == "length", result.outcome()
    assert result.usage is not None and result.usage["completion_tokens"] == 256
    timings["stream_gap_over_restart_s"] = round(result.longest_gap_s, 1)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached and cached > 0, again.usage
    timings["cached_tokens_after_restart"] = cached
