"""vLLM's return_token_ids through the official openai client (a trainer's rollout): the prompt's
ids are the tokenizer's (chat-templated for chat), each choice's ids decode to its text, streamed
chunks carry their delta's ids; and n samples of one prompt share its prefix blocks."""

from __future__ import annotations

import functools
import uuid
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.common.model_files import embedded_gguf_path

pytestmark = pytest.mark.slow

TOKEN_IDS = {"return_token_ids": True}


@functools.cache
def tokenizer() -> PreTrainedTokenizerBase:
    """The embedded model's tokenizer as HF loads it from the GGUF (the model is not needed)."""
    gguf = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def chat_ids(content: str) -> list[int]:
    text = tokenizer().apply_chat_template([{"role": "user", "content": content}],
                                           add_generation_prompt=True, tokenize=False)
    return tokenizer()(text, add_special_tokens=False)["input_ids"]


def extra(obj: Any, name: str) -> Any:
    """A field beyond OpenAI's schema (the client keeps those as extras)."""
    return (obj.model_extra or {}).get(name)


def decoded(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


def test_chat_returns_the_templated_prompt_and_each_choices_ids(
        client: openai.OpenAI, model_name: str) -> None:
    content = "Name two rivers in Europe."
    response = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": content}], n=2,
        temperature=1.0, seed=7, max_tokens=12, logprobs=True, extra_body=TOKEN_IDS)
    assert extra(response, "prompt_token_ids") == chat_ids(content)
    for choice in response.choices:
        ids = extra(choice, "token_ids")
        assert ids and decoded(ids) == choice.message.content
        assert len(ids) == len(choice.logprobs.content)   # one logprob per sampled id
    assert sum(len(extra(c, "token_ids")) for c in response.choices) == \
        response.usage.completion_tokens


def test_streamed_chat_chunks_carry_their_deltas_ids(client: openai.OpenAI,
                                                     model_name: str) -> None:
    content = "Describe the colour blue."
    whole = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=24, extra_body=TOKEN_IDS)
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=24, stream=True, extra_body=TOKEN_IDS)
    chunks = list(stream)
    assert extra(chunks[0], "prompt_token_ids") == chat_ids(content)
    assert all(extra(c, "prompt_token_ids") is None for c in chunks[1:])
    ids: list[int] = []
    for chunk in chunks[1:]:
        for choice in chunk.choices:
            ids += extra(choice, "token_ids") or []
    assert ids == extra(whole.choices[0], "token_ids")
    assert decoded(ids) == whole.choices[0].message.content


def test_completions_carry_each_prompts_ids_on_its_choices(client: openai.OpenAI,
                                                           model_name: str) -> None:
    prompts = ["The tallest mountain is", "Water boils at"]
    response = client.completions.create(model=model_name, prompt=prompts, n=2, temperature=0.8,
                                         seed=3, max_tokens=10, extra_body=TOKEN_IDS)
    for choice in response.choices:
        prompt = prompts[choice.index // 2]
        assert extra(choice, "prompt_token_ids") == tokenizer()(prompt)["input_ids"]
        assert decoded(extra(choice, "token_ids")) == choice.text
    stream = client.completions.create(model=model_name, prompt=prompts[0], temperature=0,
                                       max_tokens=10, stream=True, extra_body=TOKEN_IDS)
    chunks = list(stream)
    firsts = [extra(c.choices[0], "prompt_token_ids") for c in chunks if c.choices]
    assert firsts[0] == tokenizer()(prompts[0])["input_ids"]
    assert all(first is None for first in firsts[1:])
    ids = [i for c in chunks for choice in c.choices for i in extra(choice, "token_ids") or []]
    assert decoded(ids) == "".join(choice.text for c in chunks for choice in c.choices)


def test_without_the_flag_no_ids_are_returned(client: openai.OpenAI, model_name: str) -> None:
    response = client.completions.create(model=model_name, prompt="Hello", max_tokens=3)
    assert extra(response.choices[0], "token_ids") is None
    assert extra(response.choices[0], "prompt_token_ids") is None


def test_n_samples_share_the_prompts_prefix_blocks(client: openai.OpenAI,
                                                   model_name: str) -> None:
    """64 samples of one (new) prompt: the siblings hit the blocks the first one fills, in
    the same step (blocks are cached when allocated), so the prompt is prefilled once."""
    prompt = f"{uuid.uuid4().hex} " + "a rollout prompt long enough for several blocks " * 8
    response = client.completions.create(model=model_name, prompt=prompt, n=64, temperature=1.0,
                                         max_tokens=2, extra_body=TOKEN_IDS)
    assert len(response.choices) == 64
    num_prompt = len(extra(response.choices[0], "prompt_token_ids"))
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.prompt_tokens_details.cached_tokens >= (num_prompt - 1) // 16 * 16
