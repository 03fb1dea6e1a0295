"""The scheduler service: one per engine. It owns the engine's request queues, block
tables and prefix cache (services/scheduler/core), runs the step loop
(schedule -> execute on the worker -> update) and streams token deltas to tokenizers."""

from __future__ import annotations

import asyncio
import time

from services.common import wire
from services.common.metrics import EngineMetrics
from services.common.packing import unpack_int32
from services.common.service import Service
from services.scheduler.core.errors import AdmissionRejected, RequestTooLong
from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.delta_publisher import DeltaPublisher
from services.scheduler.engine_stats import EngineStats
from services.scheduler.settings import SchedulerSettings
from services.scheduler.step_codec import decode_step_output, encode_step_input
from services.scheduler.worker_link import WorkerGone, WorkerLink

_ABORT_STATUS = {
    wire.FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    wire.FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
    wire.FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


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
        self._reset_worker_rows = True
        self._step_loop: asyncio.Task[None] | None = None

    # ---- lifecycle

    async def setup(self) -> None:
        bus = self.connected_bus
        self.deltas = DeltaPublisher(bus, self.subjects, self.engine_id)
        self.worker = WorkerLink(bus, self.subjects, self.engine_id, self.log,
                                 self.settings.worker_step_timeout_s,
                                 self.settings.worker_heartbeat_timeout_s)
        await self.worker.start()
        await bus.serve(self.subjects.engine_submit(self.engine_id), wire.GenerateRequest,
                        self.on_submit)
        await bus.subscribe(self.subjects.engine_abort(self.engine_id), wire.AbortRequest,
                            self.on_abort)
        await bus.serve(self.subjects.engine_admin(self.engine_id), wire.AdminRequest,
                        self.on_admin)
        self._step_loop = asyncio.create_task(self._run_steps())

    def readiness(self) -> tuple[bool, str]:
        if self.scheduler is None or self.worker is None or not self.worker.is_ready:
            return False, "waiting for the worker"
        stalled_for = time.monotonic() - self._last_progress
        if self.scheduler.has_unfinished_requests() and stalled_for > self.settings.stall_timeout_s:
            return False, f"no step completed for {stalled_for:.0f} s"
        return True, ""

    def fill_heartbeat(self, heartbeat: wire.Heartbeat) -> None:
        heartbeat.engine_id = self.engine_id
        info = wire.EngineInfo(model=self._model_name(),
                               worker_ready=self.worker is not None and self.worker.is_ready)
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
            info.prefix_cache_queries = stats.prefix_cache_queries
            info.prefix_cache_hits = stats.prefix_cache_hits
            info.num_preemptions = stats.num_preemptions
        heartbeat.engine = info

    def _model_name(self) -> str:
        if self.settings.served_model_name:
            return self.settings.served_model_name
        return self.worker.info.model if self.worker is not None and self.worker.info else ""

    async def drain(self) -> None:
        # on_submit refuses new work once `stopping` is set; running requests finish.
        while self.scheduler is not None and self.scheduler.has_unfinished_requests():
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self._step_loop is not None:
            self._step_loop.cancel()

    # ---- requests from gateways and tokenizers

    async def on_submit(self, message: wire.GenerateRequest) -> wire.SubmitReply:
        if self.stopping.is_set():
            return wire.SubmitReply(http_status=503, error="the engine is draining",
                                    error_code="engine_draining", retry_after_s=1.0)
        if self.scheduler is None or self.worker is None or self.worker.info is None:
            return wire.SubmitReply(http_status=503, error="the engine is not ready",
                                    error_code="engine_not_ready", retry_after_s=1.0)
        try:
            request = self._make_request(message)
            self.scheduler.add_request(request)
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
        return wire.SubmitReply(accepted=True)

    def _make_request(self, message: wire.GenerateRequest) -> Request:
        assert self.scheduler is not None and self.worker is not None
        sampling = message.sampling
        return Request(
            message.request_id, unpack_int32(message.prompt_token_ids),
            max_tokens=sampling.max_tokens, min_tokens=sampling.min_tokens,
            stop_token_ids=unpack_int32(sampling.stop_token_ids).tolist(),
            eos_token_ids=self.worker.eos_token_ids, ignore_eos=sampling.ignore_eos,
            priority=message.priority, arrival_time=self.scheduler.clock(),
            cache_salt=message.cache_salt,
            skip_prefix_cache=sampling.prompt_logprobs is not None,
            sampling=sampling, block_hasher=self.scheduler.block_hasher)

    async def on_abort(self, message: wire.AbortRequest) -> None:
        # Applied between steps, never under a step in flight (its blocks are in use).
        status = _ABORT_STATUS.get(message.reason, RequestStatus.FINISHED_ABORTED)
        for request_id in message.request_ids:
            self._pending_aborts[request_id] = status
        self._has_work.set()

    async def on_admin(self, message: wire.AdminRequest) -> wire.AdminReply:
        if message.command == "reset_prefix_cache":
            if self.scheduler is None:
                return wire.AdminReply(ok=False, error="the engine is not ready")
            ok = self.scheduler.reset_prefix_cache()
            return wire.AdminReply(ok=ok, error="" if ok else "blocks are in use; retry when idle")
        return wire.AdminReply(ok=False, error=f"unknown command {message.command!r}")

    # ---- the step loop

    async def _run_steps(self) -> None:
        """Builds the engine state for the current worker and steps until that worker is gone."""
        assert self.worker is not None
        while True:
            info = await self.worker.wait_ready()
            self._build_scheduler(info)
            try:
                await self._step_while_worker_unchanged(info.incarnation)
            except WorkerGone as exc:
                self.log.error("worker lost; failing its in-flight requests", error=str(exc))
            await self._fail_all("the engine's worker failed or restarted; retry the request")

    def _build_scheduler(self, info: wire.WorkerInfo) -> None:
        self.scheduler = Scheduler(self.settings.scheduler_config(info))
        self.stats = EngineStats(self.metrics, self._model_name(), self.engine_id)
        self._reset_worker_rows = True
        kv_tokens = (info.num_blocks - 1) * info.block_size   # block 0 is the null block
        self.log.info("engine ready", num_blocks=info.num_blocks, block_size=info.block_size,
                      kv_cache_tokens=kv_tokens, max_model_len=info.max_model_len,
                      max_concurrency_at_max_len=round(kv_tokens / info.max_model_len, 2))

    async def _step_while_worker_unchanged(self, incarnation: int) -> None:
        assert self.scheduler is not None and self.worker is not None
        self.worker.changed.clear()
        while not self.worker.changed.is_set():
            self._apply_aborts()
            if self.scheduler.has_unfinished_requests():
                await self.step(incarnation)
            else:
                self._last_progress = time.monotonic()
                await self._wait_for_work()

    async def _wait_for_work(self) -> None:
        assert self.worker is not None
        self._has_work.clear()
        work = asyncio.create_task(self._has_work.wait())
        changed = asyncio.create_task(self.worker.changed.wait())
        await asyncio.wait({work, changed}, return_when=asyncio.FIRST_COMPLETED)
        work.cancel()
        changed.cancel()

    async def step(self, incarnation: int) -> None:
        """One engine step: schedule, execute on the worker, update, publish deltas."""
        assert self.scheduler is not None and self.worker is not None
        assert self.deltas is not None and self.stats is not None
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not scheduler_output.finished_handles:
            await self._wait_for_work()  # nothing fits now: wait for a request or an abort
            return
        step_input = encode_step_input(scheduler_output, reset=self._reset_worker_rows)
        call_started = time.perf_counter()
        step_output = await self.worker.execute(step_input, incarnation)
        call_s = time.perf_counter() - call_started
        self._reset_worker_rows = False
        outputs = self.scheduler.update_from_output(
            scheduler_output, decode_step_output(step_output))
        self._last_progress = time.monotonic()
        await self.deltas.publish(outputs, step_output, self.tokenizer_of,
                                  self.request_id_of_handle)
        for output in outputs:
            if output.finished:
                self._forget(output.request_id, output.handle)
        self.stats.on_outputs(outputs, self.scheduler.clock())
        self.stats.on_stats(self.scheduler.make_stats())
        self.stats.on_step_times(time.perf_counter() - started, call_s, step_output.execute_s)

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

    async def _fail_all(self, reason: str) -> None:
        assert self.deltas is not None
        if self.scheduler is None:
            return
        failed = self.scheduler.fail_all(reason)
        await self.deltas.publish_errors(failed, reason, self.tokenizer_of)
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
