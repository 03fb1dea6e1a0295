"""A tiny random model (vocabulary 256) with a character-level tokenizer saved beside it, for
grammar tests: fast, offline, and every token's text is known."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
import xgrammar as xgr
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from services.common import wire
from services.common.grammar.grammar_cache import GrammarCache
from tests.worker.tiny_models import save_tiny_model

EOS = 2


def char_pieces() -> list[str]:
    """Ids 0-2 are <unk> <s> </s> (EOS = 2, as the tiny model's), then printable ASCII
    characters, then a few multi-character pieces, up to 256 ids."""
    pieces = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(32, 127)]
    pieces += ["ab", "cd", "abcd", '{"', '":', '",', '"}', "true", "false", "null", "12", "34"]
    return pieces + [f"w{i}" for i in range(256 - len(pieces))]


PIECES = char_pieces()


def save_char_model(directory: Path) -> Path:
    save_tiny_model("llama", directory)
    core = Tokenizer(models.WordLevel({p: i for i, p in enumerate(PIECES)}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)
    return directory


def char_ids(text: str) -> list[int]:
    """`text` as one token per character."""
    return [PIECES.index(c) for c in text]


def compile_when_added(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each grammar compiles when its row is added, so the model tests that are about masks
    see the same steps on any machine; the tests of a compile still running hold one
    instead."""
    get = GrammarCache.get

    def get_compiled(cache: GrammarCache, spec: wire.GrammarSpec) -> Future[xgr.CompiledGrammar]:
        future = get(cache, spec)
        future.exception()   # waits for it
        return future

    monkeypatch.setattr(GrammarCache, "get", get_compiled)
