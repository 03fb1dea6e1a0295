"""Workload generators: requested token lengths, shared prefixes, mixes and datasets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llm_mesh.bench.workloads import (PromptBuilder, WorkloadOptions, build_requests,
                                      load_tokenizer)


def lengths(builder: PromptBuilder, options: WorkloadOptions, n: int, seed: int = 0) -> list[int]:
    return [builder.count(r.prompt) for r in build_requests(options, builder, n, seed)]


def test_random_prompts_have_the_requested_length(tiny_tokenizer_dir: Path) -> None:
    builder = PromptBuilder(load_tokenizer(tiny_tokenizer_dir))
    options = WorkloadOptions(kind="random", input_len=24, output_len=7)
    requests = build_requests(options, builder, 10, seed=3)
    assert all(builder.count(r.prompt) == 24 == r.prompt_len for r in requests)
    assert all(r.output_len == 7 and r.messages is None for r in requests)
    assert len({r.prompt for r in requests}) == 10
    assert [r.prompt for r in build_requests(options, builder, 10, seed=3)] == \
        [r.prompt for r in requests]  # seeded


def test_mixed_puts_a_fraction_of_long_prompts_among_short_ones(tiny_tokenizer_dir: Path) -> None:
    builder = PromptBuilder(load_tokenizer(tiny_tokenizer_dir))
    options = WorkloadOptions(kind="mixed", input_len=8, long_input_len=300, long_fraction=0.2)
    requests = build_requests(options, builder, 20, seed=0)
    tags = [r.tag for r in requests]
    assert tags.count("long") == 4 and tags.count("short") == 16
    assert {r.prompt_len for r in requests if r.tag == "long"} == {300}
    assert {r.prompt_len for r in requests if r.tag == "short"} == {8}


def test_dataset_lines_become_prompts_or_messages(tiny_tokenizer_dir: Path,
                                                  tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": "w1 w2 w3", "output_len": 5},
            {"messages": [{"role": "user", "content": "w4 w5"}], "output_len": 9}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    builder = PromptBuilder(load_tokenizer(tiny_tokenizer_dir))
    chat = build_requests(WorkloadOptions(kind="dataset", is_chat=True, dataset=path,
                                          output_len=50), builder, 3, seed=0)
    assert chat[0].messages == [{"role": "user", "content": "w1 w2 w3"}]
    assert chat[1].messages == rows[1]["messages"]
    assert [r.output_len for r in chat] == [5, 9, 5]  # cycles through the file
    plain = build_requests(WorkloadOptions(kind="dataset", dataset=path), builder, 1, seed=0)
    assert plain[0].prompt == "w1 w2 w3" and plain[0].prompt_len == 3
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt"):
        build_requests(WorkloadOptions(kind="dataset", dataset=path), builder, 1, seed=0)


@pytest.mark.slow
def test_random_lengths_are_exact_with_the_model_tokenizer(model_tokenizer: Any) -> None:
    builder = PromptBuilder(model_tokenizer)
    for input_len in (1, 7, 32, 256, 2000):
        options = WorkloadOptions(kind="random", input_len=input_len)
        assert set(lengths(builder, options, 10, seed=input_len)) == {input_len}


@pytest.mark.slow
def test_shared_prefix_prompts_share_their_prefix_tokens(model_tokenizer: Any) -> None:
    builder = PromptBuilder(model_tokenizer)
    options = WorkloadOptions(kind="shared-prefix", prefix_len=200, suffix_len=16)
    requests = build_requests(options, builder, 8, seed=0)
    ids = [model_tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    # The first prefix_len tokens are the same in every prompt, so their KV can be shared.
    assert len({tuple(i[:200]) for i in ids}) == 1
    assert len({tuple(i[200:]) for i in ids}) == 8
    assert all(abs(len(i) - 216) <= 2 for i in ids)  # suffix may merge a token at the seam
    chat = build_requests(WorkloadOptions(kind="shared-prefix", is_chat=True, prefix_len=50,
                                          suffix_len=8), builder, 3, seed=0)
    assert len({r.messages[0]["content"] for r in chat}) == 1  # type: ignore[index]
    assert all(r.messages[0]["role"] == "system" for r in chat)  # type: ignore[index]
    assert builder.count(chat[0].messages[0]["content"]) == 50  # type: ignore[index]
