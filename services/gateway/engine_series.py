"""Every engine's own series on the gateway's /metrics, so one scrape target shows the whole
mesh (vLLM's Grafana dashboard included).

At each scrape the gateway asks each engine's scheduler for its /metrics over NATS (every
service answers, services/common/service.py) and adds the vLLM and mesh families the gateway
does not have itself: speculative decoding counters, the engine's step histograms, the KV
connector's series, ... as the engine labels them (model_name, engine). A family the gateway
has under the same name stays the gateway's: the request latencies as clients see them
(labelled by the engine that served each request) and the engines' gauges from heartbeats.
An engine that does not answer in time is left out of that scrape and counted in
llm_mesh:engine_scrape_failures_total.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

import nats.errors
import structlog
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from services.common.bus import Bus
from services.common.subjects import Subjects
from services.frontend.engine_client.mesh_view import Instance, MeshView

log = structlog.get_logger(__name__)

ENGINE_FAMILY_PREFIXES = ("vllm:", "llm_mesh:")
ENGINE_SCRAPE_TIMEOUT_S = 2.0   # well inside Prometheus' default scrape timeout (10 s)


class EngineSeries:
    def __init__(self, bus: Bus, subjects: Subjects, view: MeshView, failures: Counter,
                 timeout_s: float = ENGINE_SCRAPE_TIMEOUT_S) -> None:
        """`failures`: counts, by engine, the scrapes its scheduler did not answer."""
        self._bus = bus
        self._subjects = subjects
        self._view = view
        self._failures = failures
        self._timeout_s = timeout_s

    async def exposition(self, registry: CollectorRegistry) -> bytes:
        """The gateway's own metrics and every engine's families, in Prometheus' text
        format."""
        own = list(registry.collect())
        texts = await asyncio.gather(*(self._ask(scheduler)
                                       for scheduler in self._view.schedulers().values()))
        names = {family.name for family in own}
        engines = [f for f in merge_families(t for t in texts if t) if f.name not in names]
        return render([*own, *engines])

    async def _ask(self, scheduler: Instance) -> str | None:
        subject = self._subjects.service_metrics("scheduler", scheduler.instance_id)
        try:
            reply = await self._bus.client.request(subject, b"", timeout=self._timeout_s)
        except nats.errors.Error as exc:   # timed out, no responders, reconnecting
            self._failures.labels(scheduler.engine_id).inc()
            log.info("an engine's metrics left out of this scrape", engine=scheduler.engine_id,
                     scheduler=scheduler.instance_id, error=str(exc) or type(exc).__name__)
            return None
        return reply.data.decode()


def merge_families(texts: Iterable[str]) -> list[Metric]:
    """The vllm: and llm_mesh: families of several expositions, one family per name with
    every exposition's samples (each engine's carry its own `engine` label). The `_created`
    companions of counters and histograms are dropped: they would clash with the gateway's."""
    families: dict[str, Metric] = {}
    for text in texts:
        parsed = list(text_string_to_metric_families(text))
        names = {family.name for family in parsed}
        for family in parsed:
            if (not family.name.startswith(ENGINE_FAMILY_PREFIXES)
                    or family.name.removesuffix("_created") in names - {family.name}):
                continue
            merged = families.setdefault(family.name, Metric(
                family.name, family.documentation, family.type, family.unit))
            merged.samples.extend(family.samples)
    return list(families.values())


def render(families: list[Metric]) -> bytes:
    registry = CollectorRegistry()
    registry.register(_Families(families))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
