"""A batch line through the gateway's own handlers, against a fake mesh: it is submitted at
the batch priority and without streaming, bad bodies get the gateway's 400 at once, and
what the mesh may recover from is retried; a line runs as its batch owner's tenant (its
salt, its token bucket)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CollectorRegistry

from services.batch.line_executor import LineExecutor
from services.batch.settings import BatchSettings
from services.common import wire
from services.common.metrics import GatewayMetrics
from services.common.packing import pack_int32
from services.frontend.context import FrontendContext
from services.frontend.engine_client.generation import Generation, TextDelta
from services.frontend.engine_client.mesh_view import EngineView, MeshView
from services.frontend.errors import unavailable
from services.frontend.tenancy.auth import ApiKeys

CHAT = "/v1/chat/completions"


class FakeMeshClient:
    """Encodes every prompt to 3 tokens; every request answers "hi" in one step, unless the
    engine refuses it `refusals` more times first."""

    gateway_id = "batch-test"

    def __init__(self, refusals: int = 0, retry_after_s: float = 1.0) -> None:
        self.refusals = refusals
        self.retry_after_s = retry_after_s
        self.submitted: list[wire.GenerateRequest] = []
        self.attempted_at: list[float] = []

    async def encode(self, request: wire.EncodeRequest) -> wire.EncodeReply:
        return wire.EncodeReply(token_ids=pack_int32([1, 2, 3]), tokenizer_id="tok-0")

    async def submit(self, engine: EngineView, request: wire.GenerateRequest, index: int,
                     queue: asyncio.Queue[TextDelta], **_: object) -> Generation:
        self.attempted_at.append(time.monotonic())
        if self.refusals:
            self.refusals -= 1
            raise unavailable("the engine's queue is full", retry_after_s=self.retry_after_s)
        self.submitted.append(request)
        queue.put_nowait(TextDelta(index, "hi", 1, wire.FinishInfo(
            request_id=request.request_id, finish_reason=wire.FinishReason.STOP,
            num_prompt_tokens=3, num_output_tokens=1)))
        return Generation(request.request_id, index, engine.engine_id, "sched-0", "tok-0",
                          queue, finished=True)

    async def abort(self, generations: list[Generation]) -> None:
        pass

    async def release(self, tokenizer_id: str, request_ids: list[str]) -> None:
        pass


def executor(client: FakeMeshClient, retry_for_s: float = 5.0,
             settings: BatchSettings | None = None) -> LineExecutor:
    view = MeshView(stale_after_s=60.0)
    view.on_heartbeat(wire.Heartbeat(
        service="scheduler", instance_id="sched-0", ready=True, engine_id="engine-0",
        engine=wire.EngineInfo(model="m", max_model_len=2048, max_loras=2)))
    ctx = FrontendContext(settings or BatchSettings(), client, view,  # type: ignore[arg-type]
                         GatewayMetrics(CollectorRegistry()))
    return LineExecutor(ctx, priority=1000, retry_for_s=retry_for_s)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], **extra}


def never() -> bool:
    return False


async def test_a_line_runs_at_the_batch_priority_without_streaming() -> None:
    client = FakeMeshClient()
    outcome = await executor(client).run(CHAT, chat(priority=0, stream=True), None, never)
    assert outcome is not None and outcome.status_code == 200
    assert outcome.body["object"] == "chat.completion"
    assert outcome.body["choices"][0]["message"]["content"] == "hi"
    assert outcome.request_id.startswith("chatcmpl-")
    assert [r.priority for r in client.submitted] == [1000]


async def test_a_line_naming_a_lora_adapter_runs_with_it_on_its_base_model() -> None:
    client = FakeMeshClient()
    settings = BatchSettings(lora_modules=["sql=/adapters/sql"])
    outcome = await executor(client, settings=settings).run(CHAT, chat(model="sql"), None,
                                                             never)
    assert outcome is not None and outcome.status_code == 200
    assert outcome.body["model"] == "sql"
    [request] = client.submitted
    assert (request.lora.name, request.lora.path) == ("sql", "/adapters/sql")
    assert request.lora.lora_id > 0


async def test_a_bad_body_gets_the_gateways_400_without_retrying() -> None:
    client = FakeMeshClient()
    outcome = await executor(client).run(CHAT, {"model": "m"}, None, never)
    assert outcome is not None and outcome.status_code == 400
    assert outcome.body["error"]["param"] == "messages" and client.submitted == []


async def test_a_full_queue_is_retried_until_the_engine_takes_the_line() -> None:
    client = FakeMeshClient(refusals=2)
    outcome = await executor(client).run(CHAT, chat(), None, never)
    assert outcome is not None and outcome.status_code == 200 and len(client.submitted) == 1


async def test_a_retry_comes_no_sooner_than_the_refusals_retry_after() -> None:
    client = FakeMeshClient(refusals=1, retry_after_s=0.8)   # longer than the first backoff
    outcome = await executor(client).run(CHAT, chat(), None, never)
    assert outcome is not None and outcome.status_code == 200
    assert client.attempted_at[1] - client.attempted_at[0] >= 0.8


async def test_a_long_retry_after_does_not_hold_up_a_drain() -> None:
    client = FakeMeshClient(refusals=1, retry_after_s=3600.0)
    stop = asyncio.Event()
    line = asyncio.create_task(executor(client, retry_for_s=7200.0).run(
        CHAT, chat(), None, stop.is_set))
    while not client.attempted_at:   # refused once: now waiting out its Retry-After
        await asyncio.sleep(0.01)
    stop.set()
    assert await asyncio.wait_for(line, timeout=5.0) is None


async def test_retries_end_with_the_last_error_or_when_told_to_stop() -> None:
    gave_up = await executor(FakeMeshClient(refusals=100), retry_for_s=0.5).run(
        CHAT, chat(), None, never)
    assert gave_up is not None and gave_up.status_code == 503
    stopped = await executor(FakeMeshClient(refusals=100)).run(CHAT, chat(), None,
                                                               lambda: True)
    assert stopped is None


async def test_a_line_carries_its_tenants_cache_salt_in_front_of_the_clients() -> None:
    keys = ApiKeys(["alpha-key", "beta-key"])
    alpha, beta = keys.identify("Bearer alpha-key"), keys.identify("Bearer beta-key")
    assert alpha is not None and beta is not None
    client = FakeMeshClient()
    for tenant in (alpha, beta, None):
        outcome = await executor(client).run(CHAT, chat(cache_salt="mine"), tenant, never)
        assert outcome is not None and outcome.status_code == 200
    assert [r.cache_salt for r in client.submitted] == [
        alpha.cache_salt("mine"), beta.cache_salt("mine"), "mine"]
    assert len({r.cache_salt for r in client.submitted}) == 3


async def test_a_line_over_its_keys_rate_limit_waits_for_the_bucket() -> None:
    # The bucket holds one line (a 3-token prompt + max_tokens 10) and refills it in 0.3 s:
    # the second line gets 429 first, is retried, and runs.
    tenant = ApiKeys(["k"], tokens_per_minute=2600, burst_tokens=13).identify("Bearer k")
    assert tenant is not None
    client = FakeMeshClient()
    lines = executor(client)
    outcomes = await asyncio.gather(*(lines.run(CHAT, chat(max_tokens=10), tenant, never)
                                      for _ in range(2)))
    assert [o and o.status_code for o in outcomes] == [200, 200] and len(client.submitted) == 2
    gave_up = await executor(client, retry_for_s=0.2).run(CHAT, chat(max_tokens=10), tenant,
                                                          never)
    assert gave_up is not None and gave_up.status_code == 429
    assert gave_up.body["error"]["code"] == "rate_limit_exceeded"
