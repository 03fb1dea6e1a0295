"""YaRN and dynamic-NTK rope scaling against HF transformers on tiny random Llama models."""

from __future__ import annotations

from pathlib import Path

import transformers

from services.worker.models.config import ModelConfig
from tests.worker.models.hf_compare import TINY, assert_matches_hf, save_tiny_checkpoint

CONTEXT = 32


def test_yarn_matches_hf(tmp_path: Path) -> None:
    # A pretraining context of 16 stretched 4x: every position past 16 is extrapolated.
    config = transformers.LlamaConfig(
        **{**TINY, "max_position_embeddings": 64}, num_hidden_layers=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=16))
    hf = save_tiny_checkpoint(config, tmp_path)
    assert ModelConfig.from_hf_dir(tmp_path).max_context == 64
    assert_matches_hf(hf, tmp_path)


def test_dynamic_ntk_matches_hf_past_the_context(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        **{**TINY, "max_position_embeddings": CONTEXT}, num_hidden_layers=2,
        rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    hf = save_tiny_checkpoint(config, tmp_path)
    assert ModelConfig.from_hf_dir(tmp_path).max_context == 2 * CONTEXT
    # Decoding from position 24 to 40: HF's generate grows the base at each token past 32,
    # as the per-position tables do; a forward pass over 32 tokens is plain rope.
    assert_matches_hf(hf, tmp_path, prompt_len=24, max_new_tokens=16,
                      num_forward_tokens=CONTEXT)
