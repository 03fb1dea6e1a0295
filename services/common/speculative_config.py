"""`--speculative-config`: vLLM's JSON flag, parsed and checked once for scheduler and worker.

`'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'` turns on
prompt-lookup speculation, `'{"method": "suffix"}'` suffix decoding, `'{"method":
"draft_model", "model": "<path or name>", "num_speculative_tokens": 3}'` a draft model (as in
vLLM, a config naming a `model` and no method means draft_model), `'{"method": "eagle3",
"model": "<head dir>", "num_speculative_tokens": 3}'` an EAGLE-3 head drafting from the
target's hidden states, `'{"method": "mtp", "num_speculative_tokens": 2}'` the target
checkpoint's own multi-token prediction layer (MiMo's layout): the worker proposes up to
num_speculative_tokens drafts per request after each sampling step, the scheduler schedules
them as extra query positions, and the worker's verifier keeps the target model's
distribution (docs/architecture.md, "Speculative decoding"). An empty flag (the default) is
off. Keys and defaults are vLLM's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft_model", "eagle3", "mtp")
MODEL_METHODS = ("draft_model", "eagle3")   # the methods that load a `model`
_DEFAULT_PROMPT_LOOKUP = 5   # vLLM's n-gram window when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    """Most drafts per request and step."""
    prompt_lookup_min: int = _DEFAULT_PROMPT_LOOKUP
    """n-gram: shortest suffix (in tokens) a match needs."""
    prompt_lookup_max: int = _DEFAULT_PROMPT_LOOKUP
    """n-gram: longest suffix tried; the longest that matches wins."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: longest suffix of the context matched, in tokens."""
    suffix_decoding_max_cached_requests: int = 10000
    """suffix: finished requests whose outputs later requests draft from (0: none)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: drafts at most this many times the matched suffix's length."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: a draft path stops where its estimated probability falls below this."""
    model: str | None = None
    """draft_model: the draft's path or name, resolved as --model is (same tokenizer);
    eagle3: the head's checkpoint directory (vLLM's LlamaForCausalLMEagle3 layout)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported "
                             f"(choose from {', '.join(METHODS)})")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1 and "
                             "suffix_decoding_max_cached_requests >= 0")
        if self.suffix_decoding_max_spec_factor <= 0 or not (
                0 <= self.suffix_decoding_min_token_prob <= 1):
            raise ValueError("suffix_decoding_max_spec_factor must be > 0 and "
                             "suffix_decoding_min_token_prob in [0, 1]")
        if self.method == "draft_model" and not self.model:
            raise ValueError("draft_model needs `model`: the draft's path or name")
        if self.method == "eagle3" and not self.model:
            raise ValueError("eagle3 needs `model`: the EAGLE-3 head's checkpoint directory")
        if self.method not in MODEL_METHODS and self.model is not None:
            raise ValueError(f"`model` names a draft model, which {self.method} does not use")


_STR_KEYS = {"method", "model"}
_INT_KEYS = {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"}


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The flag's JSON as a config; None when the flag is empty (speculation off). Raises
    ValueError naming what is wrong."""
    if not text.strip():
        return None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(values) - {f.name for f in fields(SpeculativeConfig)})
    if unknown:
        raise ValueError(f"--speculative-config: unsupported keys {unknown}")
    if "method" not in values and "model" in values:
        values["method"] = "draft_model"   # vLLM's rule for a config naming only a model
    if values.get("method") not in METHODS:
        raise ValueError(f"--speculative-config: method must be one of {', '.join(METHODS)}")
    for name, value in values.items():
        if name in _STR_KEYS:
            if not isinstance(value, str):
                raise ValueError(f"--speculative-config: {name} must be a string")
            continue
        numeric = (int,) if name in _INT_KEYS else (int, float)
        if not isinstance(value, numeric) or isinstance(value, bool):
            raise ValueError(f"--speculative-config: {name} must be a number")
    if values["method"] != "suffix" and "num_speculative_tokens" not in values:
        raise ValueError(f"--speculative-config: {values['method']} needs "
                         f"num_speculative_tokens")
    if values["method"] == "ngram":
        # vLLM's rule: one bound given stands for both.
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        values["prompt_lookup_min"] = low if low is not None else (
            high if high is not None else _DEFAULT_PROMPT_LOOKUP)
        values["prompt_lookup_max"] = high if high is not None else values["prompt_lookup_min"]
    elif values["method"] == "suffix":
        # vLLM's default: as many drafts as the deepest match could justify.
        values.setdefault("num_speculative_tokens", values.get(
            "suffix_decoding_max_tree_depth",
            SpeculativeConfig.suffix_decoding_max_tree_depth))
    return SpeculativeConfig(**values)
