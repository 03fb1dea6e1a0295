"""Streams send an SSE comment line (`: keep-alive`) while nothing else goes out for
--sse-keepalive-s: a quiet engine (a long prefill, a request being moved) and output the
client does not see yet both count as quiet."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from services.common import wire
from services.common.metrics import GatewayMetrics
from services.common.subjects import Subjects
from services.frontend.context import FrontendContext
from services.frontend.engine_client.generation import Generation, TextDelta
from services.frontend.engine_client.mesh_client import MeshClient
from services.frontend.engine_client.mesh_view import MeshView
from services.frontend.openai.protocol import CompletionRequest
from services.frontend.openai.serving_completion import Completion
from services.frontend.settings import FrontendSettings

KEEPALIVE = b": keep-alive\n\n"


class FakeBus:
    """An engine that accepts every submit; aborts go nowhere."""

    async def request(self, subject: str, message: object, reply_type: type,
                      timeout: float) -> wire.SubmitReply:
        return wire.SubmitReply(accepted=True)

    async def publish(self, subject: str, message: object) -> None:
        pass


async def streaming_completion(keepalive_s: float) -> tuple[Completion, Generation]:
    """A streamed /v1/completions request with one choice running on a fake engine."""
    view = MeshView(stale_after_s=60.0)
    view.on_heartbeat(wire.Heartbeat(service="scheduler", instance_id="s0", ready=True,
                                     engine_id="e0", engine=wire.EngineInfo(model="m")))
    client = MeshClient(FakeBus(), Subjects("test"), "g1", view, 5.0, 5.0)  # type: ignore[arg-type]
    settings = FrontendSettings(sse_keepalive_s=keepalive_s)
    ctx = FrontendContext(settings, client, view, GatewayMetrics(CollectorRegistry()))
    handler = Completion(CompletionRequest(model="m", prompt="x", stream=True), ctx)
    generation = await client.submit(view.ready_engines()[0],
                                     wire.GenerateRequest(request_id="cmpl-1-0-0"), 0,
                                     handler.run._queue)
    handler.run.generations.append(generation)
    return handler, generation


async def send(generation: Generation, steps: list[tuple[float, str]]) -> None:
    """Each (pause, text) as one delta after the pause; the last one finishes the choice."""
    for i, (pause_s, text) in enumerate(steps):
        await asyncio.sleep(pause_s)
        finish = wire.FinishInfo(finish_reason=wire.FinishReason.LENGTH) \
            if i == len(steps) - 1 else None
        generation.queue.put_nowait(TextDelta(0, text, 1, finish))


async def collect(handler: Completion, generation: Generation,
                  steps: list[tuple[float, str]]) -> list[bytes]:
    sender = asyncio.create_task(send(generation, steps))
    lines = [line async for line in handler._stream()]
    await sender
    return lines


async def test_a_quiet_stream_gets_keepalive_comments_and_a_busy_one_none() -> None:
    handler, generation = await streaming_completion(0.1)
    lines = await collect(handler, generation, [(0.0, "a"), (0.45, "b"), (0.02, "c"),
                                                (0.02, "")])
    kinds = [b"keep-alive" if line == KEEPALIVE else line[:6] for line in lines]
    quiet = kinds[1:kinds.index(b"data: ", 1)]
    # About one per 0.1 s of the quiet 0.45 s (fewer on a loaded machine), none otherwise.
    assert len(quiet) >= 2 and set(quiet) == {b"keep-alive"}, kinds
    assert kinds[-4:] == [b"data: "] * 4 and lines[-1] == b"data: [DONE]\n\n"


async def test_output_the_client_does_not_see_yet_counts_as_quiet() -> None:
    handler, generation = await streaming_completion(0.1)
    invisible = [(0.03, "")] * 15      # 0.45 s of deltas with nothing to send
    lines = await collect(handler, generation, [(0.0, "a"), *invisible, (0.0, "b")])
    assert lines.count(KEEPALIVE) >= 2, lines


async def test_keepalives_are_off_at_zero() -> None:
    handler, generation = await streaming_completion(0.0)
    lines = await collect(handler, generation, [(0.0, "a"), (0.3, "b")])
    assert KEEPALIVE not in lines and lines[-1] == b"data: [DONE]\n\n"
