"""Prefix caching in the scheduler against a fake worker: hits counted and not recomputed,
shared prompt blocks, tenants kept apart, reset, and what a queued request keeps cached
while it waits (no model, no NATS)."""

from __future__ import annotations

from services.scheduler.core import Scheduler
from tests.scheduler.fakes import (FakeWorker, Run, assert_matches_reference, make_request,
                                   make_scheduler, prompt, run_until_done, step)


def test_prefix_hits_are_counted_and_not_recomputed() -> None:
    scheduler, worker = make_scheduler()
    shared = prompt(20)
    scheduler.add_request(make_request("a", shared, max_tokens=3))
    run = run_until_done(scheduler, worker)
    b_prompt = shared[:16] + [1, 2, 3, 4, 5]
    scheduler.add_request(make_request("b", b_prompt, max_tokens=3))
    out = step(scheduler, worker, run)
    assert out.new_requests[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens == [5]
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {"a": (shared, 3), "b": (b_prompt, 3)})
    assert run.finished["b"].num_cached_tokens == 16
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20 + 21, 16)


def test_a_full_prompt_hit_still_runs_its_last_block() -> None:
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", prompt(20), max_tokens=3))
    run = run_until_done(scheduler, worker)
    scheduler.add_request(make_request("same", prompt(20), max_tokens=3))
    # a's outputs are cached too: its 22 computed tokens filled 5 blocks.
    extended = prompt(20) + run.outputs["a"][:3]
    scheduler.add_request(make_request("extended", extended, max_tokens=3))
    out = step(scheduler, worker, run)
    assert out.num_scheduled_tokens_by_id == {"same": 4, "extended": 3}
    assert [new.num_computed_tokens for new in out.new_requests] == [16, 20]
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {"same": (prompt(20), 3), "extended": (extended, 3)})


def test_parallel_samples_share_the_prompt_blocks_in_the_same_step() -> None:
    scheduler, worker = make_scheduler()
    for i in range(3):
        scheduler.add_request(make_request(f"s{i}", prompt(17), max_tokens=4))
    run = Run()
    out = step(scheduler, worker, run)
    assert out.num_scheduled_tokens == [17, 1, 1]
    tables = [new.block_ids for new in out.new_requests]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert len({table[4] for table in tables}) == 3
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63 - 7
    run_until_done(scheduler, worker, run)
    assert len({tuple(tokens) for tokens in run.outputs.values()}) == 1


def test_cache_salt_isolates_tenants() -> None:
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("x1", prompt(12), max_tokens=2, cache_salt="x"))
    run = run_until_done(scheduler, worker)
    scheduler.add_request(make_request("y", prompt(12), max_tokens=2, cache_salt="y"))
    scheduler.add_request(make_request("x2", prompt(12), max_tokens=2, cache_salt="x"))
    scheduler.add_request(make_request("none", prompt(12), max_tokens=2))
    out = step(scheduler, worker, run)
    hits = {new.request_id: new.num_computed_tokens for new in out.new_requests}
    assert hits == {"y": 0, "x2": 8, "none": 0}


def test_skip_prefix_cache_reads_nothing_but_still_caches() -> None:
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", prompt(12), max_tokens=2, skip_prefix_cache=True))
    scheduler.add_request(make_request("b", prompt(12), max_tokens=2, skip_prefix_cache=True))
    run = Run()
    out = step(scheduler, worker, run)
    assert [new.num_computed_tokens for new in out.new_requests] == [0, 0]
    run_until_done(scheduler, worker, run)
    assert scheduler.make_stats().prefix_cache_queries == 0
    scheduler.add_request(make_request("c", prompt(12), max_tokens=2))
    assert step(scheduler, worker, run).new_requests[0].num_computed_tokens == 8


def test_reset_prefix_cache_only_when_idle() -> None:
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", prompt(12), max_tokens=3))
    run = Run()
    step(scheduler, worker, run)
    assert scheduler.reset_prefix_cache() is False
    run_until_done(scheduler, worker, run)
    assert scheduler.reset_prefix_cache() is True
    scheduler.add_request(make_request("b", prompt(12), max_tokens=3))
    assert step(scheduler, worker, run).new_requests[0].num_computed_tokens == 0


HISTORY = prompt(24, seed=1)
NEXT_TURN = HISTORY + [1, 2, 3, 4, 5]


def queue_a_long_prompt_then_the_next_turn(scheduler: Scheduler, worker: FakeWorker, run: Run,
                                           long_prompt: list[int],
                                           ran_before: dict[str, tuple[list[int], int]]) -> None:
    """The long prompt and the next turn of HISTORY arrive together and run; the turn must
    find all of HISTORY still cached."""
    scheduler.add_request(make_request("long", long_prompt, max_tokens=2))
    scheduler.add_request(make_request("turn", NEXT_TURN, max_tokens=2))
    run_until_done(scheduler, worker, run)
    assert run.finished["turn"].num_cached_tokens == 24
    assert_matches_reference(run, {**ran_before, "long": (long_prompt, 2),
                                   "turn": (NEXT_TURN, 2)})


def test_a_queued_request_keeps_its_cached_history_past_idle_caches() -> None:
    # 20 usable blocks of 4 tokens. Two conversations ran and went idle, "old" first, so its
    # cached blocks are the least recently used; then a long prompt and "old"'s next turn
    # arrive together. The long prompt's 13 blocks take the 6 never used and 7 cached ones:
    # by recency alone "old"'s, which its queued turn came back for.
    scheduler, worker = make_scheduler(num_blocks=21)
    scheduler.add_request(make_request("old", HISTORY, max_tokens=2))
    run = run_until_done(scheduler, worker)
    scheduler.add_request(make_request("idle", prompt(24, seed=2), max_tokens=2))
    run_until_done(scheduler, worker, run)
    queue_a_long_prompt_then_the_next_turn(scheduler, worker, run, prompt(52, seed=3), {})


def test_a_queued_request_keeps_its_cached_history_past_caches_freed_while_it_waits() -> None:
    # 20 usable blocks of 4 tokens, one request at a time. "old" ran and went idle (7 cached
    # blocks, 13 never used); "busy" takes 9 of the unused ones. While it runs, a long prompt
    # and "old"'s next turn queue behind it. When "busy" finishes its blocks queue behind
    # "old"'s history; the long prompt's 12 blocks would then take all 4 unused blocks and
    # "old"'s 7 if the queued turn's prefix were not moved behind them again.
    scheduler, worker = make_scheduler(num_blocks=21, max_num_seqs=1)
    scheduler.add_request(make_request("old", HISTORY, max_tokens=2))
    run = run_until_done(scheduler, worker)
    busy_prompt = prompt(32, seed=2)
    scheduler.add_request(make_request("busy", busy_prompt, max_tokens=3))
    step(scheduler, worker, run)
    assert scheduler.num_running == 1
    queue_a_long_prompt_then_the_next_turn(scheduler, worker, run, prompt(44, seed=3),
                                           {"busy": (busy_prompt, 3)})
