"""Property-based scheduler runs: random configs, arrivals and aborts against the fake
worker (or a hybrid model's, restoring states from checkpoints), with and without async
scheduling. Every step keeps the budget and the pool's invariants; every request that runs
to the end produces exactly the greedy reference output (through chunking, prefix hits and
preemptions); an aborted one produces a prefix of it; nothing leaks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core import AdmissionRejected, FinishReason, RequestTooLong
from tests.scheduler.fakes import (ManualClock, Run, make_request, make_scheduler,
                                   reference_output, run_until_done, step)

PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [11, 12, 13, 14, 40, 41, 42, 43], [33] * 10, []]

configs = st.fixed_dictionaries({
    "num_blocks": st.integers(8, 20),
    "block_size": st.sampled_from([2, 4, 4, 8]),
    "max_num_batched_tokens": st.integers(4, 64),
    "max_num_seqs": st.integers(1, 8),
    "long_prefill_token_threshold": st.sampled_from([0, 0, 3, 16]),
    "policy": st.sampled_from(["fcfs", "priority"]),
    "enable_prefix_caching": st.booleans(),
    "max_num_queued_reqs": st.sampled_from([None, None, 4]),
    # A hybrid model's engine: prefix hits only at state checkpoints (a fake recurrent state).
    "num_state_checkpoints": st.sampled_from([0, 0, 0, 1, 4]),
})

arrivals = st.lists(st.fixed_dictionaries({
    "at_step": st.integers(0, 20),
    "prefix": st.sampled_from(PREFIXES),
    # Some prompts repeat whole: a hybrid engine hits them at their end-of-prompt checkpoint.
    "suffix": st.one_of(st.lists(st.integers(1, 60), min_size=1, max_size=6),
                        st.sampled_from([[5], [5, 6, 7, 8, 9]])),
    "max_tokens": st.integers(1, 24),
    "priority": st.integers(0, 2),
    "abort_after": st.one_of(st.none(), st.none(), st.integers(0, 20)),
}), min_size=3, max_size=14)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@settings(max_examples=60, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(config=configs, requests=arrivals)
def test_random_workloads_keep_outputs_exact_and_the_pool_consistent(
        async_scheduling: bool, config: dict, requests: list[dict]) -> None:
    clock = ManualClock()
    scheduler, worker = make_scheduler(clock=clock, max_model_len=64,
                                       async_scheduling=async_scheduling, **config)
    prompts: dict[str, tuple[list[int], int]] = {}
    aborts: dict[int, list[str]] = {}
    run = Run()
    for step_index in range(40):
        clock.advance()
        for i, spec in enumerate(requests):
            if spec["at_step"] != step_index:
                continue
            tokens = spec["prefix"] + spec["suffix"]
            request = make_request(f"r{i}", tokens, spec["max_tokens"],
                                   arrival_time=clock(), priority=spec["priority"])
            try:
                scheduler.add_request(request)
            except (AdmissionRejected, RequestTooLong):
                continue
            prompts[request.request_id] = (tokens, spec["max_tokens"])
            if spec["abort_after"] is not None:
                aborts.setdefault(step_index + spec["abort_after"], []).append(request.request_id)
        scheduler.abort_requests(aborts.pop(step_index, []))
        step(scheduler, worker, run)
    run_until_done(scheduler, worker, run)

    for request_id, (tokens, max_tokens) in prompts.items():
        expected = reference_output(tokens, max_tokens)
        output = run.outputs.get(request_id, [])
        finished = run.finished.get(request_id)
        if finished is not None and finished.finish_reason is FinishReason.LENGTH:
            assert output == expected, request_id
        else:   # aborted
            assert output == expected[:len(output)], request_id
    assert scheduler.num_running == scheduler.num_waiting == 0
    assert scheduler.num_waiting_tokens == 0
    assert scheduler.kv_cache_manager.usage == 0.0
