"""Async scheduling against the fake worker: step N+1 is built and run before the scheduler
sees step N's tokens. Outputs stay exactly the greedy reference, no request runs past its
end, and a request whose grammar may still be compiling waits for its token."""

from __future__ import annotations

import pytest

from services.scheduler.core import FinishReason, SchedulerConfig
from services.scheduler.settings import SchedulerSettings
from tests.scheduler.fakes import (Run, make_request, make_scheduler, reference_output,
                                   run_until_done, step)

PROMPTS = {"a": [3, 4, 5, 6, 7], "b": [9, 8, 7, 6, 5, 4, 3, 2, 1, 12, 13], "c": [20, 21]}


def test_each_step_is_built_before_the_last_ones_tokens_are_back() -> None:
    scheduler, worker = make_scheduler(async_scheduling=True)
    for request_id, prompt in PROMPTS.items():
        scheduler.add_request(make_request(request_id, prompt, max_tokens=10))
    run = run_until_done(scheduler, worker)
    for request_id, prompt in PROMPTS.items():
        assert run.outputs[request_id] == reference_output(prompt, 10)
        assert run.finished[request_id].finish_reason is FinishReason.LENGTH
    # Every request decoded in back-to-back steps: the scheduler never skipped a step to
    # wait for a token (the fake worker asserts it was handed consistent computed counts).
    steps_with = {rid: [i for i, out in enumerate(run.steps) if rid in out.request_ids]
                  for rid in PROMPTS}
    for indices in steps_with.values():
        assert indices == list(range(indices[0], indices[-1] + 1))
    # Prompts fit one step, then 9 decodes: max_tokens stops the scheduling, not a wasted step.
    assert all(len(indices) == 10 for indices in steps_with.values())


def test_a_stop_token_ends_the_output_there_though_one_more_step_ran() -> None:
    prompt = PROMPTS["a"]
    reference = reference_output(prompt, 20)
    stop = reference[4]
    assert stop not in reference[:4]
    scheduler, worker = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("a", prompt, max_tokens=20, stop_token_ids=[stop]))
    run = run_until_done(scheduler, worker)
    assert run.outputs["a"] == reference[:5]
    assert run.finished["a"].finish_reason is FinishReason.STOP
    assert sum("a" in out.request_ids for out in run.steps) == 6   # one step past the stop
    assert scheduler.has_finished_requests()   # the next step drops its worker row


def test_a_constrained_request_is_not_run_ahead_until_the_worker_sampled_it() -> None:
    scheduler, worker = make_scheduler(async_scheduling=True)
    prompt = PROMPTS["b"]
    scheduler.add_request(make_request("g", prompt, max_tokens=6, has_grammar=True))
    scheduler.add_request(make_request("free", PROMPTS["c"], max_tokens=6))
    handle = scheduler.requests["g"].handle
    worker.num_deferrals[handle] = 2   # its grammar compiles over two sampling steps
    run = run_until_done(scheduler, worker)
    assert run.outputs["g"] == reference_output(prompt, 6)
    assert run.outputs["free"] == reference_output(PROMPTS["c"], 6)
    scheduled = [i for i, out in enumerate(run.steps) if "g" in out.request_ids]
    # Its prefill, two deferred samples and its first token each wait for their result (a
    # step without it), then it runs back to back.
    assert scheduled[:4] == [0, 2, 4, 6]
    assert scheduled[3:] == list(range(6, 6 + len(scheduled) - 3))


def test_an_abort_while_a_step_is_in_flight_drops_its_tokens() -> None:
    scheduler, worker = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("a", PROMPTS["a"], max_tokens=30))
    scheduler.add_request(make_request("b", PROMPTS["b"], max_tokens=8))
    run = Run()
    for _ in range(4):
        step(scheduler, worker, run)
    assert run.in_flight is not None and "a" in run.in_flight[0].request_ids
    scheduler.abort_requests(["a"])
    run_until_done(scheduler, worker, run)
    # Steps 0-3 each sampled for it; the token of step 3, in flight, never comes out.
    assert run.outputs["a"] == reference_output(PROMPTS["a"], 30)[:3]
    assert "a" not in scheduler.requests
    assert run.outputs["b"] == reference_output(PROMPTS["b"], 8)


def test_preemption_of_a_request_in_flight_recomputes_it_exactly() -> None:
    # 9 usable blocks of 4 tokens: two growing requests cannot both fit.
    scheduler, worker = make_scheduler(num_blocks=10, async_scheduling=True,
                                       max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", PROMPTS["a"], max_tokens=16))
    scheduler.add_request(make_request("b", PROMPTS["b"], max_tokens=14))
    run = run_until_done(scheduler, worker)
    assert scheduler.num_preemptions > 0
    assert run.outputs["a"] == reference_output(PROMPTS["a"], 16)
    assert run.outputs["b"] == reference_output(PROMPTS["b"], 14)


def test_async_scheduling_refuses_speculative_decoding() -> None:
    with pytest.raises(ValueError, match="speculative"):
        SchedulerConfig(async_scheduling=True, num_speculative_tokens=3)


def test_the_service_schedules_ahead_by_default_unless_it_speculates() -> None:
    assert SchedulerSettings().runs_async
    assert not SchedulerSettings(async_scheduling=False).runs_async
    speculating = SchedulerSettings(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert speculating.async_scheduling and not speculating.runs_async
