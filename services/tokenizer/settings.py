"""The tokenizer's settings."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import CommonSettings, LivenessSettings, ModelSettings, setting
from services.tokenizer.multimodal.media_settings import MediaSettings


@dataclass
class TokenizerSettings(CommonSettings, ModelSettings, MediaSettings, LivenessSettings):
    detokenizer_state_ttl_s: float = setting(
        900.0, "Drop the detokenizer state of a request that got no output for this long")
    chat_template: str = setting(
        "", "A Jinja chat template (a file's path, or the template itself) used instead of "
        "the model's; empty: the model's, or the shipped tool-use template when a request "
        "has tools and the model's template cannot show them")
    grammar_cache_size: int = setting(
        256, "Structured outputs: compiled grammars kept (LRU), keyed by kind and spec text")
    grammar_compile_timeout_s: float = setting(
        10.0, "Structured outputs: a grammar not compiled by then is refused (400)")

    def __post_init__(self) -> None:
        MediaSettings.__post_init__(self)
        LivenessSettings.__post_init__(self)
