"""Each hybrid family (Bamba, Nemotron-H) through the ModelRunner, against transformers' own model
class from a tiny random checkpoint (tiny_hybrids.py): prompt and decode logprobs over chunked prefill; greedy tokens of
several prompts batched together with chunked prefill equal HF generate; a preempted request
(dropped, then prefilled again from zero in its dirty slot) ends as it would have; requests
continued from state checkpoints (a prompt's last boundary, a decode's) equal HF generate on
their whole prompt, and a zeroed checkpoint does not; a step that continues a row from tokens
its state never took, or from a checkpoint of another length, is refused; what v0 cannot run
is refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
import torch
import transformers

from services.common import wire_pb
from services.common.packing import pack_int32, unpack_int32
from services.worker.models.config import UnsupportedModelError
from services.worker.runner.config import RunnerConfig
from services.worker.runner.model_runner import ModelRunner
from tests.worker.driver import StepDriver, new_request_data
from tests.worker.tiny_hybrids import HYBRID_FAMILIES
from tests.worker.tiny_models import assert_logprobs_match_hf

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=list(HYBRID_FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, transformers.PreTrainedModel]:
    path = tmp_path_factory.mktemp(f"{request.param}-runner")
    return path, HYBRID_FAMILIES[request.param][0](path)


@pytest.fixture
def runner(checkpoint: tuple[Path, transformers.PreTrainedModel]) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=checkpoint[0], kv_cache_memory=2**20,
                                    max_num_seqs=4, max_model_len=256, num_state_checkpoints=2))


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_logprobs_match_hf_over_chunked_prefill(checkpoint, runner: ModelRunner) -> None:
    assert runner.kv_spec.num_layers == 1   # the attention layer's KV only
    assert_logprobs_match_hf(checkpoint[1], runner)


def test_start_up_logs_the_capacity_of_kv_and_state_slots(checkpoint) -> None:
    """As vLLM's "Maximum concurrency for N tokens per request": here bounded by the 4 state
    slots, not the attention KV's ~16 requests of 256 tokens."""
    with structlog.testing.capture_logs() as logs:
        runner = ModelRunner(RunnerConfig(model_dir=checkpoint[0], kv_cache_memory=2**20,
                                          max_num_seqs=4, max_model_len=256,
                                          num_state_checkpoints=2))
    (sized,) = [entry for entry in logs if entry["event"] == "KV cache sized"]
    assert runner.hybrid is not None
    state_bytes = runner.hybrid.size.bytes_per_seq
    assert state_bytes == 3 * 10_496   # 3 Mamba layers of the tiny model (fp32)
    assert sized["kv_cache_tokens"] == 255 * 16   # 1 MiB of 256 B tokens, less the null block
    assert sized["kv_max_concurrency"] == round(255 * 16 / 256, 2)
    assert (sized["state_slots"], sized["state_checkpoints"]) == (4, 2)
    assert sized["state_bytes_per_seq"] == state_bytes
    assert sized["max_concurrency"] == 4


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


class _OneAtATime:
    """Runs one request at a time to MAX_NEW_TOKENS greedy tokens, naming the state
    checkpoints as the scheduler would: a restore for its prefix-cache hit, a save at each
    boundary of `saves` (tokens after the step -> slot), a prompt chunk ending there."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step = 0
        self.finished: list[int] = []

    def run(self, handle: int, tokens: list[int], blocks: list[int], num_computed: int = 0,
            restore: int | None = None, saves: dict[int, int] | None = None) -> list[int]:
        tokens, num_prompt, saves = list(tokens), len(tokens), saves or {}
        while len(tokens) - num_prompt < MAX_NEW_TOKENS:
            end = min([len(tokens), *(n for n in saves if num_computed < n < len(tokens))])
            step = wire_pb.StepInput(step=self.step, finished_handles=pack_int32(self.finished),
                                     num_scheduled_tokens=pack_int32([end - num_computed]))
            if self.step == 0 or step.finished_handles:   # the request is new to the worker
                step.new_requests.append(new_request_data(handle, tokens, blocks,
                                                          num_computed=num_computed))
                if restore is not None:
                    step.state_restore_handles = pack_int32([handle])
                    step.state_restore_slots = pack_int32([restore])
            else:
                step.cached_handles = pack_int32([handle])
                step.cached_num_new_blocks = pack_int32([0])
                step.cached_num_computed_tokens = pack_int32([num_computed])
            if end in saves:
                step.state_save_handles = pack_int32([handle])
                step.state_save_slots = pack_int32([saves[end]])
            self.step, self.finished = self.step + 1, []
            out = self.runner.execute(step)
            assert not out.error, out.error
            tokens += unpack_int32(out.sampled_token_ids).tolist()
            num_computed = end
        self.finished = [handle]
        return tokens[num_prompt:]


def test_requests_continued_from_checkpoints_equal_hf_generate(checkpoint,
                                                               runner: ModelRunner) -> None:
    """A's prompt ends a chunk at 16 and saves it; B (A's first block + its own) restores it;
    B's decode saves at 32; C (B's first 32 tokens + its own) restores that."""
    hf = checkpoint[1]
    turns = _OneAtATime(runner)
    prompt_a = _prompt(24, seed=10)
    assert turns.run(1, prompt_a, [1, 2, 8], saves={16: 0}) == _hf_greedy(hf, prompt_a)
    prompt_b = prompt_a[:16] + _prompt(10, seed=11)
    out_b = turns.run(2, prompt_b, [1, 3, 4], num_computed=16, restore=0, saves={32: 1})
    assert out_b == _hf_greedy(hf, prompt_b)
    prompt_c = (prompt_b + out_b)[:32] + _prompt(5, seed=12)
    assert (turns.run(3, prompt_c, [1, 3, 5, 6], num_computed=32, restore=1)
            == _hf_greedy(hf, prompt_c))
    # The restore is what makes it right: from a zeroed checkpoint the tokens differ.
    assert runner.hybrid is not None
    for state in runner.hybrid.checkpoints:
        state.conv_states.zero_()
        state.ssm_states.zero_()
    assert (turns.run(4, prompt_c, [1, 3, 5, 7], num_computed=32, restore=1)
            != _hf_greedy(hf, prompt_c))


def test_a_restore_from_a_checkpoint_of_another_length_is_refused(runner: ModelRunner
                                                                  ) -> None:
    prompt = _prompt(20, seed=6)
    out = runner.execute(wire_pb.StepInput(
        step=0, new_requests=[new_request_data(7, prompt, [1, 2], num_computed=16)],
        num_scheduled_tokens=pack_int32([4]), state_restore_handles=pack_int32([7]),
        state_restore_slots=pack_int32([0])))
    assert "from state checkpoint 0, which holds -1 tokens" in out.error


@pytest.mark.parametrize("refused", [
    dict(enable_lora=True), dict(tensor_parallel_size=2), dict(quantization="int8")],
    ids=["lora", "tensor_parallel", "int8"])
def test_what_v0_cannot_run_is_refused_at_start(checkpoint, refused: dict) -> None:
    with pytest.raises(UnsupportedModelError, match="hybrid"):
        ModelRunner(RunnerConfig(model_dir=checkpoint[0], kv_cache_memory=2**20,
                                 max_model_len=256, **refused))
