"""Two engines' expositions become one valid exposition: one family per name holding both
engines' samples, without the _created companions (they would clash with the gateway's),
and only the vllm: and llm_mesh: families."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.common.metrics import ENGINE_LABELS
from services.gateway.engine_series import merge_families, render
from tests.mesh import metric_value


def engine_exposition(engine: str, accepted: int, step_s: float) -> str:
    registry = CollectorRegistry()
    Counter("vllm:spec_decode_num_accepted_tokens", "accepted", ENGINE_LABELS,
            registry=registry).labels("m", engine).inc(accepted)
    Histogram("llm_mesh:engine_step_seconds", "step", ENGINE_LABELS, buckets=(0.01, 0.1),
              registry=registry).labels("m", engine).observe(step_s)
    Gauge("process_open_fds", "not the engine's", registry=registry).set(7)
    return generate_latest(registry).decode()


def test_two_engines_merge_into_one_family_per_name() -> None:
    families = merge_families([engine_exposition("engine-0", 3, 0.05),
                               engine_exposition("engine-1", 5, 0.005)])
    assert sorted(f.name for f in families) == ["llm_mesh:engine_step_seconds",
                                                "vllm:spec_decode_num_accepted_tokens"]
    text = render(families).decode()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)) == 2
    for engine, accepted, fast_steps in (("engine-0", 3, 0), ("engine-1", 5, 1)):
        assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_total",
                            engine=engine) == accepted
        assert metric_value(text, "llm_mesh:engine_step_seconds_bucket", engine=engine,
                            le="0.01") == fast_steps
    assert "_created" not in text and "process_open_fds" not in text
