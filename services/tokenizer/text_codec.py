"""Text <-> token ids for one model: chat templates, encoding, token strings."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import transformers
from tokenizers import Tokenizer
from transformers import AutoTokenizer

TOOL_USE_TEMPLATE = Path(__file__).parent / "templates" / "tool_use.jinja"


class InvalidPrompt(ValueError):
    """The input cannot be turned into tokens (bad template input, empty chat, ...)."""


def _template_text(template: str) -> str:
    """--chat-template as vLLM takes it: a file's path, or the template itself."""
    if template and "{" not in template:
        path = Path(template).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template: no file {path} (pass a path or the "
                                    f"template text itself)")
        return path.read_text()
    return template


# Tokenizer classes that are the tokenizer.json and nothing model-specific: loaded directly.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_hf_tokenizer(hf_dir: Path) -> Any:
    """The HF tokenizer of `hf_dir`.
    NOTE: a generic class (what a converted GGUF has) is loaded as itself: AutoTokenizer
    would first load the model's config class, which imports torch — 1.3 s of a tokenizer's
    3 s (re)start. Model-specific classes still go through AutoTokenizer."""
    config_path = hf_dir / "tokenizer_config.json"
    if config_path.is_file():
        name = json.loads(config_path.read_text()).get("tokenizer_class")
        if name in _GENERIC_CLASSES:
            return getattr(transformers, name).from_pretrained(hf_dir)
    return AutoTokenizer.from_pretrained(hf_dir)


class TextCodec:
    def __init__(self, hf_dir: Path, chat_template: str = "") -> None:
        self.hf = load_hf_tokenizer(hf_dir)
        self.chat_template = _template_text(chat_template) or None
        model_template = self.chat_template or self.hf.chat_template or ""
        # NOTE: a template that never names `tools` would drop them silently: requests with
        # tools (or tool turns) use the shipped hermes-style one instead.
        self.tool_template = (None if "tools" in model_template
                              else TOOL_USE_TEMPLATE.read_text())
        # The Rust tokenizer directly: ~10x less Python overhead per call than the HF wrapper.
        self.fast: Tokenizer = self.hf.backend_tokenizer
        self.vocab_size = self.fast.get_vocab_size(with_added_tokens=True)
        self._token_strings: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs_json: str = "",
                    tools: list[dict[str, Any]] | None = None) -> str:
        if not messages:
            raise InvalidPrompt("messages must not be empty")
        kwargs = json.loads(template_kwargs_json) if template_kwargs_json else {}
        if not isinstance(kwargs, dict):
            raise InvalidPrompt("chat_template_kwargs must be an object")
        if continue_final_message:
            add_generation_prompt = False
        uses_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool"
                                        for m in messages)
        template = chat_template or (self.tool_template if uses_tools else None) \
            or self.chat_template
        try:
            return self.hf.apply_chat_template(
                list(messages), tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=template,
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
