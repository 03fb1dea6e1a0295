"""Tokenizers for the bench tests: a tiny word-level one (fast) and the embedded model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llm_mesh.bench.workloads import load_tokenizer
from tests.bench.tiny_tokenizer import save_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def model_tokenizer() -> Any:
    """The embedded SmolLM2 tokenizer (resolve_model converts the GGUF once, ~20 s)."""
    return load_tokenizer(None)
