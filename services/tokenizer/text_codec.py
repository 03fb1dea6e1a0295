"""Text <-> token ids for one model: chat templates, encoding, token strings."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer


class InvalidPrompt(ValueError):
    """The input cannot be turned into tokens (bad template input, empty chat, ...)."""


class TextCodec:
    def __init__(self, hf_dir: Path) -> None:
        self.hf = AutoTokenizer.from_pretrained(hf_dir)
        # The Rust tokenizer directly: ~10x less Python overhead per call than the HF wrapper.
        self.fast: Tokenizer = self.hf.backend_tokenizer
        self.vocab_size = self.fast.get_vocab_size(with_added_tokens=True)
        self._token_strings: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs_json: str = "") -> str:
        if not messages:
            raise InvalidPrompt("messages must not be empty")
        kwargs = json.loads(template_kwargs_json) if template_kwargs_json else {}
        if not isinstance(kwargs, dict):
            raise InvalidPrompt("chat_template_kwargs must be an object")
        if continue_final_message:
            add_generation_prompt = False
        try:
            return self.hf.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                **kwargs)
        except Exception as exc:  # jinja errors, template-raised exceptions
            raise InvalidPrompt(f"cannot apply the chat template: {exc}") from exc

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_string(self, token_id: int) -> str:
        """The text of one token, as the OpenAI logprobs API names it (cached)."""
        text = self._token_strings.get(token_id)
        if text is None:
            text = self.fast.decode([token_id], skip_special_tokens=False)
            self._token_strings[token_id] = text
        return text

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [self.token_string(t) for t in token_ids]

    def raw_token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Vocabulary entries (e.g. 'Ġthe'), for /tokenize's return_token_strs."""
        return [self.fast.id_to_token(t) or "" for t in token_ids]
