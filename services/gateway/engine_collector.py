"""Re-exports each engine's gauges and counters, as its scheduler last reported them in a
heartbeat, on the gateway's /metrics (one scrape target for the whole mesh)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.metrics import ENGINE_LABELS
from services.frontend.engine_client.mesh_view import MeshView


class EngineCollector(Collector):
    def __init__(self, view: MeshView) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch",
                                    labels=ENGINE_LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting",
                                    labels=ENGINE_LABELS)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)",
                                  labels=ENGINE_LABELS)
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache",
                                      labels=ENGINE_LABELS)
        hits = CounterMetricFamily("vllm:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", labels=ENGINE_LABELS)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Preemptions (by recompute)",
                                          labels=ENGINE_LABELS)
        external_queries = CounterMetricFamily(
            "vllm:external_prefix_cache_queries",
            "Prompt tokens looked up in the kvstore (the external prefix cache)",
            labels=ENGINE_LABELS)
        external_hits = CounterMetricFamily(
            "vllm:external_prefix_cache_hits", "Prompt tokens found in the kvstore",
            labels=ENGINE_LABELS)
        for instance in self._view.schedulers().values():   # one per engine
            info = instance.engine
            if info is None:
                continue
            labels = [info.model, instance.engine_id]
            running.add_metric(labels, info.num_running)
            waiting.add_metric(labels, info.num_waiting)
            usage.add_metric(labels, info.kv_cache_usage)
            queries.add_metric(labels, info.prefix_cache_queries)
            hits.add_metric(labels, info.prefix_cache_hits)
            preemptions.add_metric(labels, info.num_preemptions)
            external_queries.add_metric(labels, info.external_prefix_cache_queries)
            external_hits.add_metric(labels, info.external_prefix_cache_hits)
        yield from (running, waiting, usage, queries, hits, preemptions, external_queries,
                    external_hits)
