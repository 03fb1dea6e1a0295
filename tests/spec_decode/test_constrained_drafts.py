"""Speculative decoding on grammar-constrained rows: drafts are cut where the grammar refuses
them, each draft position is masked by the grammar after the drafts before it, and output
(greedy and seeded) is what the row samples without speculation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from services.common import wire
from services.common.speculative_config import SpeculativeConfig
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from services.worker.sampling.structured_outputs import StructuredOutputs, load_tokenizer_info
from tests.spec_decode.test_runner_spec import NGRAM, SUFFIX
from tests.worker.char_model import EOS, PIECES, char_ids, compile_when_added, save_char_model
from tests.worker.driver import StepDriver

TEXT = "the quick brown fox jumps over a lazy dog. "
LITERALS = 'root ::= "- " item " and " item " and " item\nitem ::= "the quick brown fox" | "a lazy dog"'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def char_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_char_model(tmp_path_factory.mktemp("tiny-llama-chars"))


@pytest.fixture(params=["ngram", "suffix"])
def speculative(request: pytest.FixtureRequest) -> SpeculativeConfig:
    return {"ngram": NGRAM, "suffix": SUFFIX}[request.param]


def grammar(kind: wire.GrammarKind, spec: str, **fields: object) -> wire.SamplingParams:
    return wire.SamplingParams(grammar=wire.GrammarSpec(kind=kind, spec=spec), **fields)


def constrained_rows(**fields: object) -> list[wire.SamplingParams]:
    return [grammar(wire.GrammarKind.EBNF, LITERALS, **fields),
            grammar(wire.GrammarKind.REGEX, r"(ab|cd|[0-9]){3,6}x", **fields),
            grammar(wire.GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA), **fields)]


def generate(model_dir: Path, speculative: SpeculativeConfig | None,
             samplings: list[wire.SamplingParams]) -> tuple[list[list[int]], StepDriver]:
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_memory=2**21,
                                      max_num_seqs=4, max_model_len=256,
                                      speculative_config=speculative))
    driver = StepDriver(runner)
    prompt = char_ids(TEXT * 3)
    handles = [driver.add(prompt, max_new_tokens=80, sampling=s) for s in samplings]
    handles.append(driver.add(prompt, max_new_tokens=30, stop_at_eos=False))   # free
    outputs = driver.run()
    return [outputs[h] for h in handles], driver


def text_of(tokens: list[int]) -> str:
    assert tokens and tokens[-1] == EOS, "the grammar ended the output with EOS"
    return "".join(PIECES[t] for t in tokens[:-1])


def test_greedy_constrained_output_is_unchanged_and_literals_are_drafted(
        char_model_dir: Path, speculative: SpeculativeConfig,
        monkeypatch: pytest.MonkeyPatch) -> None:
    compile_when_added(monkeypatch)
    plain, _ = generate(char_model_dir, None, constrained_rows())
    drafted, driver = generate(char_model_dir, speculative, constrained_rows())
    assert drafted == plain
    literals, regex, schema, _ = drafted
    assert re.fullmatch(r"- (the quick brown fox|a lazy dog)( and (the quick brown fox|a lazy "
                        r"dog)){2}", text_of(literals))
    assert re.fullmatch(r"(ab|cd|[0-9]){3,6}x", text_of(regex))
    assert PIECES[schema[0]] in ("{", '{"')   # (the random model pads JSON with spaces)
    literal_row = driver.requests[min(driver.requests)]
    # The literals repeat the prompt: drafts copied from it are what the grammar forces.
    assert literal_row.num_accepted > 0


def test_seeded_constrained_sampling_is_unchanged(
        char_model_dir: Path, speculative: SpeculativeConfig,
        monkeypatch: pytest.MonkeyPatch) -> None:
    compile_when_added(monkeypatch)
    rows = constrained_rows(temperature=1.0, top_p=0.9, seed=11)
    plain, _ = generate(char_model_dir, None, rows)
    drafted, driver = generate(char_model_dir, speculative, rows)
    assert drafted == plain
    assert sum(r.num_verified for r in driver.requests.values()) > 0


def test_drafts_are_cut_where_the_grammar_refuses_or_ends(char_model_dir: Path) -> None:
    outputs = StructuredOutputs(lambda: load_tokenizer_info(char_model_dir, 256, [EOS]),
                                max_num_reqs=4, vocab_size=256, cache_size=4)
    try:
        outputs.add_request(0, wire.GrammarSpec(kind=wire.GrammarKind.REGEX, spec="abc(d|e)"), 0)
        outputs.add_request(1, wire.GrammarSpec(kind=wire.GrammarKind.REGEX, spec="xyz"), 0)
        outputs.wait_compiled()
        rows = np.array([0, 1])
        token_ids = np.zeros((4, 16), dtype=np.int32)
        num_tokens = np.zeros(4, dtype=np.int32)
        outputs.fill_bitmask(rows, token_ids, num_tokens)   # builds the matchers
        before = outputs.fill_bitmask(rows, token_ids, num_tokens).bitmask.clone()
        token_ids[0, :5] = char_ids("abcfd")   # "f" is refused: 3 drafts stay
        token_ids[1, :4] = char_ids("xyz") + [EOS]   # EOS ends it: no draft at or past it
        kept = outputs.trim_drafts(rows, np.array([5, 4]), token_ids, num_tokens)
        assert kept.tolist() == [3, 3]
        # The matchers are back where they were: the same masks.
        after = outputs.fill_bitmask(rows, token_ids, num_tokens).bitmask
        assert after.equal(before)
    finally:
        outputs.close()
