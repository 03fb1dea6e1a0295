"""HF transformers as the reference: the embedded GGUF loaded the way users load it."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.model_files import embedded_gguf_path


def hf_model(dtype: torch.dtype = torch.float32) -> tuple[AutoModelForCausalLM, AutoTokenizer]:
    return _load(dtype)


@functools.cache
def _load(dtype: torch.dtype) -> tuple[AutoModelForCausalLM, AutoTokenizer]:
    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    model.eval()
    return model, tokenizer


def hf_greedy_ids(prompt_ids: list[int], max_new_tokens: int,
                  dtype: torch.dtype = torch.float32) -> list[int]:
    """HF's greedy `generate` continuation (stops after EOS, as generate does). Cached: test
    modules comparing different runners with HF on the same prompts pay for it once."""
    return list(_hf_greedy_ids(tuple(prompt_ids), max_new_tokens, dtype))


@functools.cache
def _hf_greedy_ids(prompt_ids: tuple[int, ...], max_new_tokens: int,
                   dtype: torch.dtype) -> tuple[int, ...]:
    model, _ = hf_model(dtype)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(
            1, len(prompt_ids), dtype=torch.long), max_new_tokens=max_new_tokens,
            do_sample=False)
    return tuple(out[0, len(prompt_ids):].tolist())


def hf_chat_prompt_ids(content: str) -> list[int]:
    """The chat-templated prompt as HF renders and encodes it."""
    _, tokenizer = hf_model()
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
