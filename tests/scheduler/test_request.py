"""Request bookkeeping and the waiting queues."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.block_hash import BlockHasher
from services.scheduler.core import FinishReason, Request, RequestStatus
from services.scheduler.core.request_queue import create_request_queue


def test_block_hashes_grow_with_the_tokens_and_match_the_shared_hasher() -> None:
    hasher = BlockHasher(4, "xxh3_128")
    request = Request("r", np.arange(1, 11, dtype=np.int32), max_tokens=20, arrival_time=0,
                      cache_salt="tenant", lora_id=2, block_hasher=hasher)
    assert request.prompt_token_ids == list(range(1, 11))
    assert all(type(token) is int for token in request.prompt_token_ids)
    assert len(request.block_hashes) == 2
    for token in range(50, 61):
        request.append_output_token_id(token)
        expected = hasher.hash_blocks(request.all_token_ids, "tenant", 2)
        assert request.block_hashes == expected
    assert request.num_tokens == 21 and request.num_output_tokens == 11
    assert len(request.block_hashes) == 5


def test_status_helpers() -> None:
    assert not RequestStatus.PREEMPTED.is_finished()
    assert RequestStatus.FINISHED_ABORTED.is_finished()
    assert RequestStatus.FINISHED_LENGTH_CAPPED.finish_reason() is FinishReason.LENGTH
    assert RequestStatus.RUNNING.finish_reason() is None
    request = Request("r", [1], max_tokens=1, arrival_time=0)
    assert not request.is_finished and request.finish_reason is None
    with pytest.raises(ValueError):
        Request("r", [1], max_tokens=0, arrival_time=0)


def _requests(*specs: tuple[str, int, float]) -> list[Request]:
    requests = []
    for order, (name, priority, arrival) in enumerate(specs):
        request = Request(name, [1], max_tokens=1, priority=priority, arrival_time=arrival)
        request.arrival_order = order
        requests.append(request)
    return requests


def test_fcfs_queue_prepends_preempted_and_removes() -> None:
    queue = create_request_queue("fcfs")
    a, b, c = _requests(("a", 0, 0.0), ("b", 0, 1.0), ("c", 0, 2.0))
    for request in (a, b):
        queue.add_request(request)
    queue.prepend_request(c)
    assert [r.request_id for r in queue] == ["c", "a", "b"]
    queue.remove_requests([a])
    assert queue.pop_request() is c and queue.peek_request() is b and len(queue) == 1


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    queue = create_request_queue("priority")
    a, b, c, d = _requests(("a", 2, 0.0), ("b", 0, 2.0), ("c", 0, 1.0), ("d", 1, 0.5))
    for request in (a, b, c, d):
        queue.add_request(request)
    queue.remove_requests([d])
    assert [queue.pop_request().request_id for _ in range(3)] == ["c", "b", "a"]
    assert not queue
    with pytest.raises(ValueError):
        create_request_queue("lifo")
