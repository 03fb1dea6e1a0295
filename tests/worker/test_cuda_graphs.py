"""CUDA graphs (services/worker/runner/cuda_graphs.py) change launch overhead, not results: greedy
decodes replayed from captured graphs give the tokens eager steps give, and their logprobs,
on a tiny random Llama (Triton attention and layer ops inside the graphs), in fp32 with a
batch padded up to the next captured size and in bf16 with a batch of a captured size.

Runs on a CUDA device (KERNEL_TEST_DEVICE=cuda, or one visible); skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common import wire
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from services.worker.runner.step_batch import StepBatch
from tests.kernels.harness import DEVICE
from tests.worker.driver import StepDriver
from tests.worker.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu", reason="CUDA graphs need a CUDA device (KERNEL_TEST_DEVICE=cuda); none here")

MAX_NUM_SEQS = 4          # graphs of batch 1, 2 and 4
MAX_NEW_TOKENS = 24
PROMPT_LENS = (5, 17, 33, 60)
# The sampled tokens' logprobs, graphs against eager: fp32 sums of a padded batch may run in
# another order (a GEMM of 4 rows, not 3); bf16 logits are within a unit of their last place.
LOGPROB_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", directory)
    return directory


def _prompts(num: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS[:num]]


def _greedy(model_dir: Path, dtype: str, cuda_graphs: bool,
            num_prompts: int) -> tuple[list[list[int]], list[float], list[int]]:
    """Each prompt's greedy output, every sampled token's logprob, and the batch size of
    every step a graph replayed."""
    runner = ModelRunner(RunnerConfig(
        model_dir=model_dir, dtype=dtype, device=DEVICE, attention_backend="triton",
        max_num_seqs=MAX_NUM_SEQS, kv_cache_memory=1 << 22, enable_cuda_graphs=cuda_graphs))
    replayed: list[int] = []
    graphs = runner.cuda_graphs
    assert (graphs is not None) == cuda_graphs
    if graphs is not None:
        replay = graphs.run

        def counting_run(batch: StepBatch) -> torch.Tensor:   # the real replay, counted
            replayed.append(batch.attn.num_reqs)
            return replay(batch)

        graphs.run = counting_run
    try:
        driver = StepDriver(runner)   # every prompt prefills in step 1, then decodes together
        handles = [driver.add(p, MAX_NEW_TOKENS, stop_at_eos=False,
                              sampling=wire.SamplingParams(logprobs=1))
                   for p in _prompts(num_prompts)]
        outputs = driver.run()
    finally:
        runner.close()
    logprobs = [lp for h in handles for _, lp, *_ in driver.requests[h].logprobs]
    return [outputs[h] for h in handles], logprobs, replayed


@pytest.mark.parametrize("dtype,num_prompts", [("float32", 3), ("bfloat16", 4)])
def test_graphs_give_the_eager_tokens(model_dir: Path, dtype: str, num_prompts: int) -> None:
    eager, eager_logprobs, none_replayed = _greedy(model_dir, dtype, False, num_prompts)
    graphed, graphed_logprobs, replayed = _greedy(model_dir, dtype, True, num_prompts)
    assert not none_replayed
    # Every decode step after the prefill step replayed a graph, the whole batch at once.
    assert replayed == [num_prompts] * (MAX_NEW_TOKENS - 1)
    assert graphed == eager
    assert len(graphed_logprobs) == len(eager_logprobs) == num_prompts * MAX_NEW_TOKENS
    diff = (torch.tensor(graphed_logprobs) - torch.tensor(eager_logprobs)).abs().max()
    assert diff <= LOGPROB_TOLERANCE[dtype], diff
    # A random model repeats itself; these prompts' outputs still differ, and some move.
    assert len({tuple(o) for o in eager}) == num_prompts
    assert any(len(set(o)) > 1 for o in eager), eager
