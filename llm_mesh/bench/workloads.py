"""Benchmark prompts with exact token lengths, built with a local tokenizer.

Exact lengths follow vLLM's random dataset: sample token ids (no special tokens), decode to
text, re-encode, then cut or pad the ids and repeat until the text re-encodes to exactly the
wanted count (one or two rounds in practice). The tokenizer is local: nothing is downloaded.

Workloads:
    random         input-len prompt tokens, output-len generated
    shared-prefix  one prefix-len system prefix shared by all, plus a unique suffix-len question
    mixed          short streaming decodes with a long-fraction of long-input-len prompts
    dataset        JSONL lines {"prompt": ..., "output_len": ...} or {"messages": [...]}
    multi-turn     agent-like chat sessions with growing histories (built in sessions.py:
                   each turn's history holds the server's previous answers)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WORKLOADS = ("random", "shared-prefix", "mixed", "dataset", "multi-turn")


@dataclass(frozen=True)
class SampleRequest:
    """One request as the endpoint wants it: `prompt` (completions) or `messages` (chat)."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    prompt_len: int     # local count; the server's usage replaces it when sent
    output_len: int
    tag: str
    session_id: str | None = None   # multi-turn: sent as prompt_cache_key and x-session-id


@dataclass(frozen=True)
class WorkloadOptions:
    kind: str = "random"
    is_chat: bool = False
    input_len: int = 256
    output_len: int = 128
    prefix_len: int = 1024
    suffix_len: int = 32
    long_input_len: int = 2000
    long_fraction: float = 0.1
    dataset: Path | None = None


def load_tokenizer(path: str | Path | None = None) -> Any:
    """A local tokenizer; by default the embedded model's (converted once, then cached)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # NOTE: never reach for a hub
    from transformers import AutoTokenizer

    if path is None:
        from services.common.model_files import resolve_model
        path = resolve_model("").hf_dir
    if not Path(path).expanduser().is_dir():
        raise ValueError(f"--tokenizer {path}: not a directory (pass a local tokenizer dir, "
                         f"e.g. the served model's; nothing is downloaded)")
    try:
        return AutoTokenizer.from_pretrained(str(Path(path).expanduser()), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 — transformers raises many kinds here
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc


class PromptBuilder:
    """Random text that the tokenizer encodes to exactly n tokens."""

    MAX_ROUNDS = 10

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        self._ids = np.array([i for i in range(len(tokenizer)) if i not in special])

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, rng: np.random.Generator, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        ids = rng.choice(self._ids, num_tokens).tolist()
        text = self.tokenizer.decode(ids)
        for _ in range(self.MAX_ROUNDS):
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == num_tokens:
                break
            # Merges across the joins change the count: cut, or pad with fresh ids, and retry.
            ids = (encoded[:num_tokens] if len(encoded) > num_tokens
                   else encoded + rng.choice(self._ids, num_tokens - len(encoded)).tolist())
            text = self.tokenizer.decode(ids)
        return text

    def chat_len(self, messages: list[dict[str, Any]]) -> int:
        try:
            # NOTE: tokenize=False then count: transformers 5 returns a dict for tokenize=True.
            return self.count(self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True))
        except Exception:  # noqa: BLE001 — no template: the contents are a fair estimate
            return sum(self.count(str(m.get("content", ""))) for m in messages)


def build_requests(options: WorkloadOptions, builder: PromptBuilder, num_prompts: int,
                   seed: int) -> list[SampleRequest]:
    """`num_prompts` requests of the workload; the same seed gives the same prompts."""
    rng = np.random.default_rng(seed)
    if options.kind == "random":
        return [_request(builder, options, builder.text(rng, options.input_len),
                         options.output_len, "random") for _ in range(num_prompts)]
    if options.kind == "shared-prefix":
        return _shared_prefix(options, builder, num_prompts, rng)
    if options.kind == "mixed":
        return _mixed(options, builder, num_prompts, rng)
    if options.kind == "dataset":
        return _dataset(options, builder, num_prompts)
    raise ValueError(f"unknown workload {options.kind!r}; choose from {', '.join(WORKLOADS)}")


def _request(builder: PromptBuilder, options: WorkloadOptions, text: str, output_len: int,
             tag: str, system: str | None = None) -> SampleRequest:
    if options.is_chat:
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": text})
        return SampleRequest(None, messages, builder.chat_len(messages), output_len, tag)
    prompt = text if system is None else system + text
    return SampleRequest(prompt, None, builder.count(prompt), output_len, tag)


def _shared_prefix(options: WorkloadOptions, builder: PromptBuilder, num_prompts: int,
                   rng: np.random.Generator) -> list[SampleRequest]:
    # NOTE: the prefix ends in a newline so that, as a pre-token boundary, it tokenizes the
    # same in every prompt (its KV blocks are then shareable); the chat form uses a system turn.
    prefix = builder.text(rng, max(options.prefix_len - 1, 0)) + "\n"
    return [_request(builder, options, builder.text(rng, options.suffix_len),
                     options.output_len, "shared-prefix", system=prefix)
            for _ in range(num_prompts)]


def _mixed(options: WorkloadOptions, builder: PromptBuilder, num_prompts: int,
           rng: np.random.Generator) -> list[SampleRequest]:
    num_long = round(num_prompts * options.long_fraction)
    if options.long_fraction > 0 and num_prompts > 1:
        num_long = max(num_long, 1)
    is_long = np.zeros(num_prompts, dtype=bool)
    is_long[rng.choice(num_prompts, num_long, replace=False)] = True
    return [_request(builder, options,
                     builder.text(rng, options.long_input_len if long else options.input_len),
                     options.output_len, "long" if long else "short")
            for long in is_long]


def _dataset(options: WorkloadOptions, builder: PromptBuilder,
             num_prompts: int) -> list[SampleRequest]:
    if options.dataset is None:
        raise ValueError("--workload dataset needs --dataset PATH (JSONL)")
    rows = read_jsonl(options.dataset)
    requests = []
    for i in range(num_prompts):  # cycles through the file when asked for more than it holds
        row = rows[i % len(rows)]
        output_len = int(row.get("output_len") or options.output_len)
        if "messages" in row:
            messages = row["messages"]
            if options.is_chat:
                requests.append(SampleRequest(None, messages, builder.chat_len(messages),
                                              output_len, "dataset"))
            else:
                prompt = builder.tokenizer.apply_chat_template(messages, tokenize=False,
                                                               add_generation_prompt=True)
                requests.append(SampleRequest(prompt, None, builder.count(prompt), output_len,
                                              "dataset"))
        else:
            requests.append(_request(builder, options, str(row["prompt"]), output_len,
                                     "dataset"))
    return requests


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
            raise ValueError(f"{path}:{number}: each line needs \"prompt\" or \"messages\"")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no requests")
    return rows
