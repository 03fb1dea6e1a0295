"""What the scheduler service does for the KV connector and the engine's KV events, so the
service only calls in at a few points: admission (lookup), building an engine core (a
connector for it), each step (held producer finishes, events, metrics) and a lost worker.

Off (every call a no-op) without --redis-url, with --no-enable-kv-connector, or without
prefix caching (blocks are named by their prefix-cache hashes).
"""

from __future__ import annotations

import structlog
from prometheus_client import Gauge

from services.common import wire
from services.common.bus import Bus
from services.common.kv_event_stream import KVEventPublisher
from services.common.kv_index import KVIndex
from services.common.metrics import EngineMetrics
from services.common.packing import pack_int32
from services.common.subjects import Subjects
from services.scheduler.core.kv_connector.connector import SchedulerKVConnector
from services.scheduler.core.kv_connector.metadata import KVRole, LoadFailurePolicy, SaveMode
from services.scheduler.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from services.scheduler.core.output import EngineCoreOutput
from services.scheduler.core.request import Request
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.kv.lookup import KVStoreLookup
from services.scheduler.settings import SchedulerSettings


class KVConnectorRuntime:
    def __init__(self, settings: SchedulerSettings, bus: Bus, subjects: Subjects,
                 publisher_id: str, metrics: EngineMetrics,
                 log: structlog.stdlib.BoundLogger) -> None:
        self.settings = settings
        self.log = log
        self.is_enabled = bool(settings.enable_kv_connector and settings.redis_url
                               and settings.enable_prefix_caching)
        self.lookup: KVStoreLookup | None = None
        if self.is_enabled:
            self.lookup = KVStoreLookup(KVIndex.connect(settings.redis_url, settings.namespace),
                                        settings.block_size, settings.kv_lookup_timeout_s, log)
        self.events: KVEventPublisher | None = None
        if settings.enable_kv_events:
            self.events = KVEventPublisher(bus, subjects, publisher_id, self._snapshot,
                                           replicas=settings.jetstream_replicas)
        self._scheduler: Scheduler | None = None
        self._metrics = metrics
        self._counters: tuple = ()
        self._load_time = None
        self._seen = (0, 0, 0, 0, 0)   # counts already exported
        self._event_batches: Gauge | None = None

    @property
    def kv_role(self) -> str:
        return self.settings.kv_role if self.is_enabled else ""

    async def start(self) -> None:
        if self.lookup is not None:
            self.lookup.start()
        if self.events is not None:
            await self.events.start()

    async def close(self) -> None:
        if self.lookup is not None:
            await self.lookup.close()
        if self.events is not None:
            await self.events.close()

    def on_worker_info(self, info: wire.WorkerInfo) -> None:
        """A worker (re)joined: its fingerprint names the blocks it loads and saves, and its
        pool starts empty."""
        if self.events is not None:
            self.events.fingerprint = info.kv_fingerprint
            self.events.publish([wire.KvEvent(cleared=wire.AllBlocksCleared())])
        if self.lookup is not None:
            self.lookup.fingerprint = info.kv_fingerprint
            self.lookup.block_size = info.block_size

    def make_connector(self, info: wire.WorkerInfo) -> SchedulerKVConnector | None:
        """A connector for a new engine core (None: the connector is off)."""
        if self.lookup is None or not info.kv_fingerprint:
            return None
        s = self.settings
        lookup = self.lookup
        return SchedulerKVConnector(info.block_size, KVRole(s.kv_role), SaveMode(s.kv_save_mode),
                                    LoadFailurePolicy(s.kv_load_failure_policy),
                                    lambda: lookup.live_nodes)

    def attach(self, scheduler: Scheduler, labels: tuple[str, str]) -> None:
        """A new engine core: its connector's counts start at zero."""
        self._scheduler = scheduler
        self._seen = (0, 0, 0, 0, 0)
        self._event_batches = (self._metrics.kv_event_batches.labels(*labels)
                               if self.events is not None else None)
        if scheduler.kv_connector is not None:
            # Label children made now, so every counter is exported (at 0) from the start.
            m = self._metrics
            self._counters = tuple(counter.labels(*labels) for counter in (
                m.external_prefix_cache_queries, m.external_prefix_cache_hits,
                m.kv_load_failures, m.kv_saved_blocks, m.kv_save_failures))
            self._load_time = m.kv_load_time.labels(*labels)

    async def on_admission(self, scheduler: Scheduler, request: Request) -> None:
        if self.lookup is None or scheduler.kv_connector is None:
            return
        local, _ = scheduler.kv_cache_manager.get_computed_blocks(request)
        await self.lookup.lookup(request, local.num_blocks)

    def has_work(self, scheduler: Scheduler) -> bool:
        return scheduler.kv_connector is not None and scheduler.kv_connector.has_work

    def outputs_to_send(self, scheduler: Scheduler,
                        outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        if scheduler.kv_connector is None:
            return outputs
        return scheduler.kv_connector.hold_finished(outputs)

    def release_held(self, scheduler: Scheduler | None) -> list[EngineCoreOutput]:
        if scheduler is None or scheduler.kv_connector is None:
            return []
        return scheduler.kv_connector.release_held()

    def after_step(self, scheduler: Scheduler) -> None:
        """Publishes the step's pool events and exports the connector's counters."""
        if self.events is not None:
            self.events.publish([_to_wire(event) for event in scheduler.take_kv_events()])
            if self._event_batches is not None:
                self._event_batches.set(self.events.seq)
        connector = scheduler.kv_connector
        if connector is None or self.lookup is None or self._load_time is None:
            return
        counts = (self.lookup.num_query_tokens, connector.num_hit_tokens,
                  connector.num_load_failures, connector.num_saved_blocks,
                  connector.num_save_failures)
        for counter, now, seen in zip(self._counters, counts, self._seen):
            if now > seen:
                counter.inc(now - seen)
        self._seen = counts
        for seconds in connector.take_load_times():
            self._load_time.observe(seconds)

    def external_prefix_cache_counts(self) -> tuple[int, int]:
        """Prompt tokens looked up in the kvstore and found there, since the engine core
        started (for the heartbeat)."""
        return self._seen[0], self._seen[1]

    def _snapshot(self) -> list[wire.KvEvent]:
        if self._scheduler is None:
            return []
        hashes = self._scheduler.kv_cache_manager.get_cached_block_hashes()
        return [wire.KvEvent(stored=wire.BlockStored(
            block_hashes=hashes, block_size=self._scheduler.block_size,
            medium=wire.KvMedium.GPU))] if hashes else []


def _to_wire(event: KVCacheEvent) -> wire.KvEvent:
    if isinstance(event, BlockStored):
        return wire.KvEvent(stored=wire.BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash or b"",
            token_ids=pack_int32(event.token_ids), block_size=event.block_size,
            lora_id=event.lora_id, extra_keys=list(event.extra_keys),
            medium=wire.KvMedium.GPU))
    if isinstance(event, BlockRemoved):
        return wire.KvEvent(removed=wire.BlockRemoved(block_hashes=list(event.block_hashes),
                                                      medium=wire.KvMedium.GPU))
    assert isinstance(event, AllBlocksCleared)
    return wire.KvEvent(cleared=wire.AllBlocksCleared())
