"""Mixtral and Qwen2-MoE against HF transformers on tiny random checkpoints.

Four experts, two per token; Mixtral with a sliding window on every layer, Qwen2-MoE with its
shared expert and a dense layer (mlp_only_layers) beside the sparse ones, Qwen3-MoE with q/k
norms and renormalized top-k weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from services.worker.models.config import ModelConfig
from tests.worker.models.hf_compare import (
    ATTENTION_PATHS,
    TINY,
    assert_matches_hf,
    save_tiny_checkpoint,
    use_attention_path,
)


def mixtral_config() -> transformers.MixtralConfig:
    return transformers.MixtralConfig(**TINY, num_hidden_layers=2, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=12)


def qwen2_moe_config() -> transformers.Qwen2MoeConfig:
    return transformers.Qwen2MoeConfig(
        **TINY, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1])


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_mixtral_matches_hf(path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_attention_path(path, monkeypatch)
    hf = save_tiny_checkpoint(mixtral_config(), tmp_path)
    assert_matches_hf(hf, tmp_path)


def test_qwen2_moe_matches_hf(tmp_path: Path) -> None:
    hf = save_tiny_checkpoint(qwen2_moe_config(), tmp_path)
    assert_matches_hf(hf, tmp_path)


def test_qwen3_moe_matches_hf(tmp_path: Path) -> None:
    config = transformers.Qwen3MoeConfig(**TINY, num_hidden_layers=2, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True)  # as Qwen3-30B-A3B
    hf = save_tiny_checkpoint(config, tmp_path)
    assert ModelConfig.from_hf_dir(tmp_path).moe.norm_topk_prob
    assert_matches_hf(hf, tmp_path)


def test_moe_configs(tmp_path: Path) -> None:
    mixtral_config().save_pretrained(tmp_path / "mixtral")
    qwen2_moe_config().save_pretrained(tmp_path / "qwen2_moe")
    mixtral = ModelConfig.from_hf_dir(tmp_path / "mixtral").moe
    assert mixtral.norm_topk_prob and mixtral.shared_expert_intermediate_size == 0
    assert mixtral.sparse_layers == (True, True) and mixtral.intermediate_size == 96
    qwen = ModelConfig.from_hf_dir(tmp_path / "qwen2_moe")
    assert qwen.attention_bias and qwen.layer_sliding_windows == (None, None, None)
    assert qwen.moe.sparse_layers == (True, False, True) and not qwen.moe.norm_topk_prob
    assert (qwen.moe.intermediate_size, qwen.moe.shared_expert_intermediate_size) == (32, 48)
