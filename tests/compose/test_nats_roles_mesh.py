"""The whole mesh under compose's NATS users: every service logs in as its own role and
serves — a streamed chat, an admin call to the engines, a batch over HTTP, a stored and a
background response resumed by id, prefix blocks saved to the kvstore with their KV events —
without the server refusing one publish or
subscribe. (What each role is refused: tests/compose/test_compose_servers.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import nats
import openai
import pytest

from tests.batch.polling import finished, wait_for
from tests.compose.compose_nats import ComposeNats
from tests.mesh import Mesh, http_get, http_post, metric_value, serving

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def role_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    # compose/nats/nats.conf names the default namespace's subjects.
    nats_server = ComposeNats()
    kinds = ["gateway", "tokenizer", "scheduler", "worker", "kvstore", "batch"]
    mesh = Mesh(Path(tmp_path_factory.mktemp("roles")), nats=nats_server, namespace="mesh",
                with_kvstore=True, extra_args=nats_server.service_args(kinds))
    with serving(mesh, then=lambda m: m.add_service("batch")) as running:
        yield running


@pytest.fixture(scope="module")
def compose_nats(role_mesh: Mesh) -> ComposeNats:
    assert isinstance(role_mesh.nats, ComposeNats)
    return role_mesh.nats


def test_every_role_serves_its_part_and_nothing_is_refused(role_mesh: Mesh,
                                                           compose_nats: ComposeNats) -> None:
    with openai.OpenAI(base_url=f"{role_mesh.base_url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        model = client.models.list().data[0].id
        words = " ".join(f"role-{i}" for i in range(40))   # > one KV block
        for _ in range(2):   # reused by the second: its blocks are saved to the kvstore
            stream = client.chat.completions.create(
                model=model, max_tokens=8, temperature=0, stream=True,
                messages=[{"role": "user", "content": f"Repeat: {words}"}])
            text = "".join(chunk.choices[0].delta.content or ""
                           for chunk in stream if chunk.choices)
            assert text
        # An admin call: a request to every engine, answered by each.
        assert http_post(f"{role_mesh.base_url}/reset_prefix_cache", {})[0] == 200

        line = {"custom_id": "q", "method": "POST", "url": CHAT, "body": {
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}}
        uploaded = client.files.create(file=("in.jsonl", json.dumps(line).encode()),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                      completion_window="24h")
        batch = wait_for(client, batch.id, finished, timeout_s=120)
        assert batch.status == "completed" and batch.request_counts.completed == 1
        assert client.files.content(batch.output_file_id).text.count("\n") == 1

        stored = client.responses.create(model=model, input="Hi", max_output_tokens=4,
                                          temperature=0)
        assert client.responses.retrieve(stored.id).output_text == stored.output_text
        background = client.responses.create(model=model, input="Hi", max_output_tokens=4,
                                              temperature=0, background=True)
        events = list(client.responses.retrieve(background.id, stream=True, starting_after=-1))
        assert events[-1].type in ("response.completed", "response.incomplete")

    async def kv_events_stored() -> int:
        connection = await nats.connect(compose_nats.url_for("kvstore"),
                                        inbox_prefix=compose_nats.inbox_prefix_for("kvstore"))
        try:
            info = await connection.jetstream().stream_info("mesh-kv-events")
            return info.state.messages
        finally:
            await connection.close()

    assert asyncio.run(kv_events_stored()) > 0   # engines and the node published events
    # The gateway's /metrics asks the scheduler for the engine's own series over NATS.
    status, body = http_get(f"{role_mesh.base_url}/metrics")
    assert status == 200
    assert metric_value(body.decode(), "llm_mesh:engine_step_seconds_count",
                        engine="engine-0") > 0
    assert compose_nats.permission_violations() == []
