"""A word-level tokenizer saved as a local HF directory: fast, offline, no model needed."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(200)]


def save_tiny_tokenizer(directory: Path) -> Path:
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                        eos_token="<eos>")
    tokenizer.save_pretrained(directory)
    return directory
