"""Speculative decoding on the real mesh: with n-gram or suffix drafts, greedy (and seeded)
output is the output without them, one request at a time and eight at once (prefix hits
among them), with a JSON schema and with penalties, through preemption, and the scheduler counts drafts and acceptances under
vLLM's metric names; with a draft model, greedy output three requests at once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.mesh import Mesh, http_get, metric_value, serving

pytestmark = pytest.mark.slow

SPECULATIVE_CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
              "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}
# The embedded model as its own draft: the draft path end to end, not a speed-up (on two
# CPU cores a step then costs about four; hence a test of its own, shorter than the above).
DRAFT_MODEL_CONFIG = {"method": "draft_model", "model": "SmolLM2-135M-Instruct",
                      "num_speculative_tokens": 3}
PROMPTS = [
    # Copy-heavy: re-emitted JSON, code edited with a rename, a quoted source.
    'Here is a record: {"name": "Ada Lovelace", "born": 1815, "field": "mathematics", '
    '"city": "London"}. Repeat the record exactly as JSON: {"name": "Ada Lovelace", "born":',
    "def total_price(items):\n    total = 0\n    for item in items:\n        total += "
    "item.price * item.quantity\n    return total\n\n# The same function with total renamed "
    "to subtotal:\ndef total_price(items):\n    subtotal = 0\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy "
    "dog. The quick brown fox",
    # Not copy-heavy.
    "Describe a volcano.",
    "List three uses of copper:",
]


@pytest.fixture(scope="module", params=list(SPECULATIVE_CONFIGS))
def spec_mesh(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    flag = ["--speculative-config", json.dumps(SPECULATIVE_CONFIGS[request.param])]
    with serving(Mesh(Path(tmp_path_factory.mktemp("spec-mesh")), namespace="spec",
                      extra_args={"scheduler": flag, "worker": flag})) as running:
        yield running


def complete_all(mesh: Mesh, prompts: list[str], concurrency: int, max_tokens: int = 48,
                 **sampling: object) -> list[str]:
    with openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="x", max_retries=0,
                       timeout=300) as client:
        model = client.models.list().data[0].id

        def complete(prompt: str) -> str:
            return client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens,
                extra_body={"ignore_eos": True}, **sampling).choices[0].text

        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(complete, prompts))


def test_greedy_output_equals_the_output_without_speculation(mesh: Mesh,
                                                             spec_mesh: Mesh) -> None:
    plain = complete_all(mesh, PROMPTS, 1, temperature=0)
    assert complete_all(spec_mesh, PROMPTS, 1, temperature=0) == plain
    eight = (PROMPTS * 2)[:8]
    assert complete_all(spec_mesh, eight, 8, temperature=0) == (plain * 2)[:8]
    scheduler = spec_mesh.services["scheduler"]
    text = scheduler.get("/metrics")[1].decode()
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert metric_value(text, "vllm:spec_decode_num_drafts_total") > 0
    assert 0 < accepted < metric_value(text, "vllm:spec_decode_num_draft_tokens_total")
    assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                        position="0") > 0
    assert_on_the_gateways_metrics(spec_mesh, text)
    log = spec_mesh.services["gateway"].log_path.read_text().splitlines()
    rates = [json.loads(line)["spec_acceptance_rate"] for line in log
             if '"request finished"' in line]
    assert any(rate is not None and 0 < rate <= 1 for rate in rates)   # the log line says it


def assert_on_the_gateways_metrics(mesh: Mesh, scheduler_text: str) -> None:
    """The gateway's /metrics, the one scrape target, carries the engine's own series (as
    its scheduler just gave them) beside the request histograms, each labelled by engine."""
    status, body = http_get(f"{mesh.base_url}/metrics")
    assert status == 200
    text = body.decode()
    engine = {"engine": "engine-0"}
    for name in ("vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_drafts_total",
                 "llm_mesh:engine_step_seconds_count", "llm_mesh:worker_execute_seconds_count"):
        assert metric_value(text, name, **engine) == metric_value(scheduler_text, name), name
    assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                        position="0", **engine) > 0
    for name in ("vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert metric_value(text, name, **engine) > 0, name
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a family is exposed twice"


def test_seeded_sampling_equals_the_output_without_speculation(mesh: Mesh,
                                                               spec_mesh: Mesh) -> None:
    """Each output token uses the next uniform of the request's own stream, drafts or not."""
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    plain = complete_all(mesh, PROMPTS[:3], 1, **sampling)
    assert complete_all(spec_mesh, PROMPTS[:3], 3, **sampling) == plain


RECORD_SCHEMA = {"type": "object", "additionalProperties": False,
                 "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                "field": {"type": "string"}, "city": {"type": "string"}},
                 "required": ["name", "born", "field", "city"]}


def constrained_and_penalised(mesh: Mesh) -> tuple[str, list[str]]:
    """A JSON-schema answer re-emitting a record (drafts checked against the grammar), and
    penalised completions (each draft position penalised for the drafts before it)."""
    with openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="x", max_retries=0,
                       timeout=300) as client:
        model = client.models.list().data[0].id
        record = client.chat.completions.create(
            model=model, temperature=0, max_tokens=96,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "record", "schema": RECORD_SCHEMA}})
        penalised = [client.completions.create(
            model=model, prompt=prompt, max_tokens=48, temperature=0, presence_penalty=0.4,
            frequency_penalty=0.3, extra_body={"repetition_penalty": 1.1}).choices[0].text
            for prompt in PROMPTS[:3]]
        return record.choices[0].message.content or "", penalised


def test_constrained_and_penalised_output_equals_the_output_without_speculation(
        mesh: Mesh, spec_mesh: Mesh) -> None:
    plain = constrained_and_penalised(mesh)
    assert constrained_and_penalised(spec_mesh) == plain
    assert set(json.loads(plain[0])) == set(RECORD_SCHEMA["required"])


@pytest.fixture(scope="module")
def small_kv_spec_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """n-gram speculation on a KV cache of ~40 blocks (640 tokens): four long requests
    preempt one another, drafts and all."""
    kv_bytes = 41 * 16 * 46080  # blocks x tokens per block x fp32 KV bytes per token
    flag = ["--speculative-config", json.dumps(SPECULATIVE_CONFIGS["ngram"]),
            "--max-model-len", "512"]
    with serving(Mesh(Path(tmp_path_factory.mktemp("small-kv-spec")), namespace="smallspec",
                      extra_args={"worker": [*flag, "--kv-cache-memory", str(kv_bytes)],
                                  "scheduler": flag}), check_exit=False) as running:
        yield running


def test_preempted_speculating_requests_keep_their_greedy_output(
        mesh: Mesh, small_kv_spec_mesh: Mesh) -> None:
    prompts = [f"Describe a {place}. Write at length." for place in
               ("volcano", "glacier", "desert", "rainforest")]

    def run(target: Mesh, concurrency: int) -> list[str]:
        return complete_all(target, prompts, concurrency, temperature=0, max_tokens=200)

    plain = run(mesh, 1)
    assert run(small_kv_spec_mesh, 4) == plain
    assert small_kv_spec_mesh.scheduler_metric("vllm:num_preemptions_total") > 0
    assert small_kv_spec_mesh.scheduler_metric("vllm:spec_decode_num_accepted_tokens_total") > 0


def test_the_model_as_its_own_draft_keeps_greedy_output_and_has_its_drafts_accepted(
        mesh: Mesh, tmp_path: Path) -> None:
    """Three requests at once; nearly every draft accepted shows that the draft's KV
    follows the target's blocks through the real scheduler's steps (chunked prefills,
    drafts trimmed by the token budget)."""
    prompts = [*PROMPTS[:2], PROMPTS[3]]
    plain = complete_all(mesh, prompts, 3, max_tokens=32, temperature=0)
    flag = ["--speculative-config", json.dumps(DRAFT_MODEL_CONFIG)]
    with serving(Mesh(tmp_path, namespace="draft",
                      extra_args={"scheduler": flag, "worker": flag})) as draft_mesh:
        assert complete_all(draft_mesh, prompts, 3, max_tokens=32, temperature=0) == plain
        drafted = draft_mesh.scheduler_metric("vllm:spec_decode_num_draft_tokens_total")
        accepted = draft_mesh.scheduler_metric("vllm:spec_decode_num_accepted_tokens_total")
    assert 0.8 * drafted < accepted <= drafted
