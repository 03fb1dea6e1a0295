"""Prefix caching for a hybrid (Mamba2 + attention) engine against a fake worker that keeps a
recurrent state per row: a hit is only as long as the last block boundary with a state
checkpoint, prompt chunks end at the last boundary to take one, decodes keep the latest one
per request (the next chat turn hits it), and a restored state is exactly the hit's prefix
(no model, no NATS)."""

from __future__ import annotations

import pytest

from services.scheduler.core import Scheduler
from services.scheduler.core.hybrid_kv_cache_manager import HybridKVCacheManager
from tests.scheduler.fakes import (FakeHybridWorker, Run, assert_matches_reference,
                                   make_request, make_scheduler, prompt, run_until_done, step)


def make_hybrid(num_blocks: int = 64, num_state_checkpoints: int = 8, **config
                ) -> tuple[Scheduler, FakeHybridWorker]:
    scheduler, worker = make_scheduler(num_blocks, num_state_checkpoints=num_state_checkpoints,
                                       **config)
    assert isinstance(scheduler.kv_cache_manager, HybridKVCacheManager)
    assert isinstance(worker, FakeHybridWorker)
    return scheduler, worker


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_next_turn_restores_the_state_at_the_last_boundary_of_the_first(
        async_scheduling: bool) -> None:
    scheduler, worker = make_hybrid(async_scheduling=async_scheduling)
    first = prompt(10)
    scheduler.add_request(make_request("turn1", first, max_tokens=9))
    run = run_until_done(scheduler, worker)
    # 10 prompt + 9 outputs, 18 computed: checkpoints at 8 (prompt end) and 16 (decode).
    second = first + run.outputs["turn1"] + prompt(5, seed=3)
    scheduler.add_request(make_request("turn2", second, max_tokens=4))
    out = step(scheduler, worker, run)
    assert out.new_requests[0].num_computed_tokens == 16
    assert out.state_checkpoints is not None and out.state_checkpoints.restore_handles
    run_until_done(scheduler, worker, run)
    assert run.finished["turn2"].num_cached_tokens == 16
    assert worker.num_restores == 1
    assert_matches_reference(run, {"turn1": (first, 9), "turn2": (second, 4)})


def test_a_prompt_chunk_ends_at_its_last_boundary_and_a_shared_prompt_hits_it() -> None:
    scheduler, worker = make_hybrid()
    system = prompt(8, seed=1)
    scheduler.add_request(make_request("a", system + [1, 2], max_tokens=2))
    run = Run()
    assert step(scheduler, worker, run).num_scheduled_tokens == [8]
    assert step(scheduler, worker, run).num_scheduled_tokens == [2]
    run_until_done(scheduler, worker, run)
    scheduler.add_request(make_request("b", system + [3, 4, 5], max_tokens=2))
    out = step(scheduler, worker, run)
    assert out.new_requests[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == [3]    # 11 tokens: past 8 no boundary is reached
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {"a": (system + [1, 2], 2), "b": (system + [3, 4, 5], 2)})


def test_a_hit_stops_at_the_last_boundary_with_a_checkpoint() -> None:
    # One slot: the decode's checkpoint at 12 evicts the prompt's at 8, while the attention
    # blocks of both stay cached.
    scheduler, worker = make_hybrid(num_state_checkpoints=1)
    first = prompt(10)
    scheduler.add_request(make_request("a", first, max_tokens=4))
    run = run_until_done(scheduler, worker)
    cached = first + run.outputs["a"]
    scheduler.add_request(make_request("b", cached[:8] + [1, 2, 3], max_tokens=2))
    scheduler.add_request(make_request("c", cached[:12] + [4], max_tokens=2))
    out = step(scheduler, worker, run)
    assert [new.num_computed_tokens for new in out.new_requests] == [0, 12]
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {"b": (cached[:8] + [1, 2, 3], 2),
                                   "c": (cached[:12] + [4], 2)})


def test_preempted_requests_resume_from_checkpoints_and_match_the_reference() -> None:
    # 12 usable blocks of 4 tokens for three requests of 30 tokens: they preempt each other.
    scheduler, worker = make_hybrid(num_blocks=13, num_state_checkpoints=4,
                                    max_num_batched_tokens=8)
    prompts = {f"r{i}": prompt(14, seed=i) for i in range(3)}
    for request_id, tokens in prompts.items():
        scheduler.add_request(make_request(request_id, tokens, max_tokens=16))
    run = run_until_done(scheduler, worker)
    assert scheduler.num_preemptions > 0
    assert worker.num_restores > 0
    assert_matches_reference(run, {rid: (tokens, 16) for rid, tokens in prompts.items()})


def test_checkpoints_stay_bounded_and_reset_with_the_prefix_cache() -> None:
    scheduler, worker = make_hybrid(num_state_checkpoints=3)
    run = Run()
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", prompt(9, seed=i), max_tokens=12))
    run_until_done(scheduler, worker, run)
    manager = scheduler.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager)
    assert len(worker.checkpoints) <= 3
    assert manager.checkpoints.num_free_slots == 3    # all evictable once nothing runs
    assert scheduler.reset_prefix_cache()
    scheduler.add_request(make_request("again", prompt(9, seed=4), max_tokens=2))
    out = step(scheduler, worker, run)
    assert out.new_requests[0].num_computed_tokens == 0


def test_drafts_stop_short_of_each_block_boundary() -> None:
    """A decode's drafts end before the next block boundary, and the step whose own token
    ends at it has none: a checkpoint is saved only from a step without drafts, so it never
    holds a rejected draft nor misses one it was named for."""
    scheduler, _ = make_hybrid(num_speculative_tokens=3)
    manager = scheduler.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager)
    request = make_request("r", prompt(6))
    for num_computed in range(5, 30):
        request.num_computed_tokens = num_computed
        num_drafts = manager.trim_drafts(request, 3)
        end = num_computed + 1 + num_drafts          # the step's tokens end here
        if (num_computed + 1) % 4 == 0:
            assert num_drafts == 0                   # its own token ends the block: a save
        else:
            assert end % 4 != 0 and (end - 1) // 4 == num_computed // 4
            assert num_drafts == min(3, 3 - (num_computed + 1) % 4)   # no shorter than that
