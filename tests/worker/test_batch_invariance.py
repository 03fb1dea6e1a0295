"""--batch-invariant: a request's tokens and logprobs bitwise the same alone or among others,
whatever the chunking of its prefill (runner/batch_invariance.py)."""

from __future__ import annotations

import pytest
import torch

from services.common.model_files import resolve_model
from services.worker.models.layers import Linear
from services.worker.runner.cpu_runtime import load_cpu_kernels
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker.batch_mix import num_differing, random_prompts, run_alone, run_mixed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tiled_linears_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    # K = 1536: oneDNN's bf16 GEMM sums one row another way than two or more.
    linear = Linear(torch.randn(64, 1536, dtype=dtype) * 0.05, None, None, load_cpu_kernels())
    linear.make_batch_invariant(16)
    x = torch.randn(40, 1536, dtype=dtype)
    alone = torch.cat([linear(row) for row in x.split(1)])
    for size in (2, 7, 16, 17, 40):
        together = torch.cat([linear(part) for part in x.split(size)])
        assert torch.equal(together.view(torch.uint8), alone.view(torch.uint8)), size  # bits


def test_the_attention_plan_puts_every_token_in_prefill_tiles() -> None:
    ops = load_cpu_kernels()
    if ops is None:
        pytest.skip("the CPU kernels are not built here")
    query_start_loc = torch.tensor([0, 1, 2, 7], dtype=torch.int32)   # two decodes, a chunk
    seq_lens = torch.tensor([4000, 900, 40], dtype=torch.int32)
    items, merges, _ = ops.attention_plan(query_start_loc, seq_lens, 3, 3, 64, 0, True)
    assert len(merges) == 0                            # no KV splits
    assert (items[:, 1] >= 0).all()                    # no all-heads decode items
    assert len(items) == 3 * 3                         # one tile per request and KV head
    _, adaptive_merges, _ = ops.attention_plan(query_start_loc, seq_lens, 3, 3, 64, 0, False)
    assert torch.get_num_threads() == 1 or len(adaptive_merges) > 0


def test_the_flag_refuses_what_it_does_not_cover() -> None:
    with pytest.raises(ValueError, match="batch-invariant"):
        RunnerConfig(model_dir=resolve_model("").hf_dir, batch_invariant=True,
                     tensor_parallel_size=2)


@pytest.mark.slow
def test_bf16_prompts_alone_and_mixed_give_the_same_bits() -> None:
    runner = ModelRunner(RunnerConfig(
        model_dir=resolve_model("").hf_dir, dtype="bfloat16", kv_cache_memory=64 * 1024**2,
        max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, batch_invariant=True))
    # Lengths from 1: a prompt of one token is a "decode" for the attention kernels.
    prompts = random_prompts(14, runner.info.vocab_size, 1, 130, seed=1)
    alone = run_alone(runner, prompts, 8, token_budget=40)
    for batch_sizes, budget, seed in (([1, 3, 10], 64, 0), ([14], 17, 1), ([5, 9], 64, 2)):
        mixed = run_mixed(runner, prompts, batch_sizes, 8, budget, seed)
        assert num_differing(alone.outputs, mixed.outputs) == (0, 0), (batch_sizes, budget)
    runner.close()
