"""The scheduler's side of prefixes loaded from the kvstore: a request waiting while the
worker loads its blocks, and what becomes of it when the load ends or the worker loses its KV.

Owned by the Scheduler when the KV connector is on. The scheduler keeps its queues and
counts: these methods change the requests they are given and say which of them go back to
the waiting queue (or fail), never touching the scheduler's state themselves.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.core.kv_cache_manager import KVCacheManager
from services.scheduler.core.kv_connector.connector import SchedulerKVConnector
from services.scheduler.core.request import Request, RequestStatus

LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS


class PrefixLoader:
    def __init__(self, connector: SchedulerKVConnector, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size

    def num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Prompt tokens the kvstore holds beyond the `num_local_tokens` cached here."""
        return self.connector.get_num_new_matched_tokens(request, num_local_tokens)

    def start(self, kv_cache_manager: KVCacheManager, request: Request, num_local_tokens: int,
              now: float) -> None:
        """The request waits (still counted as waiting) while the worker loads its blocks
        after the local hits; `finish` hands it back."""
        request.status = LOADING
        request.num_computed_tokens = num_local_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        block_ids = kv_cache_manager.get_block_ids(request.request_id)
        self.connector.start_load(request, num_local_tokens,
                                  block_ids[num_local_tokens // self.block_size:], now)

    def finish(self, kv_cache_manager: KVCacheManager, now: float
               ) -> list[tuple[Request, bool]]:
        """Requests whose load ended, in order, each with whether it failed. One that did not
        fail is WAITING again, holding its blocks: computed up to the blocks that arrived
        intact (the rest is recomputed). One that failed, under the fail policy, carries its
        error; the caller ends it."""
        ended = []
        for request, num_local, num_loaded, failed in self.connector.take_load_results(now):
            if failed and self.connector.fails_requests_on_load_failure:
                request.error = "loading the prompt's KV cache from the kvstore failed"
                ended.append((request, True))
                continue
            request.num_computed_tokens = num_local + num_loaded
            request.num_cached_tokens = request.num_computed_tokens
            if request.num_computed_tokens:
                kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            else:
                kv_cache_manager.free(request)   # nothing usable: start afresh
            request.status = RequestStatus.WAITING
            ended.append((request, False))
        return ended

    def drop_loaded(self, kv_cache_manager: KVCacheManager, requests: Iterable[Request]
                    ) -> list[Request]:
        """The worker lost its KV: loads in flight and KV loaded for waiting requests are
        gone, so those requests start afresh. Returns the ones that were loading, WAITING
        again, for the caller to queue."""
        requeued = []
        for request in requests:
            if request.status is LOADING or (request.status is RequestStatus.WAITING
                                             and request.num_computed_tokens):
                self.connector.request_finished(request)
                kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                if request.status is LOADING:
                    request.status = RequestStatus.WAITING
                    requeued.append(request)
        return requeued
