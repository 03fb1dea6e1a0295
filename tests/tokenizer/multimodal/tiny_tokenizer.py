"""A byte-level BPE tokenizer trained in milliseconds, plus a model family's special tokens:
enough to compare prompt layouts with HF's processors without loading a real model."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = "User: describe this picture, please.\nAssistant: a cat on a mat"


def tiny_tokenizer(special_tokens: Sequence[str], *,
                   merges_double_newline: bool = True) -> PreTrainedTokenizerFast:
    """`merges_double_newline`: whether "\\n\\n" is one token (as in SmolLM2's) or two."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # NOTE: a text that ends in "\n\n" is the one place the pre-tokenizer keeps it whole.
    tokenizer.train_from_iterator([CORPUS + ("\n\n" if merges_double_newline else "")] * 20,
                                  trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.add_tokens(list(special_tokens), special_tokens=True)
    return fast
