"""A constraint after the reasoning section (--reasoning-parser), on the worker's structured
outputs with real xgrammar and the embedded model's vocabulary, tokens fed by hand: the row
samples unmasked while it reasons, and from the token after `</think>` its mask is the
grammar's; the answer the gateway splits off then validates.

In this vocabulary both markers are three tokens ("<" "think" ">", "</" "think" ">").
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from services.common import wire
from services.common.grammar.grammar_cache import GrammarCache
from services.common.model_files import resolve_model
from services.common.packing import pack_int32
from services.frontend.openai.reasoning import get_reasoning_parser
from services.worker.sampling.structured_outputs import (
    GrammarBitmask,
    StructuredOutputs,
    load_tokenizer_info,
)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ANSWER = '{"city": "Paris"}'
EOS = 2
VOCAB = 49152
PROMPT = [1, 9690, 198, 504, 3365, 2]   # any prompt: the grammar never sees it


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    return resolve_model("").hf_dir


@pytest.fixture(scope="module")
def tokenizer(hf_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def tokenizer_info(hf_dir: Path) -> xgr.TokenizerInfo:
    return load_tokenizer_info(hf_dir, VOCAB, [EOS])


@pytest.fixture(scope="module")
def compiled(tokenizer_info: xgr.TokenizerInfo) -> xgr.CompiledGrammar:
    return xgr.GrammarCompiler(tokenizer_info).compile_json_schema(json.dumps(SCHEMA))


@pytest.fixture(autouse=True)
def worker_compile(monkeypatch: pytest.MonkeyPatch,
                   compiled: xgr.CompiledGrammar) -> None:
    """The worker's compile of SCHEMA, done already (a test may hold one instead)."""
    done: Future[xgr.CompiledGrammar] = Future()
    done.set_result(compiled)
    monkeypatch.setattr(GrammarCache, "get", lambda self, spec: done)


def encode(tokenizer: object, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)   # type: ignore[attr-defined]


def spec(tokenizer: object, parser: str) -> wire.GrammarSpec:
    """The grammar as the tokenizer service hands it on: markers with their token ids."""
    markers = get_reasoning_parser(parser).markers()
    markers.start_token_ids = pack_int32(encode(tokenizer, markers.start))
    markers.end_token_ids = pack_int32(encode(tokenizer, markers.end))
    return wire.GrammarSpec(kind=wire.GrammarKind.JSON_SCHEMA, spec=json.dumps(SCHEMA),
                            reasoning=markers)


class Row:
    """One constrained row of a persistent batch, fed token by token."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, grammar: wire.GrammarSpec) -> None:
        self.structured = StructuredOutputs(lambda: tokenizer_info, 1, VOCAB, 4)
        self.token_ids = np.zeros((1, 256), dtype=np.int32)
        self.token_ids[0, :len(PROMPT)] = PROMPT
        self.num_tokens = np.full(1, len(PROMPT), dtype=np.int32)
        self.structured.add_request(0, grammar, len(PROMPT))

    def mask(self) -> GrammarBitmask:
        mask = self.structured.fill_bitmask(np.array([0]), self.token_ids, self.num_tokens)
        assert mask is not None and not mask.failed
        return mask

    def feed(self, token: int) -> None:
        mask = self.mask()
        assert allows(mask, token), f"token {token} is masked out"
        self.token_ids[0, self.num_tokens[0]] = token
        self.num_tokens[0] += 1
        self.structured.accept_tokens(np.array([0]), np.array([token]))

    @property
    def outputs(self) -> list[int]:
        return self.token_ids[0, len(PROMPT):self.num_tokens[0]].tolist()


def allows(mask: GrammarBitmask, token: int) -> bool:
    return bool(mask.bitmask[0, token // 32] >> (token % 32) & 1)


def is_free(mask: GrammarBitmask) -> bool:
    return not mask.indices and bool((mask.bitmask[0] == -1).all())


def grammar_mask(compiled: xgr.CompiledGrammar, outputs: list[int]) -> np.ndarray:
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in outputs)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    return bitmask[0].numpy()


def answer_of(tokenizer: object, row: Row, parser: str) -> object:
    text = tokenizer.decode(row.outputs[:-1])   # type: ignore[attr-defined]
    content = get_reasoning_parser(parser).parse(text).content
    assert content is not None
    answer = json.loads(content)
    jsonschema.validate(answer, SCHEMA)
    return answer


def write_answer(row: Row, tokenizer: object, compiled: xgr.CompiledGrammar) -> None:
    """Feeds the answer and EOS, checking each mask is the grammar's after the marker."""
    start = len(row.outputs)
    for token in encode(tokenizer, ANSWER) + [EOS]:
        mask = row.mask()
        assert mask.indices == [0]
        assert np.array_equal(mask.bitmask[0].numpy(),
                              grammar_mask(compiled, row.outputs[start:]))
        row.feed(token)


def test_deepseek_r1_reasons_freely_then_answers_in_the_grammar(
        tokenizer: object, tokenizer_info: xgr.TokenizerInfo,
        compiled: xgr.CompiledGrammar) -> None:
    row = Row(tokenizer_info, spec(tokenizer, "deepseek_r1"))
    brace = encode(tokenizer, "{")[0]
    for token in encode(tokenizer, "Paris is the capital.</think>"):   # the marker last
        mask = row.mask()
        assert is_free(mask) and allows(mask, EOS)   # nothing masked, not even an end
        row.feed(token)
    assert not allows(row.mask(), encode(tokenizer, "Paris")[0])   # now the grammar's
    assert allows(row.mask(), brace)
    write_answer(row, tokenizer, compiled)
    assert answer_of(tokenizer, row, "deepseek_r1") == {"city": "Paris"}


def test_qwen3_reasons_only_after_an_opening_think(
        tokenizer: object, tokenizer_info: xgr.TokenizerInfo,
        compiled: xgr.CompiledGrammar) -> None:
    row = Row(tokenizer_info, spec(tokenizer, "qwen3"))
    open_think = encode(tokenizer, "<think>")
    first = row.mask()   # the grammar's first tokens, and the marker's first
    expected = grammar_mask(compiled, [])
    expected[open_think[0] // 32] |= np.int32(1 << open_think[0] % 32)
    assert np.array_equal(first.bitmask[0].numpy(), expected)
    row.feed(open_think[0])
    # "<" is no JSON: only the marker's next token may follow.
    assert np.flatnonzero(np.unpackbits(
        row.mask().bitmask[0].numpy().view(np.uint8), bitorder="little")).tolist() \
        == [open_think[1]]
    row.feed(open_think[1])
    row.feed(open_think[2])
    for token in encode(tokenizer, "Hmm, a city.</think>"):
        assert is_free(row.mask())
        row.feed(token)
    write_answer(row, tokenizer, compiled)
    assert answer_of(tokenizer, row, "qwen3") == {"city": "Paris"}


def test_qwen3_without_an_opening_think_is_constrained_from_the_first_token(
        tokenizer: object, tokenizer_info: xgr.TokenizerInfo,
        compiled: xgr.CompiledGrammar) -> None:
    row = Row(tokenizer_info, spec(tokenizer, "qwen3"))
    answer = encode(tokenizer, ANSWER)
    row.feed(answer[0])   # "{": not the marker's first token, so the grammar holds
    for token in answer[1:] + [EOS]:
        mask = row.mask()
        assert mask.indices == [0]
        assert np.array_equal(mask.bitmask[0].numpy(), grammar_mask(compiled, row.outputs))
        row.feed(token)
    assert answer_of(tokenizer, row, "qwen3") == {"city": "Paris"}


def test_a_resumed_row_finds_where_its_grammar_started(
        tokenizer: object, tokenizer_info: xgr.TokenizerInfo,
        compiled: xgr.CompiledGrammar) -> None:
    """A row rebuilt with its outputs (preempted, or moved here): the section is found in
    them, and the matcher replays only the answer so far."""
    outputs = encode(tokenizer, 'Paris.</think>{"city": "Pa')
    row = Row(tokenizer_info, spec(tokenizer, "deepseek_r1"))
    row.token_ids[0, len(PROMPT):len(PROMPT) + len(outputs)] = outputs
    row.num_tokens[0] += len(outputs)
    answer = outputs[len(encode(tokenizer, "Paris.</think>")):]
    assert np.array_equal(row.mask().bitmask[0].numpy(), grammar_mask(compiled, answer))


def test_a_reasoning_row_does_not_wait_for_its_compile(
        tokenizer: object, tokenizer_info: xgr.TokenizerInfo, compiled: xgr.CompiledGrammar,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile has the whole reasoning to finish: only a row that reaches its grammar
    before it is done is deferred."""
    held: Future[xgr.CompiledGrammar] = Future()
    monkeypatch.setattr(GrammarCache, "get", lambda self, spec: held)
    row = Row(tokenizer_info, spec(tokenizer, "deepseek_r1"))
    for token in encode(tokenizer, "Paris.</think>"):
        assert is_free(row.mask()) and not row.mask().deferred
        row.feed(token)
    assert row.mask().deferred == [0]
    held.set_result(compiled)
    write_answer(row, tokenizer, compiled)
