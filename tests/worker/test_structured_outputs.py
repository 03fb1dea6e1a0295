"""Structured outputs on the worker: grammar-masked rows beside free ones in one step, masked
logprobs, matchers rebuilt from a request's tokens after preemption or a move, and rows whose
grammar still compiles deferred while the step goes on.

A tiny random model with a character-level tokenizer (char_model.py).
"""

from __future__ import annotations

import math
import re
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
import xgrammar as xgr

from services.common import wire
from services.common.grammar.grammar_cache import GrammarCache
from services.common.packing import unpack_int32, unpack_strings
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from services.worker.sampling.structured_outputs import (
    GrammarBitmask,
    StructuredOutputs,
    apply_bitmask,
    load_tokenizer_info,
)
from tests.worker.char_model import EOS, PIECES, compile_when_added, save_char_model
from tests.worker.driver import StepDriver

PROMPT = [5, 17, 33, 60, 71, 90, 101, 120, 7]
REGEX = r"(ab|cd|[0-9]){3,6}x"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_char_model(tmp_path_factory.mktemp("tiny-llama-grammar"))


@pytest.fixture
def runner(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    compile_when_added(monkeypatch)
    return ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_memory=2**20, max_num_seqs=4,
                                    max_model_len=128))


def regex_sampling(**fields: object) -> wire.SamplingParams:
    return wire.SamplingParams(grammar=wire.GrammarSpec(kind=wire.GrammarKind.REGEX, spec=REGEX),
                               **fields)


def text_of(tokens: list[int]) -> str:
    assert tokens and tokens[-1] == EOS, "the grammar ended the output with EOS"
    return "".join(PIECES[t] for t in tokens[:-1])


def test_a_constrained_row_beside_a_free_one(runner: ModelRunner) -> None:
    alone = StepDriver(runner)
    free_alone = alone.add(PROMPT, max_new_tokens=12, stop_at_eos=False)
    reference = alone.run()[free_alone]

    driver = StepDriver(runner)
    constrained = driver.add(PROMPT, max_new_tokens=40, sampling=regex_sampling())
    free = driver.add(PROMPT, max_new_tokens=12, stop_at_eos=False)
    outputs = driver.run()
    assert re.fullmatch(REGEX, text_of(outputs[constrained]))
    assert outputs[free] == reference   # the mask touched only its own row


def test_seeded_random_rows_stay_in_the_grammar(runner: ModelRunner) -> None:
    driver = StepDriver(runner)
    handles = [driver.add(PROMPT, max_new_tokens=40,
                          sampling=regex_sampling(temperature=1.5, seed=seed, top_k=50))
               for seed in (1, 2, 3)]
    outputs = driver.run()
    for handle in handles:
        assert re.fullmatch(REGEX, text_of(outputs[handle]))


def test_logprobs_are_of_the_masked_distribution(runner: ModelRunner) -> None:
    choice = wire.GrammarSpec(kind=wire.GrammarKind.EBNF, spec='root ::= "yes" | "no"')
    driver = StepDriver(runner)
    handle = driver.add(PROMPT, max_new_tokens=8,
                        sampling=wire.SamplingParams(grammar=choice, logprobs=5))
    output = driver.run()[handle]
    assert text_of(output) in ("yes", "no")
    token, logprob, top_ids, top_logprobs = driver.requests[handle].logprobs[0]
    allowed = {PIECES.index("y"), PIECES.index("n")}
    finite = [(t, lp) for t, lp in zip(top_ids, top_logprobs) if math.isfinite(lp)]
    assert {t for t, _ in finite} == allowed and token in allowed
    assert math.isclose(sum(math.exp(lp) for _, lp in finite), 1.0, rel_tol=1e-4)
    assert logprob == dict(finite)[token]


def test_a_grammar_that_dead_ends_fails_its_request_alone(runner: ModelRunner) -> None:
    """After "a" this grammar allows nothing (x never ends): the worker reports no token for
    that request but names it rejected, with why (the scheduler fails it as invalid), and the
    step goes on for the others."""
    dead_end = wire.GrammarSpec(kind=wire.GrammarKind.EBNF, spec='root ::= "a" x\nx ::= x "b"')
    driver = StepDriver(runner)
    doomed = driver.add(PROMPT, max_new_tokens=8, sampling=wire.SamplingParams(grammar=dead_end))
    free = driver.add(PROMPT, max_new_tokens=8, stop_at_eos=False)
    driver.run_step()
    assert driver.requests[doomed].output_ids == [PIECES.index("a")]
    out = driver.run_step()
    assert unpack_int32(out.handles).tolist() == [free]
    # Named as the request's own fault, so its client gets a 400, not an engine error.
    assert unpack_int32(out.rejected_handles).tolist() == [doomed]
    assert "allows no token" in unpack_strings(out.rejected_reasons)[0]
    driver.requests[doomed].max_new_tokens = 1   # failed: the scheduler drops it
    driver.finished.append(doomed)
    assert len(driver.run()[free]) == 8


def test_a_row_past_its_grammars_end_samples_unmasked(runner: ModelRunner) -> None:
    """Async scheduling runs a request once more before the scheduler sees the stop token
    that ended its grammar: that step must not fail (the scheduler drops its token)."""
    driver = StepDriver(runner)
    handle = driver.add(PROMPT, max_new_tokens=40, sampling=regex_sampling())
    driver.add(PROMPT, max_new_tokens=40, stop_at_eos=False)
    request = driver.requests[handle]
    while not request.done:
        driver.run_step()
    assert re.fullmatch(REGEX, text_of(request.output_ids))
    num_outputs = len(request.output_ids)
    driver.finished.remove(handle)
    request.stop_at_eos = False   # as if the scheduler had not seen the EOS yet
    out = driver.run_step()
    assert handle in unpack_int32(out.handles).tolist() and not out.rejected_handles
    assert len(request.output_ids) == num_outputs + 1


def run_interrupted(runner: ModelRunner, moved: bool) -> tuple[list[int], list[int]]:
    """Runs the constrained request a few steps, then drops its row and sends it again with
    its outputs: preempted (outputs after the prompt) or moved to another engine (outputs
    inside the prompt, named by num_resumed_tokens). Returns (outputs before, all outputs)."""
    driver = StepDriver(runner)
    first = driver.add(PROMPT, max_new_tokens=40, sampling=regex_sampling())
    for _ in range(4):
        driver.run_step()
    request = driver.requests[first]
    before = list(request.output_ids)
    assert before and before[-1] != EOS
    request.max_new_tokens = len(before)   # this copy is done: its row is dropped next step
    driver.finished.append(first)
    if moved:
        sampling = regex_sampling()
        sampling.grammar.num_resumed_tokens = len(before)
        again = driver.add(PROMPT + before, max_new_tokens=40 - len(before), sampling=sampling)
        return before, before + driver.run()[again]
    again = driver.add(PROMPT, max_new_tokens=40, sampling=regex_sampling())
    driver.requests[again].token_ids += before
    return before, driver.run()[again]


@pytest.mark.parametrize("moved", [False, True], ids=["preempted", "moved"])
def test_a_resumed_request_rebuilds_its_matcher(runner: ModelRunner,
                                                moved: bool) -> None:
    reference_driver = StepDriver(runner)
    handle = reference_driver.add(PROMPT, max_new_tokens=40, sampling=regex_sampling())
    reference = reference_driver.run()[handle]
    before, outputs = run_interrupted(runner, moved)
    assert outputs[:len(before)] == before
    assert re.fullmatch(REGEX, text_of(outputs))
    assert outputs == reference


def test_a_rebuilt_matcher_masks_as_the_original(model_dir: Path) -> None:
    """The bitmask after replaying a row's outputs equals the one of the matcher that
    generated them, token by token (no model: the outputs are chosen here)."""
    spec = wire.GrammarSpec(kind=wire.GrammarKind.JSON_SCHEMA, spec='{"type": "object", '
                            '"properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    outputs = [PIECES.index(t) for t in ['{"', "a", '":', "1", "2"]]
    token_ids = np.zeros((2, 64), dtype=np.int32)
    num_tokens = np.full(2, len(PROMPT), dtype=np.int32)
    token_ids[:, :len(PROMPT)] = PROMPT
    live = _structured(model_dir)
    live.add_request(0, spec, len(PROMPT))
    live.wait_compiled()
    rows = np.array([0])
    for token in outputs:
        live.fill_bitmask(rows, token_ids, num_tokens)
        token_ids[0, num_tokens[0]] = token
        num_tokens[0] += 1
        live.accept_tokens(rows, np.array([token]))
    token_ids[1], num_tokens[1] = token_ids[0], num_tokens[0]
    rebuilt = _structured(model_dir)
    rebuilt.add_request(1, spec, len(PROMPT))
    rebuilt.wait_compiled()
    expected = live.fill_bitmask(rows, token_ids, num_tokens)
    got = rebuilt.fill_bitmask(np.array([1]), token_ids, num_tokens)
    assert expected is not None and got is not None
    assert torch.equal(expected.bitmask[0], got.bitmask[0])


def _structured(model_dir: Path) -> StructuredOutputs:
    return StructuredOutputs(lambda: load_tokenizer_info(model_dir, 256, [EOS]), 2, 256, 4)


def test_the_cpu_mask_equals_xgrammars_kernel() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=generator)
    bitmask = xgr.allocate_token_bitmask(8, 100)
    bitmask.random_(-2**31, 2**31 - 1, generator=generator)
    bitmask[[1, 2, 4]] = -1   # rows without a grammar allow everything (fill_bitmask's rule)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=[0, 3])
    apply_bitmask(logits, GrammarBitmask(bitmask[:5], [0, 3], failed=[]))
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[0]).any() and not torch.isinf(logits[1]).any()


# ---- a grammar still compiling never stalls the step ------------------------------------

def compiled_regex(model_dir: Path) -> xgr.CompiledGrammar:
    return xgr.GrammarCompiler(load_tokenizer_info(model_dir, 256, [EOS])).compile_regex(REGEX)


def held_compile(model_dir: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> tuple[StructuredOutputs, Future[xgr.CompiledGrammar], np.ndarray, np.ndarray]:
    """Row 0 constrained, its compile held by the test; the batch's token columns (two rows
    at the end of the prompt)."""
    held: Future[xgr.CompiledGrammar] = Future()
    monkeypatch.setattr(GrammarCache, "get", lambda self, spec: held)
    structured = _structured(model_dir)
    structured.add_request(0, regex_sampling().grammar, len(PROMPT))
    token_ids = np.zeros((2, 64), dtype=np.int32)
    token_ids[:, :len(PROMPT)] = PROMPT
    return structured, held, token_ids, np.full(2, len(PROMPT), dtype=np.int32)


def test_a_row_whose_grammar_compiles_is_deferred_not_waited_for(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    structured, held, token_ids, num_tokens = held_compile(model_dir, monkeypatch)
    rows = np.array([1, 0])       # a free row samples beside it
    mask = structured.fill_bitmask(rows, token_ids, num_tokens)   # returns at once
    assert mask is not None
    assert (mask.deferred, mask.indices, mask.failed) == ([1], [], [])
    assert bool((mask.bitmask == -1).all())
    structured.accept_tokens(rows[:1], np.array([PIECES.index("q")]))   # the free row's
    held.set_result(compiled_regex(model_dir))
    mask = structured.fill_bitmask(rows, token_ids, num_tokens)
    assert mask is not None and (mask.deferred, mask.indices, mask.failed) == ([], [1], [])
    allowed = {t for t in range(len(PIECES)) if mask.bitmask[1, t // 32] >> (t % 32) & 1}
    assert allowed == {PIECES.index(p) for p in ["a", "ab", "abcd", "c", "cd", "12", "34"]
                       + list("0123456789")}


def test_a_compile_that_failed_fails_its_row_alone(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    structured, held, token_ids, num_tokens = held_compile(model_dir, monkeypatch)
    held.set_exception(RuntimeError("out of memory"))
    mask = structured.fill_bitmask(np.array([0]), token_ids, num_tokens)
    assert mask is not None and (mask.deferred, mask.failed, mask.rejections) == ([], [0], {})


def test_the_step_goes_on_while_a_grammar_compiles(
        runner: ModelRunner, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The constrained request reaches its sampling step with its compile held: it gets no
    token and is named deferred, its last position is not counted, and the free request
    decodes step after step. Once the grammar is there, the deferred request recomputes its
    last position and goes on: valid, and the same as without the wait."""
    reference_driver = StepDriver(runner)
    handle = reference_driver.add(PROMPT, max_new_tokens=40, sampling=regex_sampling())
    reference = reference_driver.run()[handle]
    free_driver = StepDriver(runner)
    free_handle = free_driver.add(PROMPT, max_new_tokens=12, stop_at_eos=False)
    free_reference = free_driver.run()[free_handle]

    held: Future[xgr.CompiledGrammar] = Future()
    monkeypatch.setattr(GrammarCache, "get", lambda self, spec: held)
    driver = StepDriver(runner)
    constrained = driver.add(PROMPT, max_new_tokens=40, sampling=regex_sampling())
    free = driver.add(PROMPT, max_new_tokens=12, stop_at_eos=False)
    for step in range(4):
        out = driver.run_step()
        assert unpack_int32(out.deferred_handles).tolist() == [constrained]
        assert unpack_int32(out.handles).tolist() == [free]
        row = runner.input_batch.handle_to_row[constrained]
        assert runner.input_batch.num_tokens[row] == len(PROMPT)
        assert runner.input_batch.num_computed_tokens[row] == len(PROMPT) - 1
    assert len(driver.requests[free].output_ids) == 4
    held.set_result(compiled_regex(model_dir))
    outputs = driver.run()
    assert re.fullmatch(REGEX, text_of(outputs[constrained]))
    assert outputs[constrained] == reference
    assert outputs[free] == free_reference
