"""The engine core's scheduler: requests in, one batch decision per step out.

Style note: this file is on the per-step hot path and is meant to stay small. Keep
`schedule()` an orchestrator over named steps; put a new policy in its own strategy class
(see request_queue.py), not in another branch here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

from services.common.block_hash import BlockHasher
from services.scheduler.core.admission import check_admission, check_fits
from services.scheduler.core.config import SchedulerConfig
from services.scheduler.core.errors import RequestTooLong
from services.scheduler.core.hybrid_kv_cache_manager import create_kv_cache_manager
from services.scheduler.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from services.scheduler.core.kv_connector.connector import SchedulerKVConnector
from services.scheduler.core.kv_connector.loading import LOADING, PrefixLoader
from services.scheduler.core.kv_events import KVCacheEvent
from services.scheduler.core.lora_slots import LoraSlots
from services.scheduler.core.output import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.core.request_queue import create_request_queue
from services.scheduler.core.spec_decode import (
    SpecDecodingStats,
    apply_verification,
    num_drafts_to_schedule,
)
from services.scheduler.core.step_plan import StepPlan
from services.scheduler.core.step_time import StepTimeModel
from services.scheduler.core.step_tokens import advance, forget_worker_row, may_run_ahead
from services.scheduler.core.stop_tokens import append_output_tokens

_INT32_MAX = 2**31 - 1
RUNNING = RequestStatus.RUNNING
# The queued requests whose cached prefixes each step keeps behind newly freed blocks: those
# next in line (deeper ones keep the place their arrival gave them). Bounds the per-step cost.
NUM_WAITING_PREFIXES_KEPT = 8


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic,
                 num_gpu_blocks: int | None = None,
                 kv_connector: SchedulerKVConnector | None = None) -> None:
        self.config = config
        self.clock = clock
        self.kv_connector = kv_connector
        """Loads prefixes from / saves blocks to the kvstore (kv_connector/); None: off."""
        self.block_size = config.block_size
        self._prefix_loader = (PrefixLoader(kv_connector, config.block_size)
                               if kv_connector is not None else None)
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.step_time = StepTimeModel()
        """Fitted from the worker's step times (observe_step): sizes prefill beside decodes."""
        self.prefill_token_cap = config.max_num_batched_tokens
        """The cap the last step with decodes put on its prompt tokens (for /metrics)."""
        self.block_hasher = (BlockHasher(config.block_size, config.hash_algo, config.hash_seed)
                             if config.enable_prefix_caching else None)

        self.waiting = create_request_queue(config.policy)
        self._sort_key = self.waiting.sort_key
        # With priorities, a waiting request may take blocks from a lower-priority running one.
        self._waiting_may_preempt = config.policy == "priority"
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._handle_to_request: dict[int, Request] = {}
        self._next_handle = 0
        self._arrival_order = itertools.count()
        self._num_waiting_tokens = 0
        self._finished_handles: list[int] = []
        self._step = 0
        self.holds_new_requests = False
        """A weight update waits for the requests under way: queued ones that have not started
        keep their place and start after it, on the new weights (preempted ones resume)."""

        self.num_preemptions = 0
        self.spec_decoding_stats = (SpecDecodingStats() if config.num_speculative_tokens
                                    else None)
        self.loras = (LoraSlots(config.max_loras, config.max_cpu_loras) if config.max_loras
                      else None)
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        num_blocks = num_gpu_blocks if num_gpu_blocks is not None else config.num_gpu_blocks
        if num_blocks is None:
            raise ValueError("the number of KV blocks is not known yet (num_gpu_blocks)")
        self.kv_cache_manager = self._make_kv_cache_manager(num_blocks)

    # ==== admission ======================================================================
    def add_request(self, request: Request) -> None:
        """Queues a request. Raises RequestTooLong if it can never run, AdmissionRejected if
        the waiting queue is full right now."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.lora_id and self.loras is None:
            raise ValueError("this engine serves no LoRA adapters (start its worker with "
                             "--enable-lora)")
        self._check_fits(request)
        check_admission(request, self.config, len(self.waiting), self._num_waiting_tokens)
        if self.block_hasher is not None and request.block_hasher is None:
            request.attach_block_hasher(self.block_hasher)
        request.handle = self._new_handle()
        request.arrival_order = next(self._arrival_order)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._handle_to_request[request.handle] = request
        self.waiting.add_request(request)
        self._num_waiting_tokens += request.num_tokens
        self.kv_cache_manager.keep_prefix(request)

    def _get_computed_tokens(self, request: Request) -> tuple[KVCacheBlocks | None, int, int]:
        """Local prefix-cache hits (blocks, tokens), then the tokens the kvstore holds beyond
        them. A request whose KV was loaded already holds its blocks: nothing to look up."""
        if request.num_computed_tokens:
            return None, request.num_computed_tokens, 0
        blocks, num_tokens = self.kv_cache_manager.get_computed_blocks(request)
        if self._prefix_loader is None:
            return blocks, num_tokens, 0
        return blocks, num_tokens, self._prefix_loader.num_external_tokens(request, num_tokens)

    def _check_fits(self, request: Request) -> None:
        check_fits(request, self.max_model_len, self.block_size,
                   self.kv_cache_manager.num_usable_blocks)

    def _new_handle(self) -> int:
        while True:
            handle = self._next_handle
            self._next_handle = handle + 1 if handle < _INT32_MAX else 0
            if handle not in self._handle_to_request:
                return handle

    # ==== schedule =======================================================================
    def schedule(self) -> SchedulerOutput:
        # The one rule (as in vLLM V1): there is no prefill phase and no decode phase. Each
        # request has num_computed_tokens (KV in the cache) and num_tokens (prompt + outputs
        # so far); a step gives each request some of the difference, under one token budget.
        # A decode asks for 1 token (plus the drafts the worker proposed for it, trimmed to
        # the budget: spec_decode.py); a prefill asks for the rest of its prompt, clipped by
        # the budget (chunked prefill) and by long_prefill_token_threshold; prefix-cache hits
        # count as computed. Running requests go first (decodes, then unfinished prefills),
        # then waiting ones in policy order while the budget, max_num_seqs and free blocks
        # last. A running request that cannot get a block preempts the request that deserves
        # it least (possibly itself): its blocks are freed and it recomputes from scratch
        # when it resumes. A step that preempted admits nothing new.
        #
        # Counts move on as the step is built (step_tokens.py): async scheduling builds the
        # next step before this one's tokens are back.
        plan = StepPlan(self.max_num_batched_tokens)
        if self.waiting:
            self.kv_cache_manager.keep_prefixes(self.waiting.head(NUM_WAITING_PREFIXES_KEPT))
        self._schedule_running(plan)
        if not plan.num_preempted:
            self._schedule_waiting(plan)
        output = self._build_output(plan)
        advance(output)
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        # Decodes first, so one long prefill never delays the running streams' next tokens.
        prefills: list[Request] = []
        for request in tuple(self.running):   # a copy: preemption edits self.running
            if request.status is not RUNNING:
                continue                        # preempted earlier in this loop
            if request.num_output_placeholders and not may_run_ahead(request,
                                                                    self.max_model_len):
                continue
            num_new_tokens = (request.num_tokens + request.num_output_placeholders
                              - request.num_computed_tokens)
            if num_new_tokens != 1:
                prefills.append(request)
                continue
            if plan.token_budget == 0:
                return
            num_drafts = num_drafts_to_schedule(request, plan.token_budget, self.max_model_len,
                                                self.config.num_speculative_tokens)
            self._schedule_running_request(
                plan, request, 1 + self.kv_cache_manager.trim_drafts(request, num_drafts))
        self._cap_prefill_beside_decodes(plan)
        threshold = self.long_prefill_token_threshold
        for request in prefills:
            if plan.prefill_budget <= 0:
                return
            if request.status is not RUNNING:
                continue
            num_new_tokens = self.kv_cache_manager.align_prefill(
                request, request.num_computed_tokens, plan.prefill_chunk(
                    request.num_tokens - request.num_computed_tokens, threshold))
            if num_new_tokens > 0 and self._schedule_running_request(plan, request,
                                                                     num_new_tokens):
                plan.take_prefill(request, num_new_tokens)

    def _cap_prefill_beside_decodes(self, plan: StepPlan) -> None:
        """Holds the step's prefill to what keeps its decodes' next tokens within
        max_itl_factor times a decode-only step (never under one block, so prompts move)."""
        num_decode_tokens = sum(plan.running_reqs.values())
        cap = self.step_time.prefill_token_cap(num_decode_tokens, self.config.max_itl_factor)
        if cap is not None:
            plan.prefill_cap = max(cap, self.block_size)
        if num_decode_tokens:
            self.prefill_token_cap = min(plan.prefill_cap, self.max_num_batched_tokens)

    def observe_step(self, output: SchedulerOutput, execute_s: float) -> None:
        """The worker's time for a step this scheduler built."""
        num_prefill_tokens = output.num_prefill_tokens
        self.step_time.observe(output.total_num_scheduled_tokens - num_prefill_tokens,
                               num_prefill_tokens, execute_s)

    def _schedule_running_request(self, plan: StepPlan, request: Request,
                                  num_new_tokens: int) -> bool:
        """False when the request itself was preempted for want of blocks."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                break
            victim = max(self.running, key=self._sort_key)
            self._preempt(victim, plan)
            if victim is request:
                return False
        plan.running_reqs[request] = num_new_tokens
        plan.token_budget -= num_new_tokens
        if new_blocks.blocks:
            plan.new_block_ids[request] = new_blocks.get_block_ids()
        return True

    def _schedule_waiting(self, plan: StepPlan) -> None:
        if not self.waiting:
            return
        loras = self.loras
        active_loras = loras.active(self.requests.values()) if loras is not None else set()
        # Their adapter would exceed max_loras, or a weight update holds them: they keep place.
        skipped: list[Request] = []
        while (self.waiting and plan.prefill_budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting.peek_request()
            if ((loras is not None and not loras.admits(active_loras, request.lora_id))
                    or (self.holds_new_requests and not is_started(request))):
                skipped.append(self.waiting.pop_request())
                continue
            if not self._schedule_waiting_request(plan, request):
                break    # head of line waits for blocks; later ones do not jump it
            if request.lora_id:
                active_loras.add(request.lora_id)
        for request in reversed(skipped):
            self.waiting.prepend_request(request)

    def _schedule_waiting_request(self, plan: StepPlan, request: Request) -> bool:
        kv_cache_manager = self.kv_cache_manager
        threshold = self.long_prefill_token_threshold
        while True:
            computed_blocks, num_computed_tokens, num_external_tokens = (
                self._get_computed_tokens(request))
            # Blocks the kvstore holds are allocated now and loaded before the request runs.
            num_new_tokens = num_external_tokens or kv_cache_manager.align_prefill(
                request, num_computed_tokens, plan.prefill_chunk(
                    request.num_tokens - num_computed_tokens, threshold))
            # (A request with loaded KV counts its computed tokens already.)
            num_new_computed_tokens = num_computed_tokens - request.num_computed_tokens
            if kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks,
                                               num_new_computed_tokens,
                                               delay_cache_blocks=num_external_tokens > 0
                                               ) is not None:
                break
            if not self._preempt_for_waiting(plan, request):
                return False
        assert self.waiting.peek_request() is request
        self.waiting.pop_request()
        if self.kv_connector is not None and request.first_scheduled_time is None:
            self.kv_connector.prefix_reused(request, num_computed_tokens)
        if num_external_tokens:
            assert self._prefix_loader is not None
            self._prefix_loader.start(kv_cache_manager, request, num_computed_tokens,
                                      self.clock())
            return True
        self._num_waiting_tokens -= request.num_tokens
        self.running.append(request)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
            request.num_cached_tokens = num_computed_tokens
        request.status = RUNNING
        request.num_computed_tokens = num_computed_tokens
        plan.new_reqs[request] = num_new_tokens
        plan.token_budget -= num_new_tokens
        plan.take_prefill(request, num_new_tokens)
        return True

    def _preempt_for_waiting(self, plan: StepPlan, request: Request) -> bool:
        """Priority policy: a waiting request preempts the least deserving running one if
        that one deserves strictly less; True if it did."""
        if not self._waiting_may_preempt or not self.running:
            return False
        victim = max(self.running, key=self._sort_key)
        if self._sort_key(victim) <= self._sort_key(request):
            return False
        self._preempt(victim, plan)
        return True

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        """Preemption by recompute: free the victim's blocks and queue it at the front; it is
        sent to the worker again, with every token so far, when it resumes."""
        worker_has_row = victim not in plan.new_reqs   # sent in an earlier step
        plan.unschedule(victim)
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        forget_worker_row(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        plan.num_preempted += 1
        if worker_has_row:
            self._finished_handles.append(victim.handle)
        self.waiting.prepend_request(victim)
        self._num_waiting_tokens += victim.num_tokens

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        get_block_ids = self.kv_cache_manager.get_block_ids
        num_scheduled_tokens: list[int] = []
        request_ids: list[str] = []
        scheduled_requests: list[Request] = [*plan.new_reqs, *plan.running_reqs]
        new_requests = []
        for request, num_tokens in plan.new_reqs.items():
            new_requests.append(NewRequestData(
                request.handle, request.request_id, list(request.all_token_ids),
                request.num_prompt_tokens, get_block_ids(request.request_id),
                request.num_computed_tokens, request.sampling, request.lora,
                request.mm_items))
            if self.loras is not None:
                self.loras.sent(request.lora_id)
            num_scheduled_tokens.append(num_tokens)
            request_ids.append(request.request_id)
        cached = CachedRequestData()
        handles, new_block_ids = cached.handles, cached.new_block_ids
        num_computed_tokens = cached.num_computed_tokens
        plan_new_block_ids = plan.new_block_ids
        for request, num_tokens in plan.running_reqs.items():
            handles.append(request.handle)
            new_block_ids.append(plan_new_block_ids.get(request) or [])
            num_computed_tokens.append(request.num_computed_tokens)
            num_scheduled_tokens.append(num_tokens)
            request_ids.append(request.request_id)
        finished_handles, self._finished_handles = self._finished_handles, []
        step = self._step
        self._step += 1
        output = SchedulerOutput(step, new_requests, cached, num_scheduled_tokens,
                                 self.max_num_batched_tokens - plan.token_budget,
                                 finished_handles, request_ids,
                                 scheduled_requests=scheduled_requests,
                                 num_prefill_tokens=plan.num_prefill_tokens,
                                 state_checkpoints=self.kv_cache_manager.plan_state_checkpoints(
                                     plan.new_reqs, plan.running_reqs))
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_meta(
                [*plan.new_reqs.items(), *plan.running_reqs.items()], get_block_ids,
                self.kv_cache_manager.take_evicted_blocks())
        return output

    # ==== update =========================================================================
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: RunnerOutput) -> list[EngineCoreOutput]:
        """Advances each scheduled request by what it ran, appends sampled tokens, finishes
        requests that hit a stop condition. One output per request that got a token."""
        now = self.clock()
        sampled = runner_output.sampled_by_handle()
        outputs: list[EngineCoreOutput] = []
        if self.kv_connector is not None:
            if runner_output.kv_connector_output is not None:
                self.kv_connector.update_from_output(runner_output.kv_connector_output)
            outputs += self._finish_loads(now)
        num_finished = 0
        sampling = scheduler_output.sampling_handles
        for request in scheduler_output.scheduled_requests:
            if request.status is not RUNNING:
                continue   # ended or preempted after it was scheduled
            handle = request.handle
            if runner_output.rejected and handle in runner_output.rejected:
                # Its own input failed it (a grammar, an adapter, an image).
                request.error_code = "invalid_request"
                request.error = runner_output.rejected[handle]
                outputs.append(self._finish(request, RequestStatus.FINISHED_ERROR, now, []))
                num_finished += 1
                continue
            if handle not in sampling:
                continue   # prefill still partial: nothing sampled
            request.num_output_placeholders -= 1
            token_ids = sampled.get(handle)
            if token_ids is None and handle in runner_output.deferred:
                # Its grammar still compiles on the worker: the next step recomputes the
                # last position (the same KV slot) and samples again; nothing else waits.
                request.num_computed_tokens -= 1
                continue
            if token_ids is None:
                request.error_code = None
                request.error = "the worker returned no token for a complete request"
                outputs.append(self._finish(request, RequestStatus.FINISHED_ERROR, now, []))
                num_finished += 1
                continue
            if self.spec_decoding_stats is not None:   # (never with async scheduling)
                num_drafts = request.num_computed_tokens - request.num_tokens
                if num_drafts:
                    apply_verification(request, num_drafts, len(token_ids),
                                       self.spec_decoding_stats)
            request.num_spec_tokens = runner_output.num_spec_tokens.get(handle, 0)
            request.worker_sampled = True
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            token_ids, status = append_output_tokens(request, token_ids, self.max_model_len)
            if status is None:
                outputs.append(EngineCoreOutput(
                    request.request_id, handle, token_ids, None, None,
                    request.num_prompt_tokens, request.num_cached_tokens,
                    len(request.output_token_ids)))
            else:
                outputs.append(self._finish(request, status, now, token_ids))
                num_finished += 1
        if num_finished:
            self.running = [r for r in self.running if r.status is RUNNING]
        return outputs

    def _finish_loads(self, now: float) -> list[EngineCoreOutput]:
        """Requests whose load ended go back to the front of the queue, or end (failed)."""
        assert self._prefix_loader is not None
        outputs = []
        for request, failed in self._prefix_loader.finish(self.kv_cache_manager, now):
            if failed:
                self._num_waiting_tokens -= request.num_tokens
                outputs.append(self._finish(request, RequestStatus.FINISHED_ERROR, now, []))
            else:
                self.waiting.prepend_request(request)
        return outputs

    def _finish(self, request: Request, status: RequestStatus, now: float,
                new_token_ids: list[int]) -> EngineCoreOutput:
        """Ends a request (the caller takes it out of `running` or `waiting`)."""
        if request.status is RUNNING or request.status is LOADING:
            self._finished_handles.append(request.handle)   # the worker drops its row / load
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)
        request.status = status
        request.finished_time = now
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        del self._handle_to_request[request.handle]
        return EngineCoreOutput(
            request.request_id, request.handle, new_token_ids, status.finish_reason(),
            request.stop_token_id, request.num_prompt_tokens, request.num_cached_tokens,
            len(request.output_token_ids), request)

    # ==== abort / failure ================================================================
    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Finishes the given requests now and frees their blocks; the worker drops their
        rows at the next step. Unknown or finished ids are ignored."""
        assert status.is_finished()
        now = self.clock()
        finished: list[Request] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is not RUNNING:
                self._num_waiting_tokens -= request.num_tokens
            self._finish(request, status, now, [])
            finished.append(request)
        if finished:
            self.running = [r for r in self.running if r.status is RUNNING]
            self.waiting.remove_requests(r for r in finished)
        return finished

    def expire_deadlines(self) -> list[Request]:
        """Ends, with an error, every request whose deadline passed (freeing its blocks)."""
        now = self.clock()
        expired = [r.request_id for r in self.requests.values()
                   if r.deadline is not None and r.deadline <= now]
        finished = self.abort_requests(expired, RequestStatus.FINISHED_ERROR) if expired else []
        for request in finished:
            request.error = "the request's deadline passed before it finished"
            request.error_code = "deadline_exceeded"
        return finished

    def next_deadline(self) -> float | None:
        """The earliest deadline of the requests held, on the scheduler's clock."""
        return min((r.deadline for r in self.requests.values() if r.deadline is not None),
                   default=None)

    def fail_all(self, reason: str) -> list[Request]:
        """Finishes every request with an error (the worker crashed or failed a step). The
        prefix cache is dropped too: the worker's KV contents can no longer be trusted."""
        failed = self.abort_requests(list(self.requests), RequestStatus.FINISHED_ERROR)
        for request in failed:
            request.error = reason
        self.kv_cache_manager.reset_prefix_cache()
        return failed

    def preempt_all(self) -> list[Request]:
        """The worker lost every row (it restarted, or a step's fate is unknown): each running
        request is preempted by recompute and waits, with its tokens so far, to be sent to
        the worker again as a new request. The prefix cache is dropped with the KV it named.
        Returns the preempted requests."""
        if self._prefix_loader is not None:
            for request in self._prefix_loader.drop_loaded(self.kv_cache_manager,
                                                           self.requests.values()):
                self.waiting.prepend_request(request)
        preempted = sorted(self.running, key=self._sort_key, reverse=True)
        for request in preempted:      # latest first: each goes to the front of the queue
            self.kv_cache_manager.free(request)
            request.status = RequestStatus.PREEMPTED
            forget_worker_row(request)
            request.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.prepend_request(request)
            self._num_waiting_tokens += request.num_tokens
        self.running = []
        self._finished_handles.clear()   # the worker holds no rows to drop
        self.kv_cache_manager.reset_prefix_cache()
        return preempted

    def set_num_blocks(self, num_blocks: int) -> list[Request]:
        """A (re)started worker sized its KV pool. Only while no request holds blocks;
        waiting requests that no longer fit fail with an error and are returned."""
        if self.running:
            raise RuntimeError("cannot resize the KV pool while requests are running")
        old = self.kv_cache_manager
        self._collect_prefix_cache_stats()
        self.kv_cache_manager = self._make_kv_cache_manager(num_blocks)
        self.kv_cache_manager.carry_events_from(old)
        too_long = []
        for request in list(self.waiting):
            try:
                self._check_fits(request)
            except RequestTooLong as exc:
                request.error = str(exc)
                too_long.append(request.request_id)
        return self.abort_requests(too_long, RequestStatus.FINISHED_ERROR)

    def _make_kv_cache_manager(self, num_blocks: int) -> KVCacheManager:
        return create_kv_cache_manager(self.config, num_blocks, enable_eviction_records=(
            self.kv_connector is not None and self.kv_connector.saves_on_eviction))

    # ==== queries ========================================================================
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_started_requests(self) -> bool:
        """Whether a request has KV or tokens of the weights serving now (weight updates)."""
        return any(is_started(request) for request in self.requests.values())

    @property
    def num_started_requests(self) -> int:
        return sum(is_started(request) for request in self.requests.values())

    def forget_kv_store_hits(self) -> None:
        """The kvstore's blocks found at admission were named by the weights before an update:
        the queued requests compute theirs."""
        for request in self.waiting:
            request.kv_store_hit = []

    def has_finished_requests(self) -> bool:
        """Rows the worker still holds for ended requests: worth a step even with no work."""
        return bool(self._finished_handles)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        return self._num_waiting_tokens

    @property
    def num_running_prefill_tokens(self) -> int:
        """Prompt tokens of running requests still to prefill (chunked prefill). Counted when
        asked (the heartbeat), not every step."""
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.kv_cache_manager.take_events()

    def make_stats(self) -> SchedulerStats:
        self._collect_prefix_cache_stats()
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_waiting_tokens=self._num_waiting_tokens,
            prefill_token_cap=self.prefill_token_cap,
            spec_decoding=(self.spec_decoding_stats.copy()
                           if self.spec_decoding_stats is not None else None))

    def _collect_prefix_cache_stats(self) -> None:
        prefix = self.kv_cache_manager.take_prefix_cache_stats()
        self._prefix_cache_queries += prefix.queries
        self._prefix_cache_hits += prefix.hits


def is_started(request: Request) -> bool:
    """Scheduled once (it may be preempted since), or holding KV it loaded."""
    return request.first_scheduled_time is not None or request.num_computed_tokens > 0
