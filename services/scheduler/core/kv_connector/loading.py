"""The scheduler's side of prefixes loaded from the kvstore: which prompt tokens are cached
locally or remotely, a request waiting while the worker loads its blocks, and what becomes
of it when the load ends or the worker loses its KV."""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from services.scheduler.core.kv_connector.connector import SchedulerKVConnector
from services.scheduler.core.output import EngineCoreOutput
from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.core.request_queue import RequestQueue

LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS


class KVLoading:
    """Mixed into Scheduler (scheduler.py), whose state these methods share."""

    kv_connector: SchedulerKVConnector | None
    kv_cache_manager: KVCacheManager
    block_size: int
    clock: Callable[[], float]
    waiting: RequestQueue
    requests: dict[str, Request]
    _num_waiting_tokens: int
    _finish: Callable[..., EngineCoreOutput]

    def _get_computed_tokens(self, request: Request) -> tuple[KVCacheBlocks | None, int, int]:
        """Local prefix-cache hits (blocks, tokens), then the tokens the kvstore holds beyond
        them. A request whose KV was loaded already holds its blocks: nothing to look up."""
        if request.num_computed_tokens:
            return None, request.num_computed_tokens, 0
        blocks, num_tokens = self.kv_cache_manager.get_computed_blocks(request)
        if self.kv_connector is None:
            return blocks, num_tokens, 0
        return blocks, num_tokens, self.kv_connector.get_num_new_matched_tokens(request,
                                                                                num_tokens)

    def _start_loading(self, request: Request, num_local_tokens: int) -> None:
        """The request waits (still counted as waiting) while the worker loads its blocks
        after the local hits; `_finish_loads` puts it back in the queue."""
        assert self.kv_connector is not None
        request.status = LOADING
        request.num_computed_tokens = num_local_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        self.kv_connector.start_load(request, num_local_tokens,
                                     block_ids[num_local_tokens // self.block_size:],
                                     self.clock())

    def _finish_loads(self, now: float) -> list[EngineCoreOutput]:
        """Requests whose load ended go back to the queue holding their blocks: computed up
        to the blocks that arrived intact (the rest is recomputed), or failed, per policy."""
        assert self.kv_connector is not None
        outputs = []
        for request, num_local, num_loaded, failed in self.kv_connector.take_load_results(now):
            if failed and self.kv_connector.fails_requests_on_load_failure:
                request.error = "loading the prompt's KV cache from the kvstore failed"
                self._num_waiting_tokens -= request.num_tokens
                outputs.append(self._finish(request, RequestStatus.FINISHED_ERROR, now, []))
                continue
            request.num_computed_tokens = num_local + num_loaded
            request.num_cached_tokens = request.num_computed_tokens
            if request.num_computed_tokens:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            else:
                self.kv_cache_manager.free(request)   # nothing usable: start afresh
            request.status = RequestStatus.WAITING
            self.waiting.prepend_request(request)
        return outputs

    def _drop_loaded_kv(self) -> None:
        """The worker lost its KV: loads in flight and KV loaded for waiting requests are gone,
        so those requests start afresh."""
        assert self.kv_connector is not None
        for request in self.requests.values():
            if request.status is LOADING or (request.status is RequestStatus.WAITING
                                             and request.num_computed_tokens):
                self.kv_connector.request_finished(request)
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                if request.status is LOADING:
                    request.status = RequestStatus.WAITING
                    self.waiting.prepend_request(request)
