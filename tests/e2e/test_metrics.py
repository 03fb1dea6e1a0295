"""/metrics after real traffic: every listed metric exists and moved as the traffic says."""

from __future__ import annotations

import json

import openai
import pytest

from tests.mesh import Mesh, http_get, http_post, metric_value

pytestmark = pytest.mark.slow

ENGINE_GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"]


def scrape(url: str) -> str:
    status, body = http_get(url)
    assert status == 200
    return body.decode()


def moved(before: str, after: str, name: str, **labels: str) -> float:
    try:
        old = metric_value(before, name, **labels)
    except KeyError:
        old = 0.0
    return metric_value(after, name, **labels) - old


def test_metrics_follow_the_traffic(mesh: Mesh, client: openai.OpenAI, model_name: str) -> None:
    gateway_url = f"{mesh.base_url}/metrics"
    before = scrape(gateway_url)
    engine_before = mesh.services["scheduler"].get("/metrics")[1].decode()
    tokenizer_before = mesh.services["tokenizer"].get("/metrics")[1].decode()

    lengths = [3, 5, 8]
    prompt_tokens = 0
    for n in lengths:
        out = client.completions.create(model=model_name, prompt=f"Count to {n}:",
                                        max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == n
        prompt_tokens += out.usage.prompt_tokens
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    usage = [c.usage for c in stream if c.usage][0]
    prompt_tokens += usage.prompt_tokens
    assert http_post(f"{mesh.base_url}/v1/completions", {"model": model_name})[0] == 400

    after = scrape(gateway_url)
    generated = sum(lengths) + 4
    assert moved(before, after, "vllm:generation_tokens_total") == generated
    assert moved(before, after, "vllm:prompt_tokens_total") == prompt_tokens
    assert moved(before, after, "vllm:request_success_total", finished_reason="length") == 4
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                      "vllm:request_decode_time_seconds", "llm_mesh:tokenize_seconds",
                      "llm_mesh:detokenize_seconds"):
        assert moved(before, after, f"{histogram}_count") == 4, histogram
    assert moved(before, after, "vllm:inter_token_latency_seconds_count") == generated - 4
    assert moved(before, after, "llm_mesh:request_rejections_total", status="400") == 1
    assert metric_value(after, "llm_mesh:service_instances_started_total", service="worker") >= 1
    for name in ENGINE_GAUGES:  # gathered from the schedulers' heartbeats
        metric_value(after, name, engine="engine-0", model_name=model_name)

    engine_after = mesh.services["scheduler"].get("/metrics")[1].decode()
    assert moved(engine_before, engine_after, "vllm:generation_tokens_total") == generated
    for name in ("llm_mesh:step_messaging_seconds_count", "llm_mesh:worker_execute_seconds_count",
                 "vllm:time_to_first_token_seconds_count"):
        assert moved(engine_before, engine_after, name) > 0, name
    # Scheduler and worker share this host: steps cross the local channel, not NATS.
    assert metric_value(engine_after, "llm_mesh:worker_step_transport", transport="local") == 1
    assert metric_value(engine_after, "llm_mesh:worker_step_transport", transport="nats") == 0
    # ... so every step's messaging is also timed hop by hop, on the one clock of this host.
    steps = moved(engine_before, engine_after, "llm_mesh:step_messaging_seconds_count")
    for hop in ("to_worker", "worker", "back", "to_loop"):
        assert moved(engine_before, engine_after, "llm_mesh:step_hop_seconds_count",
                     hop=hop) == steps, hop
        assert moved(engine_before, engine_after, "llm_mesh:step_hop_seconds_sum", hop=hop) > 0
    # The ITL guard's cap on a step's prompt tokens beside decodes (the budget if uncapped).
    assert metric_value(engine_after, "llm_mesh:prefill_token_cap", model_name=model_name) > 0
    tokenizer_after = mesh.services["tokenizer"].get("/metrics")[1].decode()
    assert moved(tokenizer_before, tokenizer_after, "llm_mesh:tokenizer_encode_seconds_count") >= 4


def test_one_timing_line_per_finished_request(mesh: Mesh, client: openai.OpenAI,
                                              model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt="Timing line", max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True},
                                    extra_headers={"x-session-id": "timing-session"})
    lines = [json.loads(line) for line in mesh.services["gateway"].log_path.read_text()
             .splitlines() if '"request finished"' in line]
    mine = [line for line in lines if line["request_id"].startswith(out.id)]
    assert len(mine) == 1
    line = mine[0]
    assert line["engine"] == "engine-0" and line["completion_tokens"] == 3
    assert line["prompt_tokens"] == out.usage.prompt_tokens
    for field in ("tokenize_s", "queue_s", "prefill_s", "decode_s", "detokenize_s", "e2e_s"):
        assert line[field] >= 0, field
    assert line["e2e_s"] >= line["prefill_s"] + line["decode_s"]
    # Where the router sent it and why, beside what the engine found cached.
    assert line["session"] == "timing-session" and line["route"] == "least_loaded"
    assert line["predicted_cached_tokens"] <= line["prompt_tokens"]
