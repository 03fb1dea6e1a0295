"""Tensor parallelism (--tensor-parallel-size): how the model is split, and that two ranks
(real processes over gloo) compute what one does. Tiny random models of each dense family
match HF's logprobs at every position; the embedded SmolLM2, whose 3 KV heads split 2 + 1
over two ranks, gives HF's greedy output token for token."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from services.common.model_files import resolve_model
from services.worker.models.config import ModelConfig
from services.worker.models.weights import WeightSource
from services.worker.parallel.sharding import ShardedWeights, ShardPlan, share
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.reference import hf_chat_prompt_ids, hf_greedy_ids, hf_model
from tests.worker.driver import StepDriver
from tests.worker.test_runner_vs_hf import CHAT_PROMPTS, MAX_NEW_TOKENS, RAW_PROMPTS
from tests.worker.tiny_models import assert_logprobs_match_hf, save_tiny_model

TP = 2


@pytest.mark.parametrize("total,world", [(3, 2), (9, 2), (49152, 2), (7, 3), (4, 4)])
def test_shares_cover_the_whole_and_differ_by_at_most_one(total: int, world: int) -> None:
    shares = [share(total, world, rank) for rank in range(world)]
    assert shares[0][0] == 0 and shares[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    sizes = [end - start for start, end in shares]
    assert max(sizes) - min(sizes) <= 1


def test_smollm2_splits_its_heads_by_kv_group() -> None:
    config = ModelConfig.from_hf_dir(resolve_model("").hf_dir)   # 9 heads, 3 KV heads
    plans = [ShardPlan.of(config, rank, TP) for rank in range(TP)]
    assert [p.kv_heads for p in plans] == [(0, 2), (2, 3)]
    assert [p.q_heads for p in plans] == [(0, 6), (6, 9)]
    local = plans[1].rank_config
    assert (local.num_attention_heads, local.num_key_value_heads) == (3, 1)
    assert local.intermediate_size * TP == config.intermediate_size
    assert local.scale == config.scale and local.head_dim == config.head_dim


def test_more_ranks_than_kv_heads_is_refused() -> None:
    config = ModelConfig.from_hf_dir(resolve_model("").hf_dir)
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        ShardPlan.of(config, 0, 4)


def test_a_checkpoint_stored_quantized_is_refused(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                     "sym": True, "desc_act": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="stored gptq-quantized"):
        ModelRunner(RunnerConfig(model_dir=tmp_path, kv_cache_memory=2**20,
                                 tensor_parallel_size=TP))


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_the_ranks_shards_put_together_are_the_checkpoint(name: str, tmp_path: Path) -> None:
    save_tiny_model(name, tmp_path)
    config = ModelConfig.from_hf_dir(tmp_path)
    whole = WeightSource(tmp_path, torch.float32, torch.device("cpu"))
    shards = [ShardedWeights(whole, ShardPlan.of(config, rank, TP)) for rank in range(TP)]
    d, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    for name_, dim in [("layers.0.self_attn.q_proj.weight", 0),
                       ("layers.0.self_attn.k_proj.bias", 0),
                       ("layers.1.self_attn.o_proj.weight", 1),
                       ("layers.1.mlp.up_proj.weight", 0), ("layers.0.mlp.down_proj.weight", 1),
                       ("embed_tokens.weight", 0)]:
        if name_ in whole:
            joined = torch.cat([s.get(name_) for s in shards], dim=dim)
            assert torch.equal(joined, whole.get(name_)), name_
    # A fused q/k/v weight: each rank's rows are its q heads, then its k and v heads.
    fused = shards[1].get_fused([f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"])
    q_rows, kv_rows = (heads // TP) * d, (kv_heads // TP) * d
    assert fused.shape[0] == q_rows + 2 * kv_rows
    assert torch.equal(fused[:q_rows], whole.get("layers.0.self_attn.q_proj.weight")[q_rows:])
    assert torch.equal(shards[0].get("norm.weight"), whole.get("norm.weight"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_two_ranks_match_hf_at_every_position(name: str, tmp_path: Path) -> None:
    hf = save_tiny_model(name, tmp_path)
    runner = ModelRunner(RunnerConfig(model_dir=tmp_path, kv_cache_memory=2**20,
                                      max_num_seqs=4, tensor_parallel_size=TP))
    try:
        assert_logprobs_match_hf(hf, runner)
    finally:
        runner.close()


@pytest.mark.slow
def test_two_ranks_of_the_embedded_model_give_hfs_greedy_output() -> None:
    _, tokenizer = hf_model()
    prompts = ([tokenizer(p)["input_ids"] for p in RAW_PROMPTS]
               + [hf_chat_prompt_ids(p) for p in CHAT_PROMPTS[:2]])
    runner = ModelRunner(RunnerConfig(model_dir=resolve_model("").hf_dir, max_model_len=1024,
                                      kv_cache_memory=128 * 2**20, max_num_seqs=16,
                                      tensor_parallel_size=TP))
    followers = [p.pid for p in runner.parallel.followers]
    try:
        assert runner.model.layers[0].num_kv_heads == 2   # rank 0's share of the 3
        driver = StepDriver(runner, token_budget=48)      # chunked prefill beside decodes
        handles = [driver.add(p, MAX_NEW_TOKENS) for p in prompts]
        outputs = driver.run()
    finally:
        runner.close()
    assert [outputs[h] for h in handles] == [hf_greedy_ids(p, MAX_NEW_TOKENS) for p in prompts]
    for pid in followers:   # closing the runner ended its ranks
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
