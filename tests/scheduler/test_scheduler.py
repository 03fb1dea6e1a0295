"""Deterministic scheduler simulations against a fake worker (no model, no NATS)."""

from __future__ import annotations

import pytest

from services.common import wire_pb
from services.common.packing import pack_int32
from services.scheduler.core import (AdmissionRejected, FinishReason, RequestStatus,
                                     RequestTooLong, RunnerOutput)
from services.scheduler.step_codec import decode_step_output
from tests.scheduler.fakes import (FakeWorker, ManualClock, Run, assert_matches_reference,
                                   make_request, make_scheduler, prompt, reference_output,
                                   run_until_done, step)


# ---- the token budget, chunking, ordering ----------------------------------------------

@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_outputs_match_a_plain_greedy_run_under_a_small_budget(
        enable_prefix_caching: bool) -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4,
                                       enable_prefix_caching=enable_prefix_caching)
    requests = {f"r{i}": (prompt(3 + 5 * i, seed=i % 3), 1 + i) for i in range(8)}
    for request_id, (tokens, max_tokens) in requests.items():
        scheduler.add_request(make_request(request_id, tokens, max_tokens))
    run = run_until_done(scheduler, worker)   # `step` checks the budget every step
    assert_matches_reference(run, requests)
    assert all(out.finish_reason is FinishReason.LENGTH for out in run.finished.values())
    assert max(out.total_num_scheduled_tokens for out in run.steps) == 16


def test_decodes_are_scheduled_before_unfinished_prefills() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=20, long_prefill_token_threshold=10)
    scheduler.add_request(make_request("long", prompt(100), max_tokens=3))
    scheduler.add_request(make_request("short", prompt(10, seed=1), max_tokens=3))
    run = Run()
    assert step(scheduler, worker, run).num_scheduled_tokens_by_id == {"long": 10, "short": 10}
    scheduler.long_prefill_token_threshold = 0   # now the prefill alone could fill the step
    out = step(scheduler, worker, run)
    assert out.num_scheduled_tokens_by_id == {"short": 1, "long": 19}
    assert out.request_ids == ["short", "long"]
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {"long": (prompt(100), 3), "short": (prompt(10, 1), 3)})


def test_a_prefill_larger_than_the_budget_is_chunked() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=32)
    scheduler.add_request(make_request("r", prompt(100), max_tokens=3))
    run = Run()
    outs = [step(scheduler, worker, run) for _ in range(4)]
    assert [out.num_scheduled_tokens for out in outs] == [[32], [32], [32], [4]]
    assert len(outs[0].new_requests) == 1 and outs[0].new_requests[0].num_computed_tokens == 0
    assert [out.cached.num_computed_tokens for out in outs[1:]] == [[32], [64], [96]]
    assert run.outputs == {"r": reference_output(prompt(100), 1)}   # sampled after the last chunk
    assert step(scheduler, worker, run).num_scheduled_tokens == [1]
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {"r": (prompt(100), 3)})


def test_the_scheduler_counts_the_prompt_a_running_request_has_still_to_prefill() -> None:
    """A router sees a long prompt's remaining chunks as pending work, not only the queue."""
    scheduler, worker = make_scheduler(max_num_batched_tokens=32, max_num_seqs=1)
    scheduler.add_request(make_request("long", prompt(100), max_tokens=3))
    scheduler.add_request(make_request("queued", prompt(10, seed=1), max_tokens=3))
    run = Run()
    pending = []
    for _ in range(4):
        step(scheduler, worker, run)
        pending.append((scheduler.num_running_prefill_tokens, scheduler.num_waiting_tokens))
    assert pending == [(68, 10), (36, 10), (4, 10), (0, 10)]


def test_long_prefill_threshold_caps_each_request_per_step() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16)
    scheduler.add_request(make_request("a", prompt(40), max_tokens=2))
    scheduler.add_request(make_request("b", prompt(40, seed=1), max_tokens=2))
    run = Run()
    shares = [step(scheduler, worker, run).num_scheduled_tokens_by_id for _ in range(3)]
    assert shares == [{"a": 16, "b": 16}, {"a": 16, "b": 16}, {"a": 8, "b": 8}]


def test_a_prompt_beside_decodes_is_chunked_to_keep_their_step_within_the_itl_factor() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=64, max_itl_factor=2.0)
    # Steps have cost 10 ms + 2 ms a decode token + 1.5 ms a prompt token: beside 4 decodes
    # (18 ms alone) a step may add 12 prompt tokens.
    for num_decode, num_prefill in [(4, 0), (4, 30), (1, 0), (8, 60), (0, 64)] * 4:
        scheduler.step_time.observe(num_decode, num_prefill,
                                    0.010 + 0.002 * num_decode + 0.0015 * num_prefill)
    for i in range(4):
        scheduler.add_request(make_request(f"s{i}", prompt(5, seed=i), max_tokens=30))
    run = Run()
    first = step(scheduler, worker, run)
    assert first.total_num_scheduled_tokens == 20        # no decodes yet: no cap
    assert first.num_prefill_tokens == 20
    assert scheduler.make_stats().prefill_token_cap == 64     # the budget: nothing capped
    scheduler.add_request(make_request("long", prompt(60, seed=9), max_tokens=3))
    shares = [step(scheduler, worker, run) for _ in range(5)]
    assert [out.num_scheduled_tokens_by_id.get("long") for out in shares] == [12] * 5
    assert [out.num_prefill_tokens for out in shares] == [12] * 5
    assert all(out.total_num_scheduled_tokens == 16 for out in shares)
    assert scheduler.make_stats().prefill_token_cap == 12     # what /metrics shows
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {"long": (prompt(60, seed=9), 3),
                                   **{f"s{i}": (prompt(5, seed=i), 30) for i in range(4)}})


def test_the_itl_cap_never_holds_a_prompt_under_one_block() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=64, max_itl_factor=1.01,
                                       block_size=8)
    for num_decode, num_prefill in [(4, 0), (4, 30), (1, 0), (8, 60)] * 5:
        scheduler.step_time.observe(num_decode, num_prefill,
                                    0.010 + 0.002 * num_decode + 0.0015 * num_prefill)
    scheduler.add_request(make_request("s", prompt(5), max_tokens=30))
    run = Run()
    step(scheduler, worker, run)
    scheduler.add_request(make_request("long", prompt(40, seed=9), max_tokens=3))
    assert step(scheduler, worker, run).num_scheduled_tokens_by_id == {"s": 1, "long": 8}


def test_the_scheduler_learns_its_step_time_from_the_worker() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=32, max_itl_factor=2.0)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", prompt(40, seed=i), max_tokens=20))
    run = Run()
    for _ in range(30):
        out = step(scheduler, worker, run)
        num_decode = out.total_num_scheduled_tokens - out.num_prefill_tokens
        scheduler.observe_step(out, 0.010 + 0.002 * num_decode + 0.0015 * out.num_prefill_tokens)
    assert scheduler.step_time.coefficients() == pytest.approx((0.010, 0.002, 0.0015),
                                                               rel=1e-3)


def test_max_num_seqs_bounds_the_batch() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", prompt(5, seed=i), max_tokens=3))
    run = run_until_done(scheduler, worker)
    assert max(len(out.num_scheduled_tokens) for out in run.steps) == 2
    assert len(run.finished) == 5


# ---- preemption ------------------------------------------------------------------------

@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preempted_requests_resume_with_identical_output(enable_prefix_caching: bool) -> None:
    # 20 usable blocks of 4 tokens; each request grows to 40 tokens (10 blocks).
    scheduler, worker = make_scheduler(num_blocks=21, max_num_batched_tokens=24,
                                       enable_prefix_caching=enable_prefix_caching)
    requests = {f"r{i}": (prompt(10, seed=i), 30) for i in range(4)}
    for request_id, (tokens, max_tokens) in requests.items():
        scheduler.add_request(make_request(request_id, tokens, max_tokens))
    run = run_until_done(scheduler, worker)
    assert_matches_reference(run, requests)
    assert scheduler.num_preemptions > 0
    assert scheduler.make_stats().num_preemptions == scheduler.num_preemptions
    resumed = [new for out in run.steps for new in out.new_requests
               if len(new.token_ids) > new.num_prompt_tokens]
    assert resumed, "a preempted request is re-sent with its outputs so far"
    assert all(new.num_prompt_tokens == 10 for new in resumed)
    dropped = {h for out in run.steps for h in out.finished_handles}
    assert {new.handle for new in resumed} <= dropped


def _three_requests_filling_the_pool(policy: str, priorities: tuple[int, int, int]):
    # 6 usable blocks of 4; three 7-token prompts take 2 blocks each; the third decode step
    # needs a new block per request.
    scheduler, worker = make_scheduler(num_blocks=7, policy=policy)
    requests = {}
    for i, name in enumerate("abc"):
        request = make_request(name, prompt(7, seed=i), max_tokens=5, arrival_time=float(i),
                               priority=priorities[i])
        scheduler.add_request(request)
        requests[name] = request
    return scheduler, worker, requests


def test_fcfs_preempts_the_latest_arrival() -> None:
    scheduler, worker, requests = _three_requests_filling_the_pool("fcfs", (0, 0, 0))
    run = Run()
    outs = [step(scheduler, worker, run) for _ in range(3)]
    assert [out.finished_handles for out in outs] == [[], [], [requests["c"].handle]]
    assert requests["c"].status is RequestStatus.PREEMPTED
    assert requests["c"].num_computed_tokens == 0 and requests["c"].num_preemptions == 1
    assert outs[2].request_ids == ["a", "b"]
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {n: (r.prompt_token_ids, 5) for n, r in requests.items()})


def test_priority_preempts_the_lowest_priority_first() -> None:
    scheduler, worker, requests = _three_requests_filling_the_pool("priority", (1, 0, 0))
    run = Run()
    outs = [step(scheduler, worker, run) for _ in range(3)]
    assert outs[2].finished_handles == [requests["a"].handle]
    assert sorted(outs[2].request_ids) == ["b", "c"]
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {n: (r.prompt_token_ids, 5) for n, r in requests.items()})


def test_a_request_preempts_itself_when_it_is_the_least_deserving() -> None:
    scheduler, worker = make_scheduler(num_blocks=3, max_num_batched_tokens=8)  # 2 blocks
    scheduler.add_request(make_request("a", prompt(3), max_tokens=5))
    run = Run()
    step(scheduler, worker, run)
    scheduler.add_request(make_request("b", prompt(2, seed=1), max_tokens=2, arrival_time=1.0))
    run_until_done(scheduler, worker, run)
    assert scheduler.num_preemptions >= 1
    assert_matches_reference(run, {"a": (prompt(3), 5), "b": (prompt(2, 1), 2)})


def test_priority_waiting_request_preempts_a_lower_priority_running_one() -> None:
    scheduler, worker = make_scheduler(num_blocks=5, policy="priority")   # 4 usable blocks
    low = make_request("low", prompt(8), max_tokens=8, priority=5)
    scheduler.add_request(low)
    run = Run()
    for _ in range(3):
        step(scheduler, worker, run)
    high = make_request("high", prompt(8, seed=1), max_tokens=4, priority=0, arrival_time=1.0)
    scheduler.add_request(high)
    out = step(scheduler, worker, run)
    assert out.finished_handles == [low.handle]
    assert [new.request_id for new in out.new_requests] == ["high"]
    assert low.handle not in out.cached.handles and low.status is RequestStatus.PREEMPTED
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {"low": (prompt(8), 8), "high": (prompt(8, 1), 4)})
    assert list(run.finished) == ["high", "low"]


def test_fcfs_waiting_request_never_preempts() -> None:
    scheduler, worker = make_scheduler(num_blocks=5)
    scheduler.add_request(make_request("first", prompt(8), max_tokens=8, priority=5))
    run = Run()
    for _ in range(3):
        step(scheduler, worker, run)
    scheduler.add_request(make_request("second", prompt(8, 1), max_tokens=4, arrival_time=1.0))
    run_until_done(scheduler, worker, run)
    assert scheduler.num_preemptions == 0
    assert list(run.finished) == ["first", "second"]


# ---- a grammar still compiling on the worker (deferred) --------------------------------

@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_a_deferred_request_recomputes_its_last_position_while_others_run(
        enable_prefix_caching: bool) -> None:
    """The worker defers the constrained request's first sampling three times: each time the
    scheduler rolls it back one position, so the next step recomputes that one position (the
    fake worker checks the KV it reads and that both sides count alike); the other request
    gets a token every step, and both end as without the wait."""
    scheduler, worker = make_scheduler(enable_prefix_caching=enable_prefix_caching)
    requests = {"constrained": (prompt(8), 4), "free": (prompt(6, seed=1), 4)}  # 8: two blocks
    for request_id, (tokens, max_tokens) in requests.items():
        scheduler.add_request(make_request(request_id, tokens, max_tokens))
    constrained = scheduler.get_request("constrained")
    assert constrained is not None and constrained.handle is not None
    worker.num_deferrals[constrained.handle] = 3
    run = Run()
    step(scheduler, worker, run)   # both prefill; no token for the constrained one
    for num_steps in (2, 3, 4):
        assert constrained.num_computed_tokens == 7 and not constrained.output_token_ids
        out = step(scheduler, worker, run)
        assert out.num_scheduled_tokens_by_id["constrained"] == 1
        assert len(run.outputs["free"]) == num_steps
    assert run.outputs["constrained"] == reference_output(prompt(8), 4)[:1]
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, requests)


def test_the_step_codec_carries_deferred_handles() -> None:
    message = wire_pb.StepOutput(handles=pack_int32([1]), sampled_token_ids=pack_int32([7]),
                              deferred_handles=pack_int32([4, 9]))
    output = decode_step_output(message)
    assert (output.handles, output.deferred) == ([1], {4, 9})


# ---- policies and admission --------------------------------------------------------------

@pytest.mark.parametrize("policy, expected", [("priority", ["b", "d", "c", "a"]),
                                              ("fcfs", ["a", "b", "c", "d"])])
def test_waiting_order_follows_the_policy(policy: str, expected: list[str]) -> None:
    scheduler, worker = make_scheduler(max_num_seqs=1, policy=policy)
    for i, (name, priority) in enumerate(zip("abcd", (3, 1, 2, 1))):
        scheduler.add_request(make_request(name, prompt(5, seed=i), max_tokens=2,
                                           priority=priority, arrival_time=float(i)))
    assert [r.request_id for r in scheduler.waiting.head(3)] == expected[:3]
    run = run_until_done(scheduler, worker)
    started = [new.request_id for out in run.steps for new in out.new_requests]
    assert started == expected


def test_admission_limits_on_queued_requests_and_tokens() -> None:
    scheduler, worker = make_scheduler(max_num_queued_reqs=2)
    scheduler.add_request(make_request("a", prompt(5)))
    scheduler.add_request(make_request("b", prompt(5)))
    with pytest.raises(AdmissionRejected) as rejected:
        scheduler.add_request(make_request("c", prompt(5)))
    assert rejected.value.retry_after_s > 0 and "2 requests" in rejected.value.message
    assert scheduler.get_request("c") is None
    step(scheduler, worker, Run())   # both start running: the queue is empty again
    scheduler.add_request(make_request("c", prompt(5)))

    scheduler, _ = make_scheduler(max_num_queued_tokens=20)
    scheduler.add_request(make_request("a", prompt(15)))
    with pytest.raises(AdmissionRejected):
        scheduler.add_request(make_request("b", prompt(10)))
    scheduler.add_request(make_request("c", prompt(5)))
    assert scheduler.num_waiting_tokens == 20 and scheduler.num_waiting == 2

    scheduler, _ = make_scheduler(max_num_queued_tokens=20)
    scheduler.add_request(make_request("big", prompt(30)))   # an empty queue takes any one


def test_requests_that_can_never_run_are_rejected() -> None:
    scheduler, _ = make_scheduler(max_model_len=256)
    with pytest.raises(RequestTooLong, match="maximum context length is 256 tokens"):
        scheduler.add_request(make_request("a", prompt(250), max_tokens=10))
    scheduler, _ = make_scheduler(num_blocks=5)   # 16 tokens of KV
    with pytest.raises(ValueError, match="KV cache"):
        scheduler.add_request(make_request("b", prompt(10), max_tokens=10))
    scheduler.add_request(make_request("c", prompt(10), max_tokens=6))
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(make_request("c", prompt(10), max_tokens=6))
    with pytest.raises(ValueError):
        make_request("d", [], max_tokens=6)


# ---- abort and failure -----------------------------------------------------------------

def test_abort_frees_blocks_at_once_and_drops_the_worker_row_next_step() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=1)
    running = make_request("a", prompt(9), max_tokens=20)
    waiting = make_request("b", prompt(9, seed=1), max_tokens=20)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run = Run()
    step(scheduler, worker, run)
    assert scheduler.kv_cache_manager.usage > 0
    aborted = scheduler.abort_requests(["a", "b", "unknown"])
    assert aborted == [running, waiting]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in aborted)
    assert scheduler.kv_cache_manager.usage == 0
    assert not scheduler.has_unfinished_requests() and scheduler.has_finished_requests()
    assert scheduler.num_waiting == 0 and scheduler.num_waiting_tokens == 0
    out = step(scheduler, worker, run)
    assert out.finished_handles == [running.handle] and out.is_empty
    assert worker.rows == {}


def test_abort_between_schedule_and_update_is_ignored_by_the_update() -> None:
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", prompt(5)))
    scheduler.add_request(make_request("b", prompt(5, seed=1)))
    out = scheduler.schedule()
    runner_output = worker.execute(out)
    scheduler.abort_requests(["a"])
    results = scheduler.update_from_output(out, runner_output)
    assert [r.request_id for r in results] == ["b"]


def test_fail_all_errors_every_request_and_forgets_the_kv_cache() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", prompt(9)))
    scheduler.add_request(make_request("b", prompt(9)))
    step(scheduler, worker, Run())
    failed = scheduler.fail_all("worker lost")
    assert {r.request_id for r in failed} == {"a", "b"}
    assert all(r.status is RequestStatus.FINISHED_ERROR and r.error == "worker lost"
               for r in failed)
    assert scheduler.kv_cache_manager.usage == 0
    assert not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert not scheduler.has_unfinished_requests()


def test_set_num_blocks_rebuilds_the_pool_and_fails_what_no_longer_fits() -> None:
    scheduler, worker = make_scheduler(num_blocks=64)
    scheduler.add_request(make_request("small", prompt(5), max_tokens=3))
    scheduler.add_request(make_request("large", prompt(40), max_tokens=10))
    failed = scheduler.set_num_blocks(5)
    assert [r.request_id for r in failed] == ["large"] and failed[0].error
    run = run_until_done(scheduler, FakeWorker(5, 4))
    assert list(run.finished) == ["small"]


# ---- stop conditions -------------------------------------------------------------------

def counting_model(context: list[int]) -> int:
    return 100 + len(context)   # prompt of 4 -> outputs 104, 105, 106, ...


@pytest.mark.parametrize("kwargs, outputs, reason, stop_token_id", [
    (dict(eos_token_ids=[106]), [104, 105, 106], FinishReason.STOP, None),
    (dict(eos_token_ids=[106], ignore_eos=True), [104, 105, 106, 107, 108],
     FinishReason.LENGTH, None),
    (dict(stop_token_ids=[105], eos_token_ids=[106]), [104, 105], FinishReason.STOP, 105),
    (dict(eos_token_ids=[105, 107], min_tokens=3), [104, 105, 106, 107], FinishReason.STOP, None),
    (dict(stop_token_ids=[105], min_tokens=2), [104, 105], FinishReason.STOP, 105),
    (dict(stop_token_ids=[104], min_tokens=9), [104, 105, 106, 107, 108], FinishReason.LENGTH,
     None),
])
def test_stop_conditions(kwargs: dict, outputs: list[int], reason: FinishReason,
                         stop_token_id: int | None) -> None:
    scheduler, _ = make_scheduler()
    worker = FakeWorker(64, 4, model=counting_model)
    scheduler.add_request(make_request("r", [1, 2, 3, 4], max_tokens=5, **kwargs))
    run = run_until_done(scheduler, worker)
    assert run.outputs["r"] == outputs
    finished = run.finished["r"]
    assert (finished.finish_reason, finished.stop_token_id) == (reason, stop_token_id)
    assert finished.num_output_tokens == len(outputs) and finished.num_prompt_tokens == 4


def test_max_model_len_caps_the_output() -> None:
    scheduler, _ = make_scheduler(max_model_len=12)
    scheduler.add_request(make_request("r", [1, 2, 3, 4], max_tokens=8))
    run = run_until_done(scheduler, FakeWorker(64, 4, model=counting_model))
    assert len(run.outputs["r"]) == 8
    assert run.finished["r"].finish_reason is FinishReason.LENGTH


def test_timestamps_follow_the_injected_clock() -> None:
    clock = ManualClock()
    scheduler, worker = make_scheduler(clock=clock, max_num_batched_tokens=8)
    request = make_request("r", prompt(12), max_tokens=2, arrival_time=0.0)
    scheduler.add_request(request)
    run = Run()
    for _ in range(4):
        clock.advance(1.0)
        step(scheduler, worker, run)
    assert (request.first_scheduled_time, request.first_token_time) == (1.0, 2.0)
    assert (request.last_token_time, request.finished_time) == (3.0, 3.0)
    assert run.finished["r"].finished_request is request


def test_handles_are_unique_and_name_the_worker_rows() -> None:
    scheduler, worker = make_scheduler()
    requests = [make_request(f"r{i}", prompt(3, seed=i), max_tokens=2) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    assert len({r.handle for r in requests}) == 5
    out = scheduler.schedule()
    assert [new.handle for new in out.new_requests] == [r.handle for r in requests]
    results = scheduler.update_from_output(out, RunnerOutput([requests[0].handle], [7]))
    # A complete prefill that got no token is a worker fault: the request fails.
    assert [r.request_id for r in results if r.finish_reason is FinishReason.ERROR] == \
        ["r1", "r2", "r3", "r4"]


def test_a_request_past_its_deadline_ends_with_an_error_and_frees_its_blocks() -> None:
    clock = ManualClock()
    scheduler, worker = make_scheduler(clock=clock, max_num_batched_tokens=8)
    free_at_start = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    late = make_request("late", prompt(12), max_tokens=100, arrival_time=0.0)
    late.deadline = 2.5
    other = make_request("other", prompt(5, seed=1), max_tokens=100, arrival_time=0.0)
    scheduler.add_request(late)
    scheduler.add_request(other)
    assert scheduler.next_deadline() == 2.5
    run = Run()
    for _ in range(2):
        clock.advance(1.0)
        assert scheduler.expire_deadlines() == []
        step(scheduler, worker, run)
    clock.advance(1.0)                        # 3.0: past the deadline
    assert scheduler.expire_deadlines() == [late]
    assert late.status is RequestStatus.FINISHED_ERROR
    assert (late.error_code, scheduler.next_deadline()) == ("deadline_exceeded", None)
    assert [r.request_id for r in scheduler.running] == ["other"]
    scheduler.abort_requests(["other"], RequestStatus.FINISHED_ABORTED)
    step(scheduler, worker, run)              # the worker drops both rows
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_at_start
