"""The Grafana dashboard only queries metrics the mesh exports."""

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from services.common.metrics import EngineMetrics, GatewayMetrics, TokenizerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "compose" / "grafana" / "llm-mesh-dashboard.json"


def exported_names() -> set[str]:
    names = set()
    for metrics in (GatewayMetrics, EngineMetrics, TokenizerMetrics):
        registry = CollectorRegistry()  # one each: gateway and engine share vLLM's names
        metrics(registry)
        names |= {metric.name for metric in registry.collect()}
    return names


def test_every_queried_metric_is_exported() -> None:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    queried = {re.sub(r"_(bucket|total|sum|count)$", "", name)
               for expr in exprs for name in re.findall(r"((?:vllm|llm_mesh):[a-z0-9_]+)", expr)}
    missing = queried - exported_names()
    assert not missing, missing
    assert {"vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc",
            "vllm:num_requests_waiting", "vllm:e2e_request_latency_seconds"} <= queried
