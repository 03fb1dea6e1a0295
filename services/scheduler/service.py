"""The scheduler service: one per engine. It owns the engine's request queues, block
tables and prefix cache (services/scheduler/core), runs the step loop
(schedule -> execute on the worker -> update) and streams token deltas to tokenizers."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from services.common import wire, wire_pb
from services.common.logs import request_log_context
from services.common.metrics import EngineMetrics
from services.common.mm_inputs import mm_spans
from services.common.packing import pack_int32, unpack_int32
from services.common.service import Service
from services.scheduler.core.errors import AdmissionRejected, RequestTooLong
from services.scheduler.core.output import SchedulerOutput
from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.delta_publisher import DeltaPublisher
from services.scheduler.engine_stats import EngineStats
from services.scheduler.kv.connector_runtime import KVConnectorRuntime
from services.scheduler.settings import SchedulerSettings
from services.scheduler.sleep_control import SLEEP_COMMANDS, SleepControl
from services.scheduler.weight_updates import WEIGHT_COMMANDS, EnginePause, WeightUpdateControl
from services.scheduler.step_codec import decode_step_output, encode_step_input
from services.scheduler.worker_link import StepFailed, StepReply, WorkerGone, WorkerLink

_MAX_LOSSES_IN_A_ROW = 3
_ABORT_STATUS = {
    wire.FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    wire.FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
    wire.FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True)
class _SentStep:
    """A step on its way to or through the worker."""
    output: SchedulerOutput
    call: asyncio.Task[StepReply]
    started: float   # perf_counter when its scheduling began

    def abandon(self) -> None:
        """Nobody takes its results (the worker is gone or changed): its fate is unknown."""
        self.call.cancel()
        self.call.add_done_callback(_retrieve_exception)


def _retrieve_exception(task: asyncio.Task[StepReply]) -> None:
    # NOTE: an abandoned step that failed first (the worker died under both) must not be
    # logged as "exception never retrieved": the step loop already handled the loss.
    if not task.cancelled():
        task.exception()


class SchedulerService(Service):
    name = "scheduler"

    def __init__(self, settings: SchedulerSettings) -> None:
        super().__init__(settings)
        self.settings: SchedulerSettings = settings
        self.engine_id = settings.engine_id
        self.metrics = EngineMetrics(self.registry)
        self.scheduler: Scheduler | None = None
        self.stats: EngineStats | None = None
        self.worker: WorkerLink | None = None
        self.deltas: DeltaPublisher | None = None
        self.tokenizer_of: dict[str, str] = {}   # request id -> tokenizer instance
        self.request_id_of_handle: dict[int, str] = {}
        self._pending_aborts: dict[str, RequestStatus] = {}
        self._has_work = asyncio.Event()
        self._last_progress = time.monotonic()
        self._num_steps = 0           # completed, for the heartbeat: gateways watch it move
        self._reset_worker_rows = True
        self._losses_in_a_row = 0     # worker restarts with no step completed in between
        self._last_step_done = 0.0    # perf_counter when the last step's result was taken in
        self._last_reply_at = 0.0     # ... when the last step's answer arrived
        self._worker_free_at = 0.0    # ... when the worker answered it (its clock, local channel)
        self.kv: KVConnectorRuntime | None = None   # kvstore loads / saves, KV events
        self.sleep: SleepControl | None = None      # sleep mode's admin commands
        self.weights: WeightUpdateControl | None = None   # weight updates' admin commands
        self._pause = EnginePause(
            self._hold_new_requests,
            lambda: self.scheduler.num_started_requests if self.scheduler is not None else 0,
            self._is_idle_for_update, self._forget_kv, self._on_new_fingerprint)

    # ---- lifecycle

    async def setup(self) -> None:
        bus = self.connected_bus
        self.deltas = DeltaPublisher(bus, self.subjects, self.engine_id)
        self.worker = WorkerLink(bus, self.subjects, self.engine_id, self.log,
                                 self.settings.worker_step_timeout_s,
                                 self.settings.worker_heartbeat_timeout_s,
                                 self.settings.step_transport)
        await self.worker.start(self.background)
        self.kv = KVConnectorRuntime(self.settings, bus, self.subjects, self.instance_id,
                                     self.metrics, self.log)
        await self.kv.start()
        self.sleep = SleepControl(bus, self.subjects, self.engine_id, self.log)
        self.weights = WeightUpdateControl(bus, self.subjects, self.engine_id, self.log)
        # NOTE: parsed by upb: what the worker needs of a request (sampling, adapter,
        # images) then travels in its first step without a betterproto round trip.
        await bus.serve(self.subjects.engine_submit(self.engine_id), wire_pb.GenerateRequest,
                        self.on_submit)
        await bus.subscribe(self.subjects.engine_abort(self.engine_id), wire.AbortRequest,
                            self.on_abort)
        # NOTE: concurrent: a sleep waits for the requests in flight; is_sleeping must not.
        await bus.serve(self.subjects.engine_admin(self.engine_id), wire.AdminRequest,
                        self.on_admin, concurrent=True)
        self.background.spawn(self._run_steps(), name="step loop")

    def readiness(self) -> tuple[bool, str]:
        if self.scheduler is None or self.worker is None or not self.worker.is_ready:
            return False, "waiting for the worker"
        stalled_for = time.monotonic() - self._last_progress
        if self.scheduler.has_unfinished_requests() and stalled_for > self.settings.stall_timeout_s:
            return False, f"no step completed for {stalled_for:.0f} s"
        return True, ""

    def fill_heartbeat(self, heartbeat: wire.Heartbeat) -> None:
        heartbeat.engine_id = self.engine_id
        info = wire.EngineInfo(model=self._model_name(), num_steps=self._num_steps,
                               worker_ready=self.worker is not None and self.worker.is_ready,
                               max_num_seqs=self.settings.max_num_seqs)
        if self.worker is not None and self.worker.info is not None:
            info.max_model_len = self.worker.info.max_model_len
            info.block_size = self.worker.info.block_size
            info.num_blocks = self.worker.info.num_blocks
        if self.scheduler is not None:
            stats = self.scheduler.make_stats()
            info.num_running = stats.num_running
            info.num_waiting = stats.num_waiting
            info.kv_cache_usage = stats.kv_cache_usage
            info.num_waiting_tokens = stats.num_waiting_tokens
            info.num_running_prefill_tokens = self.scheduler.num_running_prefill_tokens
            info.prefix_cache_queries = stats.prefix_cache_queries
            info.prefix_cache_hits = stats.prefix_cache_hits
            info.num_preemptions = stats.num_preemptions
            info.is_sleeping = self.sleep is not None and self.sleep.is_sleeping
            info.weight_version = self.weights.version if self.weights is not None else ""
            if self.scheduler.loras is not None:
                info.max_loras = self.scheduler.loras.max_loras
                info.lora_ids = pack_int32(self.scheduler.loras.held)
        if self.kv is not None:
            info.kv_role = self.kv.kv_role
            (info.external_prefix_cache_queries,
             info.external_prefix_cache_hits) = self.kv.external_prefix_cache_counts()
        heartbeat.engine = info

    def _model_name(self) -> str:
        if self.settings.served_model_name:
            return self.settings.served_model_name
        return self.worker.info.model if self.worker is not None and self.worker.info else ""

    async def drain(self) -> None:
        # on_submit refuses new work once `stopping` is set; running requests finish.
        while self.scheduler is not None and self.scheduler.has_unfinished_requests():
            await asyncio.sleep(0.05)

    async def _until_idle(self) -> None:
        """Until no request is in flight, nor any KV transfer of one (sleep mode)."""
        while self.scheduler is not None and (self.scheduler.has_unfinished_requests()
                                              or self._has_kv_transfers()):
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self.kv is not None:
            await self.kv.close()

    # ---- requests from gateways and tokenizers

    async def on_submit(self, message: wire_pb.GenerateRequest) -> wire.SubmitReply:
        with request_log_context(message.request_id):
            return await self._submit(message)

    async def _submit(self, message: wire_pb.GenerateRequest) -> wire.SubmitReply:
        if self.stopping.is_set():
            return wire.SubmitReply(http_status=503, error="the engine is draining",
                                    error_code="engine_draining", retry_after_s=1.0)
        if self.scheduler is None or self.worker is None or not self.worker.is_ready:
            return wire.SubmitReply(http_status=503, error="the engine is not ready",
                                    error_code="engine_not_ready", retry_after_s=1.0)
        if self.sleep is not None and self.sleep.refuses_requests:
            return self.sleep.refusal()
        try:
            request = self._make_request(message)
            scheduler = self.scheduler
            if self.kv is not None:
                version = self.weights.version if self.weights is not None else ""
                await self.kv.on_admission(scheduler, request)
                if self.scheduler is not scheduler:   # the worker changed meanwhile
                    return wire.SubmitReply(http_status=503, error="the engine is not ready",
                                            error_code="engine_not_ready", retry_after_s=1.0)
                if self.weights is not None and self.weights.version != version:
                    request.kv_store_hit = []   # blocks of the weights before an update
            scheduler.add_request(request)
        except AdmissionRejected as exc:
            if self.stats is not None:
                self.stats.rejections.inc()
            return wire.SubmitReply(http_status=503, error=exc.message,
                                    error_code="queue_full", retry_after_s=exc.retry_after_s)
        except RequestTooLong as exc:
            return wire.SubmitReply(http_status=400, error=str(exc),
                                    error_code="context_length_exceeded")
        except ValueError as exc:
            return wire.SubmitReply(http_status=400, error=str(exc), error_code="invalid_request")
        self.tokenizer_of[message.request_id] = message.tokenizer_id
        self.request_id_of_handle[request.handle] = message.request_id
        self._has_work.set()
        return wire.SubmitReply(accepted=True, scheduler_id=self.instance_id)

    def _make_request(self, message: wire_pb.GenerateRequest) -> Request:
        assert self.scheduler is not None and self.worker is not None
        sampling = message.sampling
        vocab_size = self.worker.info.vocab_size if self.worker.info is not None else 0
        bias_ids = unpack_int32(sampling.logit_bias_token_ids)
        if vocab_size and len(bias_ids) and not 0 <= int(bias_ids.max()) < vocab_size:
            # NOTE: checked here, not on the worker: one bad id would fail the whole step.
            raise ValueError(f"logit_bias token id {int(bias_ids.max())} is outside the "
                             f"vocabulary (0..{vocab_size - 1})")
        request = Request(
            message.request_id, unpack_int32(message.prompt_token_ids),
            max_tokens=sampling.max_tokens, min_tokens=sampling.min_tokens,
            stop_token_ids=unpack_int32(sampling.stop_token_ids).tolist(),
            eos_token_ids=self.worker.eos_token_ids, ignore_eos=sampling.ignore_eos,
            priority=message.priority, arrival_time=self.scheduler.clock(),
            cache_salt=message.cache_salt,
            skip_prefix_cache=sampling.HasField("prompt_logprobs"),
            sampling=sampling, block_hasher=self.scheduler.block_hasher,
            has_grammar=sampling.grammar.kind != wire.GrammarKind.NONE,
            grammar_after_reasoning=bool(sampling.grammar.reasoning.end_token_ids),
            do_remote_decode=message.do_remote_decode,
            lora_id=message.lora.lora_id, lora=message.lora if message.lora.lora_id else None,
            mm_spans=mm_spans(message.mm_items), mm_items=list(message.mm_items) or None)
        if message.deadline_s > 0:
            request.deadline = request.arrival_time + message.deadline_s
        return request

    async def on_abort(self, message: wire.AbortRequest) -> None:
        # Applied between steps, never under a step in flight (its blocks are in use).
        status = _ABORT_STATUS.get(message.reason, RequestStatus.FINISHED_ABORTED)
        for request_id in message.request_ids:
            self._pending_aborts.setdefault(request_id, status)   # the first reason stands
        self._has_work.set()

    async def on_admin(self, message: wire.AdminRequest) -> wire.AdminReply:
        if message.command in SLEEP_COMMANDS and self.sleep is not None:
            if self.scheduler is None or self.worker is None or not self.worker.is_ready:
                return wire.AdminReply(ok=False, error="the engine is not ready", http_status=503)
            return await self.sleep.on_admin(message, self._until_idle, self._forget_kv)
        if message.command in WEIGHT_COMMANDS and self.weights is not None:
            if self.scheduler is None or self.worker is None or not self.worker.is_ready:
                return wire.AdminReply(ok=False, error="the engine is not ready", http_status=503)
            if self.sleep is not None and self.sleep.is_sleeping and message.command != (
                    "weight_version") and "weights" in self.sleep.sleeping_tags:
                return wire.AdminReply(ok=False, http_status=400, error="the engine's weights "
                                       "sleep: POST /wake_up?tags=weights first")
            return await self.weights.on_admin(message, self._pause)
        if message.command == "reset_prefix_cache":
            if self.scheduler is None:
                return wire.AdminReply(ok=False, error="the engine is not ready")
            ok = self.scheduler.reset_prefix_cache()
            return wire.AdminReply(ok=ok, error="" if ok else "blocks are in use; retry when idle")
        return wire.AdminReply(ok=False, error=f"unknown command {message.command!r}")

    def _forget_kv(self) -> bool:
        """The worker dropped its KV cache, or its weights changed: no block holds what its
        hash says any more. False if blocks are still in use (a step's last frees): a weight
        update polls it, so it logs nothing itself."""
        self._reset_worker_rows = True
        return self.scheduler is None or self.scheduler.reset_prefix_cache()

    # ---- weight updates (weight_updates.py): what a commit needs between steps

    def _hold_new_requests(self, hold: bool) -> None:
        if self.scheduler is not None:
            self.scheduler.holds_new_requests = hold
        self._has_work.set()

    def _is_idle_for_update(self) -> bool:
        return self.scheduler is None or not (self.scheduler.has_started_requests()
                                              or self._has_kv_transfers())

    def _on_new_fingerprint(self, kv_fingerprint: str) -> None:
        """The worker's KV blocks are named anew (its weights changed)."""
        if self.worker is None or self.worker.info is None or not kv_fingerprint:
            return   # the KV connector is off
        self.worker.info.kv_fingerprint = kv_fingerprint
        if self.kv is not None:
            self.kv.on_worker_info(self.worker.info)
        if self.scheduler is not None:
            self.scheduler.forget_kv_store_hits()

    # ---- the step loop

    async def _run_steps(self) -> None:
        """Steps on the current worker until it is gone. Its requests then wait, preempted
        by recompute, for a worker to return, and resume there from their tokens so far."""
        assert self.worker is not None
        lost: int | None = None   # the incarnation last lost
        while True:
            info = await self._wait_for_worker()
            if lost is not None and info.incarnation != lost:
                await self._count_restart()
            lost = None
            await self._attach_worker(info)
            if self.weights is not None:
                await self.weights.on_worker_joined(info, self._pause)
            if self.stats is not None:
                self.stats.on_step_transport(self.worker.transport)
            try:
                await self._step_while_worker_unchanged(info.incarnation)
            except StepFailed as exc:
                self.log.error("step failed; failing the engine's requests", error=str(exc))
                await self._fail_all("the engine failed a step; retry the request")
                continue
            except WorkerGone as exc:
                self.log.warning("worker lost; its requests wait for it", error=str(exc))
            await self._send_held_finishes()
            lost = info.incarnation
            self._on_worker_lost()

    async def _count_restart(self) -> None:
        """The worker came back as a new incarnation after a loss: it restarted, maybe
        crashed by a request. NOTE: a request that crashes every worker it meets must not do
        so forever; a loss the same incarnation survives (a NATS restart failing the step
        calls while it lasts) is no crash and is not counted."""
        self._losses_in_a_row += 1
        if self._losses_in_a_row >= _MAX_LOSSES_IN_A_ROW:
            await self._fail_all("the engine's worker failed repeatedly; retry the request")
            self._losses_in_a_row = 0

    async def _wait_for_worker(self) -> wire.WorkerInfo:
        """The worker's info once it is ready. Requests held meanwhile wait at most
        --worker-rejoin-timeout-s, then fail with a retriable error."""
        assert self.worker is not None
        try:
            return await asyncio.wait_for(self.worker.wait_ready(),
                                          self.settings.worker_rejoin_timeout_s)
        except asyncio.TimeoutError:
            await self._fail_all("the engine's worker is gone; retry the request", movable=True)
            return await self.worker.wait_ready()

    async def _attach_worker(self, info: wire.WorkerInfo) -> None:
        if self.sleep is not None:
            self.sleep.on_worker_joined()
        if self.kv is not None:
            self.kv.on_worker_info(info)
        if self.scheduler is None:
            self._build_scheduler(info)
            return
        config = self.scheduler.config
        if ((info.block_size, info.max_model_len, info.max_loras, info.num_state_checkpoints)
                != (config.block_size, config.max_model_len, config.max_loras,
                    config.num_state_checkpoints)):
            await self._fail_all("the engine's worker restarted with another configuration; "
                                 "retry the request")
            self._build_scheduler(info)
            return
        # A new pool (the worker may have sized it anew); requests that no longer fit fail.
        too_long = self.scheduler.set_num_blocks(info.num_blocks)
        assert self.deltas is not None
        await self.deltas.publish_errors(too_long, "the request no longer fits the engine's "
                                         "KV cache", self.tokenizer_of)
        for request in too_long:
            self._forget(request.request_id, request.handle)
        self.log.info("worker joined; resuming requests",
                      num_requests=len(self.scheduler.requests))

    def _on_worker_lost(self) -> None:
        """The worker's rows are gone: preempt every running request (they keep their
        tokens) and have the next step start the worker afresh."""
        self._reset_worker_rows = True
        if self.scheduler is None:
            return
        preempted = self.scheduler.preempt_all()
        if preempted:
            self.log.info("requests preempted until the worker returns", count=len(preempted))
        if self.stats is not None:
            self.stats.on_stats(self.scheduler.make_stats())

    def _build_scheduler(self, info: wire.WorkerInfo) -> None:
        config = self.settings.scheduler_config(info)
        if (info.has_recurrent_state and not info.num_state_checkpoints
                and config.enable_prefix_caching):
            config = replace(config, enable_prefix_caching=False)
            self.log.info("prefix caching is off: the worker's hybrid model keeps a recurrent "
                          "state per sequence, and no state checkpoints for cached prefixes")
        self.scheduler = Scheduler(config, kv_connector=(
            self.kv.make_connector(info) if self.kv is not None else None))
        if self.kv is not None:
            self.kv.attach(self.scheduler, (self._model_name(), self.engine_id))
        self.stats = EngineStats(self.metrics, self._model_name(), self.engine_id)
        self._reset_worker_rows = True
        kv_tokens = (info.num_blocks - 1) * info.block_size   # block 0 is the null block
        self.log.info("engine ready", num_blocks=info.num_blocks, block_size=info.block_size,
                      kv_cache_tokens=kv_tokens, max_model_len=info.max_model_len,
                      max_concurrency_at_max_len=round(kv_tokens / info.max_model_len, 2),
                      async_scheduling=self.settings.runs_async)
        if self.settings.async_scheduling and not self.settings.runs_async:
            self.log.info("async scheduling is off with speculative decoding: a step's drafts "
                          "are known only once the step before it ends")

    async def _step_while_worker_unchanged(self, incarnation: int) -> None:
        """With async scheduling one step stays in flight: the next is scheduled and sent
        before its results are taken in, so the worker never waits for the scheduler."""
        assert self.scheduler is not None and self.worker is not None
        self.worker.changed.clear()
        in_flight: _SentStep | None = None
        try:
            while not self.worker.changed.is_set():
                self._apply_aborts()
                if self._has_steps_to_take():
                    in_flight = await self._step(incarnation, in_flight)
                elif in_flight is not None:
                    await self._take_results(in_flight)
                    in_flight = None
                else:
                    self._last_progress = time.monotonic()
                    await self._wait_for_work()
        finally:
            if in_flight is not None:
                in_flight.abandon()

    def _has_steps_to_take(self) -> bool:
        """Requests to step (none while a weight update holds all there are), or transfers."""
        scheduler = self.scheduler
        assert scheduler is not None
        return (scheduler.has_unfinished_requests() and not (
            scheduler.holds_new_requests and not scheduler.has_started_requests())
        ) or self._has_kv_transfers()

    async def _wait_for_work(self) -> None:
        """Until a request, an abort, a worker change, or the next deadline."""
        assert self.worker is not None
        self._has_work.clear()
        work = asyncio.create_task(self._has_work.wait())
        changed = asyncio.create_task(self.worker.changed.wait())
        deadline = self.scheduler.next_deadline() if self.scheduler is not None else None
        timeout = None if deadline is None else max(0.0, deadline - self.scheduler.clock())
        await asyncio.wait({work, changed}, timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
        work.cancel()
        changed.cancel()

    async def _step(self, incarnation: int, in_flight: _SentStep | None) -> _SentStep | None:
        """Schedules and sends a step, then takes in the results of the one before it (async
        scheduling) or its own. Returns the step left in flight."""
        sent = await self._send_step(incarnation)
        if in_flight is not None:
            try:
                await self._take_results(in_flight)
            except BaseException:
                if sent is not None:
                    sent.abandon()
                raise
        elif sent is None:
            await self._wait_for_work()  # nothing fits now: wait for a request or an abort
        if sent is not None and not self.settings.runs_async:
            await self._take_results(sent)
            return None
        return sent

    async def _send_step(self, incarnation: int) -> _SentStep | None:
        """Schedules a step and sends it to the worker; None when there is nothing to send."""
        assert self.scheduler is not None and self.worker is not None
        started = time.perf_counter()
        await self._expire_deadlines()
        scheduler_output = self.scheduler.schedule()
        if (scheduler_output.is_empty and not scheduler_output.finished_handles
                and not scheduler_output.kv_connector_metadata and not self._has_kv_transfers()):
            return None
        step_input = encode_step_input(scheduler_output, reset=self._reset_worker_rows)
        self._reset_worker_rows = False
        call = asyncio.create_task(self.worker.execute(step_input, incarnation),
                                   name=f"step {scheduler_output.step}")
        return _SentStep(scheduler_output, call, started)

    async def _take_results(self, sent: _SentStep) -> None:
        """Waits for a step's results and applies them: update, KV connector, deltas."""
        assert self.scheduler is not None
        assert self.deltas is not None and self.stats is not None
        reply = await sent.call
        step_output = reply.output
        done = time.perf_counter()
        # NOTE: a step sent while the one before it ran held the worker from that one's end.
        call_s = reply.received_at - max(reply.sent_at, self._last_reply_at)
        step_s = done - max(sent.started, self._last_step_done)
        self._last_step_done, self._last_reply_at = done, reply.received_at
        if (hops := reply.hops(self._worker_free_at, done)) is not None:
            self.stats.on_step_hops(hops)
            self._worker_free_at = step_output.worker_sent_at
        self._losses_in_a_row = 0
        scheduler_output = sent.output
        outputs = self.scheduler.update_from_output(
            scheduler_output, decode_step_output(step_output))
        self.scheduler.observe_step(scheduler_output, step_output.execute_s)
        self._last_progress = time.monotonic()
        self._num_steps += 1
        if self.kv is not None:
            outputs = self.kv.outputs_to_send(self.scheduler, outputs)
            self.kv.after_step(self.scheduler)
        # Counted before clients can see the tokens: /metrics never lags a finished answer.
        self.stats.on_outputs(outputs, self.scheduler.clock())
        self.stats.on_stats(self.scheduler.make_stats())
        await self.deltas.publish(outputs, step_output, self.tokenizer_of,
                                  self.request_id_of_handle)
        for output in outputs:
            if output.finished:
                self._forget(output.request_id, output.handle)
        self.stats.on_step_times(step_s + time.perf_counter() - done, call_s,
                                 step_output.execute_s)

    async def _expire_deadlines(self) -> None:
        """Requests past their deadline end here, before the step that would run them."""
        assert self.scheduler is not None and self.deltas is not None
        expired = self.scheduler.expire_deadlines()
        if not expired:
            return
        await self.deltas.publish_errors(expired, "the request's deadline passed",
                                         self.tokenizer_of)
        for request in expired:
            self._forget(request.request_id, request.handle)
            if self.stats is not None:
                self.stats.on_finished(request)

    def _apply_aborts(self) -> None:
        if not self._pending_aborts or self.scheduler is None:
            return
        by_status: dict[RequestStatus, list[str]] = {}
        for request_id, status in self._pending_aborts.items():
            by_status.setdefault(status, []).append(request_id)
        self._pending_aborts.clear()
        for status, request_ids in by_status.items():
            for request in self.scheduler.abort_requests(request_ids, status):
                self._forget(request.request_id, request.handle)
                if self.stats is not None:
                    self.stats.on_finished(request)
        if self.stats is not None:
            self.stats.on_stats(self.scheduler.make_stats())

    def _has_kv_transfers(self) -> bool:
        """KV loads or producer saves in flight: keep stepping to collect their results."""
        return (self.kv is not None and self.scheduler is not None
                and self.kv.has_work(self.scheduler))

    async def _send_held_finishes(self) -> None:
        """Producer requests waiting for their saves: the worker saving them is gone, so they
        finish now (their consumer recomputes what the store lacks)."""
        if self.kv is None or self.deltas is None or self.stats is None:
            return
        held = self.kv.release_held(self.scheduler)
        if held:
            self.stats.on_outputs(held, time.monotonic())
            await self.deltas.publish(held, wire_pb.StepOutput(), self.tokenizer_of,
                                      self.request_id_of_handle)
            for output in held:
                self._forget(output.request_id, output.handle)

    async def _fail_all(self, reason: str, *, movable: bool = False) -> None:
        assert self.deltas is not None
        if self.scheduler is None:
            return
        await self._send_held_finishes()
        failed = self.scheduler.fail_all(reason)
        await self.deltas.publish_errors(failed, reason, self.tokenizer_of, movable=movable)
        if self.stats is not None:
            for request in failed:
                self.stats.on_finished(request)
        self.tokenizer_of.clear()
        self.request_id_of_handle.clear()
        self.scheduler = None

    def _forget(self, request_id: str, handle: int | None) -> None:
        self.tokenizer_of.pop(request_id, None)
        if handle is not None:
            self.request_id_of_handle.pop(handle, None)
