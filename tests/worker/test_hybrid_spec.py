"""Speculative decoding on each hybrid family (tiny random checkpoints, tiny_hybrids.py): the
Mamba2 layers keep a verifying row's state after each of its tokens, and the row's slot is
rolled back to the state after its last accepted token. Greedy output with n-gram and suffix
drafts equals the output without speculation, on prompts where drafts are both accepted and
rejected; the state kept after j of a verify step's tokens equals the state of running exactly
those j tokens; the real scheduler (its prefix caching with state checkpoints and its draft
trimming) driving the runner gives the same two chat turns with and without drafts, the second
restored from a decode checkpoint the first saved; a drafter with layers of its own is refused
at start."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.common import wire_pb
from services.common.packing import pack_float32, pack_int32
from services.scheduler.core import RunnerOutput, SchedulerOutput
from services.scheduler.step_codec import decode_step_output, encode_step_input
from services.common.speculative_config import SpeculativeConfig
from services.worker.models.config import UnsupportedModelError
from services.worker.models.hybrid_lm import HybridForCausalLM
from services.worker.models.mamba2 import Mamba2State, StateBatch
from services.worker.runner.config import RunnerConfig
from services.worker.runner.hybrid_states import copy_token_states
from services.worker.runner.model_runner import ModelRunner
from tests.scheduler.fakes import Run, make_request, make_scheduler, run_until_done
from tests.worker.driver import StepDriver
from tests.worker.tiny_hybrids import HYBRID_FAMILIES

SPECULATIVE = {
    "ngram": SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                               prompt_lookup_max=3),
    "suffix": SpeculativeConfig("suffix", num_speculative_tokens=3,
                                suffix_decoding_max_tree_depth=8),
}


@pytest.fixture(scope="module", params=list(HYBRID_FAMILIES))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"{request.param}-spec")
    HYBRID_FAMILIES[request.param][0](path)
    return path


def _runner(model_dir: Path, speculative: SpeculativeConfig | None = None) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_memory=2**20, max_num_seqs=4,
                                    max_model_len=256, speculative_config=speculative))


def _biased(token_ids: list[int], value: float) -> wire_pb.SamplingParams:
    return wire_pb.SamplingParams(logit_bias_token_ids=pack_int32(token_ids),
                                  logit_bias_values=pack_float32([value] * len(token_ids)))


def _requests() -> list[tuple[list[int], wire_pb.SamplingParams | None]]:
    """A random model copies nothing, so its drafts are all rejected: a logit bias that keeps
    two requests' greedy tokens among a few makes them repeat, drafts are accepted, and which
    of the few comes next still turns on the state (a draft accepted then one rejected)."""
    rng = np.random.default_rng(0)
    return [(rng.integers(3, 256, 20).tolist(), _biased([10, 20, 30], 8.0)),
            (rng.integers(3, 256, 12).tolist(), _biased([10, 20, 30, 40, 50], 6.0)),
            (rng.integers(3, 256, 30).tolist(), None)]


def _generate(model_dir: Path, speculative: SpeculativeConfig | None
              ) -> tuple[dict[int, list[int]], StepDriver]:
    driver = StepDriver(_runner(model_dir, speculative), token_budget=24)
    for tokens, sampling in _requests():
        driver.add(tokens, max_new_tokens=40, sampling=sampling, stop_at_eos=False)
    return driver.run(), driver


@pytest.mark.parametrize("method", list(SPECULATIVE))
def test_greedy_output_with_drafts_equals_output_without(model_dir: Path, method: str) -> None:
    plain, _ = _generate(model_dir, None)
    speculative, driver = _generate(model_dir, SPECULATIVE[method])
    verified = sum(r.num_verified for r in driver.requests.values())
    accepted = sum(r.num_accepted for r in driver.requests.values())
    # Both sides of the rollback ran: drafts kept, and drafts the state had to forget.
    assert 0 < accepted < verified, (accepted, verified)
    assert speculative == plain


class _RunnerWorker:
    """The runner behind the scheduler fakes' worker interface, through the wire codec."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        step = self.runner.execute(encode_step_input(out))
        assert not step.error, step.error
        return decode_step_output(step)


def _two_turns(model_dir: Path, speculative: SpeculativeConfig | None) -> tuple[Run, int, int]:
    """A first turn, then a second that extends it: (the run, drafts verified, accepted)."""
    runner = _runner(model_dir, speculative)
    scheduler, _ = make_scheduler(
        runner.info.num_blocks, block_size=runner.info.block_size, num_state_checkpoints=4,
        num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0)
    worker, run = _RunnerWorker(runner), Run()
    first, sampling = _requests()[0]
    scheduler.add_request(make_request("turn1", first, max_tokens=40, sampling=sampling))
    run_until_done(scheduler, worker, run)    # type: ignore[arg-type]
    second = first + run.outputs["turn1"] + [7, 8, 9]
    scheduler.add_request(make_request("turn2", second, max_tokens=20, sampling=sampling))
    run_until_done(scheduler, worker, run)    # type: ignore[arg-type]
    stats = scheduler.spec_decoding_stats
    return run, (stats.num_draft_tokens if stats else 0), (stats.num_accepted_tokens
                                                           if stats else 0)


def test_the_engine_core_with_drafts_equals_it_without_across_a_checkpoint(model_dir: Path
                                                                           ) -> None:
    """Checkpoints saved at decode boundaries while drafts are verified hold exactly their
    boundary's tokens: the second turn restores one (59 computed tokens: the one at 48)."""
    plain, _, _ = _two_turns(model_dir, None)
    speculative, verified, accepted = _two_turns(model_dir, SPECULATIVE["ngram"])
    assert 0 < accepted < verified, (accepted, verified)
    assert speculative.outputs == plain.outputs
    assert speculative.finished["turn2"].num_cached_tokens == 48


def test_the_state_after_j_verified_tokens_is_the_state_of_running_them(model_dir: Path
                                                                        ) -> None:
    model = _runner(model_dir).model
    assert isinstance(model, HybridForCausalLM)
    mixer = model.mamba_layers[0].mixer
    torch.manual_seed(0)
    hidden_size = mixer.shape.hidden_size
    prompt, verify = torch.randn(10, hidden_size), torch.randn(4, hidden_size)
    state = model.allocate_states(2)[0]
    mixer.forward(prompt, StateBatch((0,), (0, 10), (0,)), state)
    before = Mamba2State(state.conv_states.clone(), state.ssm_states.clone())
    y = mixer.forward(verify, StateBatch((0,), (0, 4), (10,), verify_seqs=(0,)), state)
    kept = state.token_states
    assert kept is not None and kept.ssm_states.shape[:2] == (1, 4)
    for j in range(1, 5):
        exact = Mamba2State(before.conv_states.clone(), before.ssm_states.clone())
        y_exact = mixer.forward(verify[:j], StateBatch((0,), (0, j), (10,)), exact)
        torch.testing.assert_close(y[:j], y_exact, rtol=1e-4, atol=1e-5)
        # The rollback: slot 1 takes the state after token j.
        copy_token_states([state], np.array([0]), np.array([j - 1]), np.array([1]))
        torch.testing.assert_close(state.conv_states[1], exact.conv_states[0])
        torch.testing.assert_close(state.ssm_states[1], exact.ssm_states[0],
                                   rtol=1e-4, atol=1e-5)
    # The verified slot holds all four tokens, which a rollback to one token must undo.
    torch.testing.assert_close(state.ssm_states[0], exact.ssm_states[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(kept.ssm_states[0, 0], kept.ssm_states[0, 3])


@pytest.mark.parametrize("speculative", [
    SpeculativeConfig("draft_model", 3, model="some-draft"),
    SpeculativeConfig("eagle3", 3, model="some-head"),
    SpeculativeConfig("mtp", 2)], ids=lambda spec: spec.method)
def test_drafters_with_layers_of_their_own_are_refused(model_dir: Path,
                                                       speculative: SpeculativeConfig) -> None:
    with pytest.raises(UnsupportedModelError, match=f"method '{speculative.method}'"):
        _runner(model_dir, speculative)
