"""What a service that serves OpenAI requests (the gateway, the batch runner) runs beside
them: a view of the mesh kept from heartbeats, the mesh client, the engine router (fed by
the KV events stream), and a sweep that hands a lost instance's requests on (moved to live
ones, or ended with a retriable error) and moves the requests of engines that hang (the
stall watchdog)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from services.common import wire
from services.common.bus import Bus
from services.common.metrics import GatewayMetrics
from services.common.mm_inputs import mm_spans
from services.common.packing import unpack_int32
from services.common.subjects import Subjects
from services.common.tasks import BackgroundTasks
from services.common.timing import INSTANCE_SWEEP_INTERVAL_S
from services.frontend.context import FrontendContext
from services.frontend.engine_client.mesh_client import MeshClient
from services.frontend.engine_client.mesh_view import EngineView, Instance, MeshView
from services.frontend.router import ApproximateIndex, PrefixIndex
from services.frontend.router.engine_router import EngineRouter, RouterMode
from services.frontend.router.kv_event_subscriber import KVEventSubscriber
from services.frontend.router.session_table import SessionTable
from services.frontend.settings import FrontendSettings


class FrontendRuntime:
    def __init__(self, settings: FrontendSettings, metrics: GatewayMetrics, log: Any) -> None:
        self.settings = settings
        self.metrics = metrics
        self.log = log
        self.view = MeshView(stale_after_s=settings.instance_timeout_s,
                             stall_after_s=settings.stall_timeout_s)
        self.client: MeshClient | None = None
        self.router = EngineRouter(
            RouterMode(settings.router_mode), PrefixIndex(),
            ApproximateIndex(settings.router_ttl_s), SessionTable(settings.router_session_ttl_s),
            overlap_weight=settings.kv_overlap_score_weight,
            temperature=settings.router_temperature,
            session_busy_threshold=settings.router_session_busy_threshold,
            session_history_weight=settings.router_session_history_weight,
            hash_algo=settings.router_hash_algo, metrics=metrics.router)
        self.events: KVEventSubscriber | None = None
        self._num_resyncs = 0

    async def start(self, bus: Bus, subjects: Subjects, instance_id: str,
                    tasks: BackgroundTasks) -> FrontendContext:
        """Joins the mesh as `instance_id` (tokenizers send its requests' text there)."""
        self.client = MeshClient(bus, subjects, instance_id, self.view,
                                 self.settings.tokenizer_timeout_s,
                                 self.settings.engine_submit_timeout_s,
                                 migration_timeout_s=self.settings.migration_timeout_s,
                                 metrics=self.metrics)
        await self.client.start(tasks)
        await bus.subscribe(subjects.heartbeat, wire.Heartbeat, self._on_heartbeat)
        if self.router.mode is RouterMode.KV and self.settings.router_kv_events:
            await self._follow_kv_events(bus, subjects)
        tasks.spawn(self._sweep_loop(self.client), name="sweep lost instances")
        return FrontendContext(self.settings, self.client, self.view, self.metrics,
                               self.router)

    async def _follow_kv_events(self, bus: Bus, subjects: Subjects) -> None:
        """Replays the KV events stream's window, then follows it: a restarted router routes
        as before. Without JetStream the router predicts from its own decisions."""
        events = KVEventSubscriber(bus, subjects, index=self.router.index,
                                   replicas=self.settings.jetstream_replicas)
        try:
            await events.start()
        except Exception as exc:   # a NATS without JetStream, or one refusing the stream
            self.log.warning("KV events unavailable; routing by predicted cache contents",
                             error=str(exc) or type(exc).__name__)
            return
        self.events = events

    async def _on_heartbeat(self, beat: wire.Heartbeat) -> None:
        # NOTE: the mesh client's too: one subscription parses each beat once (betterproto:
        # ~0.15 ms a beat, ~0.75 with a scheduler's engine info, ~7 beats a second).
        if self.view.on_heartbeat(beat):
            self.metrics.instances_started.labels(beat.service).inc()
        if beat.service == "scheduler":
            self.router.on_engine_heartbeat(beat.engine_id, beat.time)
        assert self.client is not None   # subscribed in start(), after the client
        await self.client.on_heartbeat(beat)

    async def _sweep_loop(self, client: MeshClient) -> None:
        while True:
            await asyncio.sleep(INSTANCE_SWEEP_INTERVAL_S)
            for instance in self.view.sweep():
                self.metrics.instances_lost.labels(instance.service).inc()
                failed = client.fail_instance(instance)
                self.log.warning("service instance gone", service=instance.service,
                                 instance=instance.instance_id, failed_requests=failed)
                if instance.service == "scheduler":   # its KV pool went with it
                    self._forget_engine(instance)
            client.move_stalled()
            client.move_queued(self.settings.router_queue_move_after_s,
                               self.settings.router_session_busy_threshold, self._cached_tokens)
            self._export_event_state()

    def _cached_tokens(self, engines: Sequence[EngineView],
                       request: wire.GenerateRequest) -> dict[str, int]:
        """What each engine holds of a request's prompt, by the KV router's index (nothing
        known in the other modes)."""
        if self.router.mode is not RouterMode.KV:
            return {}
        return self.router.cached_tokens(
            engines, unpack_int32(request.prompt_token_ids), request.cache_salt,
            request.lora.lora_id if request.lora else 0, mm_spans(request.mm_items))

    def _forget_engine(self, scheduler: Instance) -> None:
        if self.events is not None:
            self.events.forget(scheduler.instance_id)
            try:
                self.metrics.router.applied_batches.remove(scheduler.instance_id)
            except KeyError:
                pass   # it never published
        self.router.approximate.remove_worker(scheduler.engine_id)

    def _export_event_state(self) -> None:
        if self.events is None:
            return
        router_metrics = self.metrics.router
        router_metrics.event_lag.set(self.events.lag_s)
        for publisher, seq in self.events.last_seq.items():
            router_metrics.applied_batches.labels(publisher).set(seq)
        router_metrics.resyncs.inc(self.events.num_resyncs - self._num_resyncs)
        self._num_resyncs = self.events.num_resyncs
