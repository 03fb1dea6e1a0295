"""Gemma 2 and Gemma 3 (text) against HF transformers on tiny random checkpoints.

Windows of 8 tokens against 45-token prompts prefilled in chunks of 20: every chunk after the
first and every decode reads a context longer than its sliding layers' window.
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

WINDOW = 8


def gemma2_config() -> transformers.Gemma2Config:
    # NOTE: caps far below Gemma 2's real 50 / 30, so random scores and logits get bent.
    return transformers.Gemma2Config(**TINY, num_hidden_layers=4, sliding_window=WINDOW,
                                     query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                     final_logit_softcapping=4.0)


def gemma3_config() -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(
        **TINY, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_gemma2_matches_hf(path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_attention_path(path, monkeypatch)
    hf = save_tiny_checkpoint(gemma2_config(), tmp_path)
    assert_matches_hf(hf, tmp_path)


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_gemma3_matches_hf(path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_attention_path(path, monkeypatch)
    hf = save_tiny_checkpoint(gemma3_config(), tmp_path)
    assert_matches_hf(hf, tmp_path)


def test_gemma_configs_read_layer_windows_caps_and_rope(tmp_path: Path) -> None:
    gemma2_config().save_pretrained(tmp_path / "g2")
    gemma3_config().save_pretrained(tmp_path / "g3")
    g2 = ModelConfig.from_hf_dir(tmp_path / "g2")
    assert g2.layer_sliding_windows == (WINDOW, None, WINDOW, None)  # sliding layers first
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (2.0, 4.0)
    assert g2.scale == 24 ** -0.5 and g2.hidden_act == "gelu_pytorch_tanh"
    g3 = ModelConfig.from_hf_dir(tmp_path / "g3")
    assert g3.layer_sliding_windows == (WINDOW, WINDOW, None, WINDOW)
    assert g3.qk_norm and g3.attn_logit_softcapping is None
    assert (g3.rope_theta, g3.local_rope_theta) == (100000.0, 500.0)
    assert g3.rope_scaling == {"rope_type": "linear", "factor": 2.0}
