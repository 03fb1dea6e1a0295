"""Phi-3 against HF transformers on tiny random checkpoints: fused qkv_proj / gate_up_proj
weights, a sliding window on every layer, and LongRoPE (Phi-3-mini-128k's scaling)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from services.worker.models.config import ModelConfig
from services.worker.models.rotary import RotaryEmbedding
from tests.worker.models.hf_compare import (
    ATTENTION_PATHS,
    TINY,
    assert_matches_hf,
    save_tiny_checkpoint,
    use_attention_path,
)

ORIGINAL_CONTEXT = 32


def longrope_config() -> transformers.Phi3Config:
    half = TINY["head_dim"] // 2
    gen = torch.Generator().manual_seed(3)
    return transformers.Phi3Config(
        **{**TINY, "max_position_embeddings": 128}, num_hidden_layers=2,
        original_max_position_embeddings=ORIGINAL_CONTEXT,
        rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0,
            short_factor=(1 + torch.rand(half, generator=gen)).tolist(),
            long_factor=(4 + 8 * torch.rand(half, generator=gen)).tolist()))


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_phi3_sliding_window_matches_hf(path: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    use_attention_path(path, monkeypatch)
    hf = save_tiny_checkpoint(
        transformers.Phi3Config(**TINY, num_hidden_layers=2, sliding_window=12), tmp_path)
    assert ModelConfig.from_hf_dir(tmp_path).layer_sliding_windows == (12, 12)
    assert_matches_hf(hf, tmp_path)


def test_phi3_longrope_matches_hf_inside_the_original_context(tmp_path: Path) -> None:
    hf = save_tiny_checkpoint(longrope_config(), tmp_path)
    # NOTE: HF's generate recomputes the whole sequence with the long factors when it grows
    # past the original context (Phi3ForCausalLM.prepare_inputs_for_generation); we keep the
    # cached keys (rotary.py), so greedy equality is checked inside it: short factors and the
    # attention factor. The switch to the long factors is checked on the tables below.
    assert_matches_hf(hf, tmp_path, prompt_len=22, max_new_tokens=ORIGINAL_CONTEXT - 22)


def test_longrope_tables_switch_factors_at_the_original_context(tmp_path: Path) -> None:
    longrope_config().save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dir(tmp_path)
    assert config.rope_scaling["factor"] == 128 / ORIGINAL_CONTEXT
    rotary = RotaryEmbedding(config.head_dim, 64, config.rope_theta, config.rope_scaling,
                             torch.float32, torch.device("cpu"))
    scaling = config.rope_scaling
    factor = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(32.0))).sqrt()
    base = 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    for position, name in ((31, "short_factor"), (32, "long_factor")):
        angle = position / (torch.tensor(scaling[name]) * base)
        want = torch.cat([angle, angle]).cos() * factor
        torch.testing.assert_close(rotary.cos_cache[position], want)
