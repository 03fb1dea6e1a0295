"""Each hybrid family (Bamba, Nemotron-H: Mamba2 layers beside attention) through the real mesh, from
a tiny random checkpoint built by transformers' own model class (tiny_hybrids.py): the official
openai client's greedy
completions equal HF generate's text, with several requests at once in a KV cache too small for
them all (so some are preempted and prefilled again, from a state checkpoint or from zero); a
second chat turn (the first turn's prompt and answer, then a new message) hits the prefix cache
up to the first turn's last state checkpoint, and a prompt sharing another's first blocks hits
that prompt's end-of-prompt checkpoint; both still equal HF generate on their whole prompt."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import openai
import pytest
import torch
import transformers

from tests.mesh import Mesh, serving
from tests.worker.tiny_hybrids import HYBRID_FAMILIES

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128
MAX_TOKENS = 48
# 10 blocks of 16 tokens (1 attention layer x K and V x 2 heads x 16 dims x fp32 = 256 B a
# token) beside the null block: three requests of ~60 tokens do not fit at once.
KV_CACHE_MEMORY = 11 * 16 * 256
PROMPTS = ["The quick brown fox jumps over", "Once upon a time, in a land far away,",
           "def fibonacci(n):"]


@pytest.fixture(scope="module", params=list(HYBRID_FAMILIES))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    HYBRID_FAMILIES[request.param][0](path, with_tokenizer=True,
                                      max_position_embeddings=MAX_MODEL_LEN)
    return path


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Mesh]:
    model = ["--model", str(model_dir), "--max-model-len", str(MAX_MODEL_LEN)]
    with serving(Mesh(tmp_path_factory.mktemp(f"mesh-{model_dir.name}"), namespace="hybrid",
                      extra_args={
            "tokenizer": ["--model", str(model_dir)], "scheduler": model,
            "worker": [*model, "--kv-cache-memory", str(KV_CACHE_MEMORY)]})) as running:
        yield running


@cache
def _hf_model(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                             dtype=torch.float32).eval()


def _hf_greedy(model_dir: Path, ids: list[int]) -> list[int]:
    """HF's greedy continuation of the token ids `ids`."""
    with torch.no_grad():
        out = _hf_model(model_dir).generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                                            do_sample=False)
    return out[0, len(ids):].tolist()


def _hf_text(model_dir: Path, prompt: str) -> tuple[str, int]:
    """HF's greedy continuation of `prompt` and the prompt's token count."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt).input_ids
    return tokenizer.decode(_hf_greedy(model_dir, ids), skip_special_tokens=True), len(ids)


def _client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_greedy_completions_equal_hf_through_preemption(mesh: Mesh, model_dir: Path) -> None:
    want = [_hf_text(model_dir, prompt) for prompt in PROMPTS]
    with _client(mesh) as client:
        name = client.models.list().data[0].id

        def complete(prompt: str) -> openai.types.Completion:
            return client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, PROMPTS))
        assert [(c.choices[0].text, c.usage.prompt_tokens) for c in got] == want
        assert mesh.scheduler_metric("vllm:num_preemptions_total") > 0


def _complete_ids(mesh: Mesh, ids: list[int]) -> openai.types.Completion:
    with _client(mesh) as client:
        return client.completions.create(model=client.models.list().data[0].id, prompt=ids,
                                         max_tokens=MAX_TOKENS, temperature=0)


def _cached_tokens(completion: openai.types.Completion) -> int:
    details = completion.usage.prompt_tokens_details if completion.usage else None
    return (details.cached_tokens or 0) if details else 0


def test_a_second_turn_restores_a_state_checkpoint_and_equals_hf(mesh: Mesh,
                                                                  model_dir: Path) -> None:
    """Token ids, so the second turn extends the first's exactly (a random model's answer
    need not tokenize back to its own ids)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    first = tokenizer("Tell me a story about a dragon.").input_ids
    answer = _hf_greedy(model_dir, first)
    second = first + answer + tokenizer(" And then?", add_special_tokens=False).input_ids
    assert _complete_ids(mesh, first).choices[0].text == tokenizer.decode(
        answer, skip_special_tokens=True)
    got = _complete_ids(mesh, second)
    # The first turn computed len(first) + MAX_TOKENS - 1 tokens: its last decode checkpoint
    # is at the last block boundary within them.
    assert _cached_tokens(got) == (len(first) + MAX_TOKENS - 1) // 16 * 16
    assert got.choices[0].text == tokenizer.decode(_hf_greedy(model_dir, second),
                                                   skip_special_tokens=True)


def test_a_shared_prompt_prefix_hits_the_prompt_end_checkpoint(mesh: Mesh,
                                                               model_dir: Path) -> None:
    """The first prompt's chunk ends at its last block boundary (40 tokens: at 32) to save
    the state there; a prompt sharing those 32 tokens starts from it."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    shared = torch.randint(100, 5000, (32,), generator=torch.Generator().manual_seed(7)).tolist()
    first = shared + tokenizer(" and the first question", add_special_tokens=False).input_ids
    other = shared + tokenizer(" but another one entirely", add_special_tokens=False).input_ids
    assert len(first) < 48 and len(other) < 48
    assert _cached_tokens(_complete_ids(mesh, first)) == 0
    got = _complete_ids(mesh, other)
    assert _cached_tokens(got) == 32
    assert got.choices[0].text == tokenizer.decode(_hf_greedy(model_dir, other),
                                                   skip_special_tokens=True)
