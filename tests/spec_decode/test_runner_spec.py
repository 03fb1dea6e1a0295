"""The worker's speculative decoding on a tiny random model: n-gram, suffix and draft-model
drafts verified in the step, greedy, seeded and penalised output unchanged, drafts never
verified where they cannot be."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.common import wire
from services.common.speculative_config import SpeculativeConfig
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker.driver import StepDriver

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                          prompt_lookup_max=3)
SUFFIX = SpeculativeConfig("suffix", num_speculative_tokens=4, suffix_decoding_max_tree_depth=8)


@pytest.fixture(params=["ngram", "suffix", "draft_model"])
def speculative_config(request: pytest.FixtureRequest, draft_model_dir: Path
                       ) -> SpeculativeConfig:
    if request.param == "draft_model":
        return SpeculativeConfig("draft_model", 3, model=str(draft_model_dir))
    return {"ngram": NGRAM, "suffix": SUFFIX}[request.param]


def make_runner(model_dir: Path, speculative: SpeculativeConfig | None) -> ModelRunner:
    # NOTE: a draft model catches up on a new request's prompt in passes of at most
    # max_num_batched_tokens tokens: 16 makes the prompts below take several.
    return ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_memory=2**21, max_num_seqs=4,
                                    max_model_len=256, max_num_batched_tokens=16,
                                    speculative_config=speculative))


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    phrase = rng.integers(3, 256, 12).tolist()
    return [phrase * 4,                                   # copy-heavy
            rng.integers(3, 256, 40).tolist(),            # random
            (phrase[:5] + rng.integers(3, 256, 3).tolist()) * 5]


def generate(model_dir: Path, speculative: SpeculativeConfig | None,
             sampling: wire.SamplingParams | None = None, token_budget: int = 1 << 30,
             max_new_tokens: int = 40) -> tuple[dict[int, list[int]], StepDriver]:
    driver = StepDriver(make_runner(model_dir, speculative), token_budget)
    for tokens in prompts():
        driver.add(tokens, max_new_tokens=max_new_tokens, sampling=sampling, stop_at_eos=False)
    return driver.run(), driver


@pytest.mark.parametrize("token_budget", [1 << 30, 7])
def test_greedy_output_is_unchanged_and_drafts_are_accepted(
        model_dir: Path, token_budget: int, speculative_config: SpeculativeConfig) -> None:
    plain, _ = generate(model_dir, None, token_budget=token_budget)
    speculative, driver = generate(model_dir, speculative_config, token_budget=token_budget)
    assert speculative == plain
    assert all(len(out) == 40 for out in speculative.values())
    verified = sum(r.num_verified for r in driver.requests.values())
    accepted = sum(r.num_accepted for r in driver.requests.values())
    assert verified > 0 and 0 < accepted <= verified


def test_seeded_sampling_is_unchanged_by_speculation(
        model_dir: Path, speculative_config: SpeculativeConfig) -> None:
    """Each output token uses the next uniform of the request's stream, whatever the drafts:
    the same seed gives the same tokens with and without speculation, and under a budget
    that trims the drafts."""
    sampling = wire.SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    plain, _ = generate(model_dir, None, sampling)
    speculative, driver = generate(model_dir, speculative_config, sampling)
    trimmed, _ = generate(model_dir, speculative_config, sampling, token_budget=6)
    assert speculative == plain == trimmed
    assert sum(r.num_verified for r in driver.requests.values()) > 0


@pytest.mark.parametrize("sampling", [
    wire.SamplingParams(repetition_penalty=1.6),
    wire.SamplingParams(presence_penalty=1.0, frequency_penalty=0.6),
    wire.SamplingParams(temperature=1.0, top_k=40, seed=3, repetition_penalty=1.5,
                        frequency_penalty=0.5)], ids=["repetition", "presence+frequency", "seeded"])
def test_penalised_output_is_unchanged_by_speculation(
        model_dir: Path, speculative_config: SpeculativeConfig,
        sampling: wire.SamplingParams) -> None:
    """Each draft position is penalised for the drafts before it, as one token at a time
    would be: output equals the output without speculation."""
    plain, _ = generate(model_dir, None, sampling)
    speculative, driver = generate(model_dir, speculative_config, sampling)
    assert speculative == plain
    assert sum(r.num_verified for r in driver.requests.values()) > 0


def test_rows_that_cannot_speculate_get_no_drafts(model_dir: Path) -> None:
    driver = StepDriver(make_runner(model_dir, NGRAM))
    phrase = prompts()[0]
    with_logprobs = driver.add(phrase, 12, wire.SamplingParams(logprobs=2), False)
    held_back = driver.add(phrase, 12, wire.SamplingParams(min_tokens=6), False)
    free = driver.add(phrase, 12, stop_at_eos=False)
    driver.run()
    requests = driver.requests
    assert requests[with_logprobs].num_verified == 0
    assert len(requests[with_logprobs].logprobs) == 12
    assert 0 < requests[held_back].num_verified < requests[free].num_verified
