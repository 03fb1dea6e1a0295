"""The engine core with speculative decoding, against a fake worker that proposes drafts and
verifies them greedily: budget counting, rollback, stops inside a step's drafts, caching."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import EngineMetrics
from services.scheduler.core import FinishReason, Scheduler, SchedulerConfig, SchedulerStats
from services.scheduler.core.spec_decode import SpecDecodingStats
from services.scheduler.engine_stats import EngineStats
from tests.scheduler.fakes import (ManualClock, Run, check_kv_cache_manager, make_request,
                                   reference_output)
from tests.spec_decode.fake_spec_worker import (SpecFakeWorker,
                                                check_cached_blocks_hold_known_tokens)


def make(num_blocks: int = 64, num_speculative_tokens: int = 3,
         **config) -> tuple[Scheduler, SpecFakeWorker]:
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 256)
    config.setdefault("max_num_batched_tokens", 512)   # what these tests were written against
    config.setdefault("policy", "fcfs")
    # As the settings run it: no async scheduling beside speculative decoding.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=num_blocks,
                                          num_speculative_tokens=num_speculative_tokens,
                                          async_scheduling=False, **config),
                          clock=ManualClock())
    return scheduler, SpecFakeWorker(num_blocks, config["block_size"],
                                     num_speculative_tokens=num_speculative_tokens)


def prompt(length: int, seed: int = 0) -> list[int]:
    return [(seed * 7 + i * 3) % 50 + 10 for i in range(length)]


def step(scheduler: Scheduler, worker: SpecFakeWorker, run: Run) -> None:
    out = scheduler.schedule()
    assert sum(out.num_scheduled_tokens) == out.total_num_scheduled_tokens
    assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    run.steps.append(out)
    for result in scheduler.update_from_output(out, worker.execute(out)):
        run.outputs.setdefault(result.request_id, []).extend(result.new_token_ids)
        if result.finished:
            run.finished[result.request_id] = result
    for request in scheduler.running:   # rejected drafts are never counted as computed
        assert request.num_computed_tokens <= request.num_tokens
    check_kv_cache_manager(scheduler.kv_cache_manager)
    check_cached_blocks_hold_known_tokens(scheduler, worker)


def run_until_done(scheduler: Scheduler, worker: SpecFakeWorker) -> Run:
    run = Run()
    while scheduler.has_unfinished_requests():
        assert len(run.steps) < 2000, "requests did not finish"
        step(scheduler, worker, run)
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks, "blocks leaked"
    return run


@pytest.mark.parametrize("budget,num_blocks", [(64, 64), (9, 64), (64, 14)])
def test_outputs_equal_greedy_decoding_without_drafts(budget: int, num_blocks: int) -> None:
    """Small budgets trim drafts; few blocks preempt requests holding drafts."""
    scheduler, worker = make(num_blocks, max_num_batched_tokens=budget)
    requests = {f"r{i}": (prompt(3 + 4 * i, seed=i % 3), 5 + 3 * i) for i in range(6)}
    for request_id, (tokens, max_tokens) in requests.items():
        scheduler.add_request(make_request(request_id, tokens, max_tokens))
    run = run_until_done(scheduler, worker)
    for request_id, (tokens, max_tokens) in requests.items():
        assert run.outputs[request_id] == reference_output(tokens, max_tokens), request_id
        assert run.finished[request_id].finish_reason is FinishReason.LENGTH
    stats = scheduler.make_stats().spec_decoding
    assert stats is not None and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens   # some were rejected
    if num_blocks == 14:
        assert scheduler.num_preemptions > 0


def test_the_budget_counts_drafts_and_trims_them_not_the_decode() -> None:
    scheduler, worker = make(max_num_batched_tokens=10)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", prompt(3, seed=i), max_tokens=20))
    run = Run()
    step(scheduler, worker, run)            # the prompts: 9 tokens
    assert all(r.num_spec_tokens == 3 for r in scheduler.running)
    step(scheduler, worker, run)
    # 1 + 3 drafts for the first two decodes; the third gets what is left, its token first.
    assert run.steps[-1].num_scheduled_tokens == [4, 4, 2]
    assert run.steps[-1].total_num_scheduled_tokens == 10


def test_rejected_drafts_roll_computed_tokens_back() -> None:
    scheduler, worker = make(max_num_batched_tokens=64)
    scheduler.add_request(make_request("r", prompt(5), max_tokens=40))
    run = Run()
    while scheduler.has_unfinished_requests():
        step(scheduler, worker, run)
        request = scheduler.get_request("r")
        if request is not None:
            # Only accepted drafts and the sampled tokens are the request's; the newest
            # token's KV is computed by the next step.
            assert request.num_computed_tokens == request.num_tokens - 1
    stats = scheduler.make_stats().spec_decoding
    # Every third proposal has only its first draft right (the fake worker's pattern).
    assert stats.num_draft_tokens > stats.num_accepted_tokens > stats.num_drafts
    assert run.outputs["r"] == reference_output(prompt(5), 40)


def test_a_stop_token_inside_the_drafts_ends_the_request_there() -> None:
    expected = reference_output(prompt(4), 30)
    stop = expected[7]
    first = expected.index(stop)
    scheduler, worker = make()
    scheduler.add_request(make_request("r", prompt(4), max_tokens=30, stop_token_ids=[stop]))
    run = run_until_done(scheduler, worker)
    assert run.outputs["r"] == expected[:first + 1]
    assert run.finished["r"].finish_reason is FinishReason.STOP
    assert run.finished["r"].stop_token_id == stop


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 6, 7])
def test_drafts_never_run_past_max_tokens(max_tokens: int) -> None:
    scheduler, worker = make()
    scheduler.add_request(make_request("r", prompt(4), max_tokens=max_tokens))
    run = run_until_done(scheduler, worker)
    assert run.outputs["r"] == reference_output(prompt(4), max_tokens)
    for out in run.steps[1:]:   # each decode leaves room for its bonus token only
        assert sum(out.num_scheduled_tokens) <= max_tokens


def test_drafts_never_run_past_max_model_len() -> None:
    scheduler, worker = make(max_model_len=16)
    scheduler.add_request(make_request("r", prompt(6), max_tokens=10))
    run = run_until_done(scheduler, worker)
    assert run.outputs["r"] == reference_output(prompt(6), 10)
    assert max(len(prompt(6)) - 1 + sum(out.num_scheduled_tokens) for out in run.steps[1:]) <= 16


def test_preemption_drops_the_drafts_the_worker_held() -> None:
    scheduler, worker = make(num_blocks=64)
    scheduler.add_request(make_request("r", prompt(5), max_tokens=20))
    run = Run()
    step(scheduler, worker, run)
    request = scheduler.get_request("r")
    assert request.num_spec_tokens == 3
    scheduler.preempt_all()
    worker.rows.clear()                     # the worker restarted
    worker.drafts.clear()
    assert request.num_spec_tokens == 0
    while scheduler.has_unfinished_requests():
        step(scheduler, worker, run)
    assert run.outputs["r"] == reference_output(prompt(5), 20)


def test_acceptance_counts_by_position() -> None:
    stats = SpecDecodingStats()
    stats.observe(3, 2)
    stats.observe(2, 0)
    stats.observe(4, 4)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 6)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1, 1]


def test_metrics_carry_vllm_names_and_count_each_step_once() -> None:
    registry = CollectorRegistry()
    stats = EngineStats(EngineMetrics(registry), "m", "e")
    spec = SpecDecodingStats()
    for num_draft_tokens, num_accepted in [(3, 2), (3, 3)]:
        spec.observe(num_draft_tokens, num_accepted)
        stats.on_stats(SchedulerStats(1, 0, 0.0, 0, 0, 0, spec_decoding=spec.copy()))
    stats.on_stats(SchedulerStats(1, 0, 0.0, 0, 0, 0, spec_decoding=spec.copy()))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": "e", **labels})

    assert value("vllm:spec_decode_num_drafts_total") == 2
    assert value("vllm:spec_decode_num_draft_tokens_total") == 6
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 5
    assert [value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(3)] == [2, 2, 1]
