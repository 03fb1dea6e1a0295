"""Sliding-window attention in the Llama family against HF transformers: Mistral with a window
on every layer, Qwen2 with global layers below max_window_layers and sliding ones above. The
45-token prompts run in chunks of 20 past a window of 8, then decode past it."""

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


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_mistral_sliding_window_matches_hf(path: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    use_attention_path(path, monkeypatch)
    hf = save_tiny_checkpoint(
        transformers.MistralConfig(**TINY, num_hidden_layers=2, sliding_window=8), tmp_path)
    config = ModelConfig.from_hf_dir(tmp_path)
    assert config.layer_sliding_windows == (8, 8)
    assert config.max_context == TINY["max_position_embeddings"]  # the window caps nothing
    assert_matches_hf(hf, tmp_path)


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_qwen2_mixed_sliding_and_global_layers_match_hf(path: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    use_attention_path(path, monkeypatch)
    hf = save_tiny_checkpoint(transformers.Qwen2Config(
        **TINY, num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
        max_window_layers=1), tmp_path)
    assert ModelConfig.from_hf_dir(tmp_path).layer_sliding_windows == (None, 8, 8)
    assert_matches_hf(hf, tmp_path)
