"""Tiny random checkpoints for the runner-level tests: a target, and a draft model of
another shape and other weights over the same vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.worker.tiny_models import TINY, save_tiny_model

DRAFT_SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", directory)
    return directory


@pytest.fixture(scope="session")
def draft_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-draft")
    torch.manual_seed(1)
    config = transformers.LlamaConfig(**{**TINY, **DRAFT_SHAPE}, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory
