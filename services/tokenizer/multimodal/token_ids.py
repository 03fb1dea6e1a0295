"""Looking up the special tokens a prompt layout needs, failing loudly when one is missing."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def single_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer has no {token} token")
    return token_id


def text_token_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[int, ...]:
    """`text` alone, as the tokenizer encodes it between two special tokens."""
    return tuple(tokenizer.encode(text, add_special_tokens=False))
