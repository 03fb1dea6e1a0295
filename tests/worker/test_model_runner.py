"""The ModelRunner's step contract on a tiny random model (fast): diffs, ordering, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.common import wire_pb
from services.common.packing import pack_int32, unpack_int32
from services.worker.kv.kv_cache import KVCacheTooSmallError
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker.driver import StepDriver, new_request_data
from tests.worker.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", directory)
    return directory


@pytest.fixture
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_memory=2**20, max_num_seqs=4,
                                    max_model_len=128))


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, n).tolist()


def test_info_describes_the_model_and_cache(runner: ModelRunner) -> None:
    info = runner.info
    assert (info.block_size, info.max_model_len, info.vocab_size) == (16, 128, 256)
    assert info.eos_token_ids == [2] and info.model_name
    # 2 layers x 2 KV heads x 16 x fp32 x (K, V) = 512 bytes per token; 1 MiB budget
    assert info.num_blocks == 2**20 // (512 * 16)


def test_max_model_len_defaults_to_the_model_and_is_bounded(model_dir: Path) -> None:
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_memory=2**20))
    assert runner.info.max_model_len == 256
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(RunnerConfig(model_dir=model_dir, max_model_len=257))


def test_refuses_a_kv_budget_below_one_max_length_request(model_dir: Path) -> None:
    with pytest.raises(KVCacheTooSmallError, match="--max-model-len"):
        ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_memory=256 * 512,
                                 max_model_len=256))


def test_partial_prefill_samples_nothing_and_the_last_chunk_samples(
        runner: ModelRunner) -> None:
    tokens = prompt(20)
    new = new_request_data(7, tokens, [1, 2])
    out = runner.execute(wire_pb.StepInput(step=1, new_requests=[new],
                                        num_scheduled_tokens=pack_int32([12])))
    assert not out.error and not out.handles and out.execute_s > 0
    out = runner.execute(wire_pb.StepInput(
        step=2, cached_handles=pack_int32([7]), cached_num_new_blocks=pack_int32([0]),
        cached_num_computed_tokens=pack_int32([12]), num_scheduled_tokens=pack_int32([8])))
    assert unpack_int32(out.handles).tolist() == [7]
    assert len(unpack_int32(out.sampled_token_ids)) == 1


def test_outputs_are_named_by_handle_whatever_the_order(runner: ModelRunner) -> None:
    """A mixed step (new prefills before a running decode on the wire) answers by handle."""
    alone = {}
    for handle, n in ((1, 9), (2, 30)):
        driver = StepDriver(runner)
        h = driver.add(prompt(n, seed=handle), max_new_tokens=3, stop_at_eos=False)
        alone[handle] = driver.run()[h]
    driver = StepDriver(runner, token_budget=64)
    first = driver.add(prompt(9, seed=1), max_new_tokens=3, stop_at_eos=False)
    driver.run_step()  # request 1 prefills and samples
    second = driver.add(prompt(30, seed=2), max_new_tokens=3, stop_at_eos=False)
    outputs = driver.run()
    assert outputs[first] == alone[1] and outputs[second] == alone[2]


def test_rows_are_recycled_beyond_max_num_seqs(runner: ModelRunner) -> None:
    driver = StepDriver(runner)
    for i in range(10):  # 4 rows, 10 requests over time
        h = driver.add(prompt(5, seed=i), max_new_tokens=2, stop_at_eos=False)
        driver.run()
        assert len(driver.requests[h].output_ids) == 2
    assert runner.input_batch.num_reqs == 0


def test_a_bad_step_returns_an_error_and_the_runner_lives_on(runner: ModelRunner) -> None:
    out = runner.execute(wire_pb.StepInput(
        step=3, cached_handles=pack_int32([99]), cached_num_new_blocks=pack_int32([0]),
        cached_num_computed_tokens=pack_int32([0]), num_scheduled_tokens=pack_int32([1])))
    assert "unknown request handle 99" in out.error
    out = runner.execute(wire_pb.StepInput(step=4, new_requests=[new_request_data(
        5, prompt(4), [])], num_scheduled_tokens=pack_int32([4])))
    assert "without KV blocks" in out.error
    driver = StepDriver(runner)
    h = driver.add(prompt(6), max_new_tokens=2, stop_at_eos=False)
    assert len(driver.run()[h]) == 2


def test_reset_drops_every_row(runner: ModelRunner) -> None:
    runner.execute(wire_pb.StepInput(step=1, new_requests=[new_request_data(1, prompt(4), [1])],
                                  num_scheduled_tokens=pack_int32([4])))
    assert runner.input_batch.num_reqs == 1
    runner.execute(wire_pb.StepInput(step=2, reset=True))
    assert runner.input_batch.num_reqs == 0


def test_resumed_request_with_outputs_sends_no_prompt_logprobs(runner: ModelRunner) -> None:
    sampling = wire_pb.SamplingParams(prompt_logprobs=2)
    tokens = prompt(10)
    resumed = wire_pb.NewRequestData(handle=3, token_ids=pack_int32(tokens + [5, 6]),
                                  num_prompt_tokens=10, block_ids=pack_int32([1]),
                                  sampling=sampling)
    fresh = new_request_data(4, tokens, [2], sampling)
    out = runner.execute(wire_pb.StepInput(step=1, new_requests=[resumed, fresh],
                                        num_scheduled_tokens=pack_int32([12, 10])))
    assert [c.handle for c in out.prompt_logprobs] == [4]
    chunk = out.prompt_logprobs[0]
    assert chunk.is_last_chunk and chunk.columns.num_top == 2
    assert unpack_int32(chunk.columns.token_ids).tolist() == tokens[1:]
    assert len(unpack_int32(chunk.columns.top_token_ids)) == 2 * 9
