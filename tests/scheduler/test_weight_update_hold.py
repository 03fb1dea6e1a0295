"""The engine core's side of a weight update (services/scheduler/weight_updates.py): while
`holds_new_requests` is set, requests that never started keep their place in the queue and
requests under way run to their end, preempted ones included, so no request mixes the
weights before and after the swap."""

from __future__ import annotations

from services.scheduler.core import RequestStatus
from tests.scheduler.fakes import (
    Run,
    assert_matches_reference,
    make_request,
    make_scheduler,
    prompt,
    run_until_done,
    step,
)


def test_held_requests_wait_while_the_ones_under_way_finish() -> None:
    scheduler, worker = make_scheduler()
    under_way = make_request("under-way", prompt(6, seed=1), max_tokens=4)
    scheduler.add_request(under_way)
    run = Run()
    step(scheduler, worker, run)
    scheduler.holds_new_requests = True
    held = make_request("held", prompt(6, seed=2), max_tokens=4)
    scheduler.add_request(held)
    assert scheduler.has_started_requests() and scheduler.num_started_requests == 1
    while scheduler.has_started_requests():
        out = step(scheduler, worker, run)
        assert "held" not in out.request_ids
    assert under_way.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert held.status is RequestStatus.WAITING and scheduler.num_waiting == 1
    assert scheduler.reset_prefix_cache()   # nothing holds a block: the swap may happen

    scheduler.holds_new_requests = False
    run_until_done(scheduler, worker, run)
    assert_matches_reference(run, {"under-way": (under_way.prompt_token_ids, 4),
                                   "held": (held.prompt_token_ids, 4)})


def test_a_preempted_request_resumes_while_new_ones_are_held() -> None:
    # 6 usable blocks of 4: three 7-token prompts take 2 each; the third decode step needs a
    # new block per request, so the last arrival is preempted.
    scheduler, worker = make_scheduler(num_blocks=7)
    requests = [make_request(name, prompt(7, seed=i), max_tokens=5, arrival_time=float(i))
                for i, name in enumerate("abc")]
    for request in requests:
        scheduler.add_request(request)
    run = Run()
    for _ in range(3):
        step(scheduler, worker, run)
    assert requests[2].status is RequestStatus.PREEMPTED
    scheduler.holds_new_requests = True
    newcomer = make_request("new", prompt(7, seed=9), max_tokens=5, arrival_time=9.0)
    scheduler.add_request(newcomer)
    while scheduler.has_started_requests():
        assert "new" not in step(scheduler, worker, run).request_ids
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert newcomer.status is RequestStatus.WAITING
