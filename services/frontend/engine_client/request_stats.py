"""Per-request timing at the gateway: metrics, and one structured log line per finished
choice with where its time went (tokenize, queue, prefill, decode, detokenize)."""

from __future__ import annotations

import time

import structlog
from prometheus_client import Histogram

from services.common import wire
from services.common.metrics import GatewayMetrics

log = structlog.get_logger("gateway.requests")

_REASONS = {wire.FinishReason.STOP: "stop", wire.FinishReason.LENGTH: "length",
            wire.FinishReason.ABORT: "abort", wire.FinishReason.ERROR: "error"}


class RequestTimer:
    """Times one HTTP request's choices from arrival at the gateway."""

    def __init__(self, metrics: GatewayMetrics, model: str, request_id: str) -> None:
        self._metrics = metrics
        self._model = model
        self.request_id = request_id
        self.arrived = time.perf_counter()
        self.tokenize_s = 0.0
        self.key_id = ""    # the API key's id (a hash: never the key), when keys are on
        self._route: dict[str, object] = {}   # why the router chose the engine, for the log
        self._first_output: dict[int, float] = {}  # choice index -> time of its first output
        self._last_output: dict[int, float] = {}   # choice index -> time of its last output
        # engine id -> its inter-token latency series: looked up once, not on every token
        self._inter_token_latency: dict[str, Histogram] = {}

    def tokenized(self, seconds: float) -> None:
        self.tokenize_s = seconds
        self._metrics.tokenize_time.labels(self._model).observe(seconds)

    def routed(self, reason: str, num_predicted_cached_tokens: int, session_id: str) -> None:
        """The router's decision (kv_overlap, least_loaded, session, ...), logged with the
        request's end beside what the engine actually found cached."""
        self._route = {"route": reason, "predicted_cached_tokens": num_predicted_cached_tokens,
                       "session": session_id or None}

    def on_output(self, index: int, num_new_tokens: int, engine_id: str) -> None:
        """`engine_id`: the engine the choice runs on (it labels vLLM's series)."""
        if not num_new_tokens:
            return
        now = time.perf_counter()
        previous = self._last_output.get(index)
        if previous is None:
            self._first_output[index] = now
            self._metrics.time_to_first_token.labels(self._model, engine_id).observe(
                now - self.arrived)
        else:
            series = self._inter_token_latency.get(engine_id)
            if series is None:
                series = self._metrics.inter_token_latency.labels(self._model, engine_id)
                self._inter_token_latency[engine_id] = series
            series.observe(now - previous)
        self._last_output[index] = now

    def on_aborted(self, index: int, request_id: str, num_output_tokens: int,
                   engine_id: str) -> None:
        """The client went away (or the request failed at the gateway) before the end."""
        self.on_finished(index, request_id, wire.FinishInfo(
            request_id=request_id, finish_reason=wire.FinishReason.ABORT), num_output_tokens,
            engine_id, count_prompt=False)

    def on_finished(self, index: int, request_id: str, info: wire.FinishInfo,
                    num_output_tokens: int, engine_id: str, count_prompt: bool,
                    num_moves: int = 0) -> None:
        now = time.perf_counter()
        metrics, model = self._metrics, self._model
        reason = _REASONS.get(info.finish_reason, "unknown")
        e2e = now - self.arrived
        first = self._first_output.get(index)
        metrics.e2e_request_latency.labels(model, engine_id).observe(e2e)
        metrics.request_success.labels(model, engine_id, reason).inc()
        metrics.generation_tokens.labels(model, engine_id).inc(num_output_tokens)
        if count_prompt:
            metrics.prompt_tokens.labels(model, engine_id).inc(info.num_prompt_tokens)
        if info.queue_time_s or info.prefill_time_s:
            metrics.request_queue_time.labels(model, engine_id).observe(info.queue_time_s)
            metrics.request_prefill_time.labels(model, engine_id).observe(info.prefill_time_s)
            metrics.request_decode_time.labels(model, engine_id).observe(info.decode_time_s)
        metrics.detokenize_time.labels(model).observe(info.detokenize_time_s)
        log.info("request finished", request_id=request_id, api_key=self.key_id or None,
                 engine=info.engine_id, model=model,
                 finish_reason=reason, prompt_tokens=info.num_prompt_tokens,
                 cached_tokens=info.num_cached_tokens, completion_tokens=num_output_tokens,
                 preemptions=info.num_preemptions, tokenize_s=round(self.tokenize_s, 6),
                 queue_s=round(info.queue_time_s, 6), prefill_s=round(info.prefill_time_s, 6),
                 decode_s=round(info.decode_time_s, 6),
                 detokenize_s=round(info.detokenize_time_s, 6), e2e_s=round(e2e, 6),
                 ttft_s=None if first is None else round(first - self.arrived, 6),
                 moves=num_moves, error=info.error or None,
                 spec_acceptance_rate=(round(info.num_accepted_tokens / info.num_draft_tokens,
                                             4) if info.num_draft_tokens else None),
                 **self._route)
