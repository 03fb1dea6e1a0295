"""A hybrid (Bamba) model through the ModelRunner, against transformers' BambaForCausalLM from a
tiny random checkpoint: prompt and decode logprobs over chunked prefill; greedy tokens of
several prompts batched together with chunked prefill equal HF generate; a preempted request
(dropped, then prefilled again from zero in its dirty slot) ends as it would have; a step that
continues a row from tokens its state never took is refused; what v0 cannot run is refused at
start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from services.common import wire_pb
from services.common.packing import pack_int32
from services.common.speculative_config import SpeculativeConfig
from services.worker.models.config import UnsupportedModelError
from services.worker.runner.config import RunnerConfig
from services.worker.runner.model_runner import ModelRunner
from tests.worker.driver import StepDriver, new_request_data
from tests.worker.tiny_bamba import save_tiny_bamba
from tests.worker.tiny_models import assert_logprobs_match_hf

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, transformers.BambaForCausalLM]:
    path = tmp_path_factory.mktemp("bamba-runner")
    return path, save_tiny_bamba(path)


@pytest.fixture
def runner(checkpoint: tuple[Path, transformers.BambaForCausalLM]) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=checkpoint[0], kv_cache_memory=2**20,
                                    max_num_seqs=4, max_model_len=256))


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(hf: transformers.BambaForCausalLM, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_logprobs_match_hf_over_chunked_prefill(checkpoint, runner: ModelRunner) -> None:
    assert runner.kv_spec.num_layers == 1   # the attention layer's KV only
    assert_logprobs_match_hf(checkpoint[1], runner)


def test_batched_chunked_greedy_equals_hf_generate(checkpoint, runner: ModelRunner) -> None:
    prompts = [_prompt(23, seed=1), _prompt(9, seed=2), _prompt(31, seed=3)]
    driver = StepDriver(runner, token_budget=16)   # prefills in chunks beside decodes
    handles = [driver.add(p, max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False) for p in prompts]
    outputs = driver.run()
    for handle, prompt in zip(handles, prompts, strict=True):
        assert outputs[handle] == _hf_greedy(checkpoint[1], prompt)


def test_a_preempted_request_ends_as_it_would_have(checkpoint, runner: ModelRunner) -> None:
    prompt, other = _prompt(19, seed=4), _prompt(14, seed=5)
    driver = StepDriver(runner, token_budget=16)
    first = driver.add(prompt, max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False)
    driver.add(other, max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False)
    for _ in range(5):
        driver.run_step()
    request = driver.requests[first]
    before = list(request.output_ids)
    assert 0 < len(before) < MAX_NEW_TOKENS
    # Preempted: its row goes, then it comes back with its outputs and no computed tokens, to
    # be prefilled again from a zero state (in the row it left, whose slot it dirtied).
    request.max_new_tokens = len(before)
    driver.finished.append(first)
    again = driver.add(prompt, max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False)
    driver.requests[again].token_ids += before
    assert driver.run()[again] == _hf_greedy(checkpoint[1], prompt)


def test_continuing_from_tokens_the_state_never_took_is_refused(runner: ModelRunner) -> None:
    """A prefix-cache hit (16 tokens computed by another request) has KV but no state."""
    prompt = _prompt(20, seed=6)
    out = runner.execute(wire_pb.StepInput(
        step=0, new_requests=[new_request_data(7, prompt, [1, 2], num_computed=16)],
        num_scheduled_tokens=pack_int32([4])))
    assert "recurrent state holds 0 tokens" in out.error


@pytest.mark.parametrize("refused", [
    dict(speculative_config=SpeculativeConfig("ngram", num_speculative_tokens=3)),
    dict(enable_lora=True), dict(tensor_parallel_size=2), dict(quantization="int8")],
    ids=["speculative", "lora", "tensor_parallel", "int8"])
def test_what_v0_cannot_run_is_refused_at_start(checkpoint, refused: dict) -> None:
    with pytest.raises(UnsupportedModelError, match="hybrid"):
        ModelRunner(RunnerConfig(model_dir=checkpoint[0], kv_cache_memory=2**20,
                                 max_model_len=256, **refused))
