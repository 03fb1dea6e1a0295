"""A mesh over three hosts (network namespaces joined by a bridge) on a three-node NATS
cluster, TLS between all of them, with JetStream replicated three ways: the gateway, tokenizer
and batch runner on one host, a worker on each of the others. Engine 2's scheduler runs
beside its worker (steps cross the local step channel); engine 1's runs on the first host, so
its steps cross NATS between hosts. When a NATS node dies under load, greedy streams finish
as an undisturbed run would, a batch finishes every line exactly once, and the KV events
stream keeps every event; when a whole host dies, streams still finish identical."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.errors
import openai
import pytest
import trustme

from services.common.ports import free_port
from tests.batch.polling import finished, wait_for
from tests.mesh import ENGINE_ARGS, metric_value
from tests.multihost.cluster import Pki, SpreadMesh
from tests.multihost.hosts import Host, hosts, kill_host, unavailable

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable() is not None,
                                 reason=f"no network namespaces: {unavailable()}")]

PROMPTS = [f"Write a short poem about the number {n}." for n in range(4)]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def spread(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SpreadMesh, list[Host]]]:
    with hosts(3) as (front, back_1, back_2):
        workdir = Path(tmp_path_factory.mktemp("spread"))
        mesh = SpreadMesh(workdir, Pki(trustme.CA(), workdir))
        try:
            mesh.start_cluster([front, back_1, back_2])
            port = free_port()
            mesh.gateway_url = f"http://{front.ip}:{port}"
            mesh.start_service("gateway", front, ["--host", front.ip, "--port", str(port)])
            mesh.start_service("tokenizer", front, [])
            mesh.start_service("batch", front, [])
            for i, host in enumerate((back_1, back_2), start=1):
                engine = ["--engine-id", f"engine-{i}"]
                # One thread each: the two "hosts" share this machine's cores (tests/mesh.py).
                mesh.start_service(f"worker-{i}", host,
                                   [*engine, *ENGINE_ARGS, "--num-threads", "1"], "worker")
                mesh.start_service(f"scheduler-{i}", front if i == 1 else host,
                                   [*engine, *ENGINE_ARGS[:2], "--enable-kv-events"],
                                   "scheduler")
            mesh.wait_ready(engines=2)
            yield mesh, [front, back_1, back_2]
        finally:
            mesh.stop()


@pytest.fixture(autouse=True)
def logs_on_failure(request: pytest.FixtureRequest,
                    spread: tuple[SpreadMesh, list[Host]]) -> Iterator[None]:
    """A failed test shows the services' logs (a 500's cause is in the gateway's)."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        print(spread[0].logs(), file=sys.stderr)


def test_engines_step_locally_or_over_nats_by_where_the_worker_is(
        spread: tuple[SpreadMesh, list[Host]]) -> None:
    mesh, _ = spread
    for name, transport in (("scheduler-1", "nats"), ("scheduler-2", "local")):
        status, body = mesh.services[name].get("/metrics")
        assert status == 200
        assert metric_value(body.decode(), "llm_mesh:worker_step_transport",
                            transport=transport) == 1, name


def client_of(mesh: SpreadMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.gateway_url}/v1", api_key="unused", max_retries=0,
                         timeout=180)


def answers(mesh: SpreadMesh) -> list[str]:
    with client_of(mesh) as client:
        model = client.models.list().data[0].id
        return [client.chat.completions.create(
            model=model, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": p}]).choices[0].message.content or ""
            for p in PROMPTS]


def stream_while(mesh: SpreadMesh, disrupt: threading.Event, after_chunks: int) -> list[str]:
    """Streams every prompt at once; sets `disrupt` once each stream has `after_chunks`
    chunks, and returns the texts."""
    texts = [""] * len(PROMPTS)
    errors: list[BaseException] = []
    started = threading.Barrier(len(PROMPTS), action=disrupt.set)

    def run(i: int) -> None:
        try:
            with client_of(mesh) as client:
                model = client.models.list().data[0].id
                chunks = 0
                for chunk in client.chat.completions.create(
                        model=model, temperature=0, max_tokens=MAX_TOKENS, stream=True,
                        messages=[{"role": "user", "content": PROMPTS[i]}]):
                    if chunk.choices:
                        texts[i] += chunk.choices[0].delta.content or ""
                        chunks += 1
                        if chunks == after_chunks:
                            started.wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            started.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return texts


def test_streams_outlive_a_nats_node(spread: tuple[SpreadMesh, list[Host]]) -> None:
    mesh, (_, back_1, _) = spread
    reference = answers(mesh)
    disrupt = threading.Event()
    node = mesh.nodes[back_1.name]
    killer = threading.Thread(target=lambda: disrupt.wait(120) and node.kill())
    killer.start()
    texts = stream_while(mesh, disrupt, after_chunks=4)
    killer.join()
    assert texts == reference
    mesh.restart_node(back_1)   # the cluster whole again for the next test


def test_a_batch_finishes_every_line_once_when_a_node_dies(
        spread: tuple[SpreadMesh, list[Host]]) -> None:
    mesh, (_, back_1, _) = spread
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Count to {i}."}]}}
             for i in range(24)]
    node = mesh.nodes[back_1.name]
    with client_of(mesh) as client:
        uploaded = client.files.create(
            file=("in.jsonl", "\n".join(json.dumps(line) for line in lines).encode()),
            purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(client, batch.id, lambda b: b.request_counts.completed >= 4)
        node.kill()   # mid-batch
        try:
            batch = wait_for(client, batch.id, finished, timeout_s=300)
        finally:
            mesh.restart_node(back_1)
        assert batch.status == "completed", batch
        assert batch.output_file_id is not None
        output = [json.loads(row) for row in
                  client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(row["custom_id"] for row in output) == sorted(l["custom_id"] for l in lines)


def test_kv_events_survive_a_node(spread: tuple[SpreadMesh, list[Host]]) -> None:
    mesh, (front, back_1, _) = spread
    answers(mesh)   # blocks cached: events published

    async def events_stored() -> tuple[int, int]:
        connection = await nats.connect(mesh.nodes[front.name].url,
                                        tls=mesh.pki.client_context())
        try:
            info = await connection.jetstream().stream_info("mesh-kv-events")
            return info.state.messages, info.config.num_replicas or 1
        finally:
            await connection.close()

    before, replicas = asyncio.run(events_stored())
    assert before > 0 and replicas == 3
    node = mesh.nodes[back_1.name]
    node.kill()
    try:
        deadline = time.monotonic() + 30
        while True:   # the stream answers again once its replicas elect a leader
            try:
                after, _ = asyncio.run(events_stored())
                break
            except nats.errors.Error:
                assert time.monotonic() < deadline
                time.sleep(0.5)
    finally:
        mesh.restart_node(back_1)
    assert after >= before


def test_streams_outlive_a_host(spread: tuple[SpreadMesh, list[Host]]) -> None:
    mesh, (_, _, back_2) = spread
    reference = answers(mesh)
    disrupt = threading.Event()
    killer = threading.Thread(target=lambda: disrupt.wait(120) and kill_host(back_2))
    killer.start()
    texts = stream_while(mesh, disrupt, after_chunks=4)
    killer.join()
    assert texts == reference
