"""Feeds the engine's Prometheus metrics from each step's outputs and finished requests."""

from __future__ import annotations

from services.common.metrics import EngineMetrics
from services.scheduler.core.output import EngineCoreOutput, SchedulerStats
from services.scheduler.core.request import Request
from services.scheduler.core.spec_decode import SpecDecodingStats
from services.scheduler.worker_link import StepHops


class EngineStats:
    def __init__(self, metrics: EngineMetrics, model_name: str, engine_id: str) -> None:
        labels = (model_name, engine_id)
        # Label children resolved once: .labels() costs microseconds on the per-step path.
        self.running = metrics.num_requests_running.labels(*labels)
        self.waiting = metrics.num_requests_waiting.labels(*labels)
        self.kv_usage = metrics.kv_cache_usage_perc.labels(*labels)
        self.prefill_cap = metrics.prefill_token_cap.labels(*labels)
        self.prefix_queries = metrics.prefix_cache_queries.labels(*labels)
        self.prefix_hits = metrics.prefix_cache_hits.labels(*labels)
        self.preemptions = metrics.num_preemptions.labels(*labels)
        self.prompt_tokens = metrics.prompt_tokens.labels(*labels)
        self.generation_tokens = metrics.generation_tokens.labels(*labels)
        self.ttft = metrics.time_to_first_token.labels(*labels)
        self.itl = metrics.inter_token_latency.labels(*labels)
        self.e2e = metrics.e2e_request_latency.labels(*labels)
        self.queue_time = metrics.request_queue_time.labels(*labels)
        self.prefill_time = metrics.request_prefill_time.labels(*labels)
        self.decode_time = metrics.request_decode_time.labels(*labels)
        self.step_time = metrics.step_time.labels(*labels)
        self.schedule_time = metrics.schedule_time.labels(*labels)
        self.worker_call_time = metrics.worker_call_time.labels(*labels)
        self.worker_execute_time = metrics.worker_execute_time.labels(*labels)
        self.messaging_time = metrics.step_messaging_time.labels(*labels)
        self._hop_times = {hop: metrics.step_hop_time.labels(*labels, hop)
                           for hop in StepHops.__dataclass_fields__}
        self._step_transport = metrics.worker_step_transport
        self.rejections = metrics.admission_rejections.labels(*labels)
        self._success = metrics.request_success
        self.spec_drafts = metrics.spec_decode_num_drafts.labels(*labels)
        self.spec_draft_tokens = metrics.spec_decode_num_draft_tokens.labels(*labels)
        self.spec_accepted_tokens = metrics.spec_decode_num_accepted_tokens.labels(*labels)
        self._spec_accepted_per_pos = metrics.spec_decode_num_accepted_tokens_per_pos
        self._seen_spec = SpecDecodingStats()
        self._labels = labels
        self._last_token_at: dict[str, float] = {}
        self._seen = SchedulerStats(0, 0, 0.0, 0, 0, 0)

    def on_outputs(self, outputs: list[EngineCoreOutput], now: float) -> None:
        num_tokens = 0
        last = self._last_token_at
        for out in outputs:
            num_tokens += len(out.new_token_ids)
            previous = last.get(out.request_id)
            if previous is not None:
                self.itl.observe(now - previous)
            if out.finish_reason is None:
                last[out.request_id] = now
            else:
                last.pop(out.request_id, None)
                if out.finished_request is not None:
                    self.on_finished(out.finished_request)
        if num_tokens:
            self.generation_tokens.inc(num_tokens)

    def on_finished(self, request: Request) -> None:
        self._last_token_at.pop(request.request_id, None)
        reason = request.finish_reason
        self._success.labels(*self._labels, str(reason) if reason else "unknown").inc()
        self.prompt_tokens.inc(request.num_prompt_tokens)
        end = request.finished_time
        if end is None:
            return
        self.e2e.observe(end - request.arrival_time)
        if request.first_scheduled_time is not None:
            self.queue_time.observe(request.first_scheduled_time - request.arrival_time)
            if request.first_token_time is not None:
                self.prefill_time.observe(request.first_token_time - request.first_scheduled_time)
        if request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - request.arrival_time)
            if request.last_token_time is not None:
                self.decode_time.observe(request.last_token_time - request.first_token_time)

    def on_stats(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefill_cap.set(stats.prefill_token_cap)
        seen = self._seen
        self.prefix_queries.inc(max(0, stats.prefix_cache_queries - seen.prefix_cache_queries))
        self.prefix_hits.inc(max(0, stats.prefix_cache_hits - seen.prefix_cache_hits))
        self.preemptions.inc(max(0, stats.num_preemptions - seen.num_preemptions))
        self._seen = stats
        if stats.spec_decoding is not None:
            self._on_spec_decoding(stats.spec_decoding)

    def _on_spec_decoding(self, spec: SpecDecodingStats) -> None:
        seen = self._seen_spec
        if spec.num_drafts == seen.num_drafts:
            return
        self.spec_drafts.inc(spec.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens - seen.num_accepted_tokens)
        seen_per_pos = seen.num_accepted_tokens_per_pos
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            previous = seen_per_pos[position] if position < len(seen_per_pos) else 0
            self._spec_accepted_per_pos.labels(*self._labels, str(position)).inc(
                count - previous)
        self._seen_spec = spec

    def on_step_transport(self, transport: str) -> None:
        for name in ("local", "nats"):
            self._step_transport.labels(*self._labels, name).set(int(name == transport))

    def on_step_times(self, step_s: float, worker_call_s: float, execute_s: float) -> None:
        self.step_time.observe(step_s)
        self.worker_call_time.observe(worker_call_s)
        self.worker_execute_time.observe(execute_s)
        self.messaging_time.observe(max(0.0, worker_call_s - execute_s))
        self.schedule_time.observe(max(0.0, step_s - worker_call_s))

    def on_step_hops(self, hops: StepHops) -> None:
        for hop, histogram in self._hop_times.items():
            histogram.observe(getattr(hops, hop))
