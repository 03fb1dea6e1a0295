"""Bus.serve(concurrent=True) answers each request in its own task: a request whose handler
waits does not hold up the next (the tokenizer's encode, which may download images)."""

from __future__ import annotations

import asyncio

from llm_mesh.embedded import EmbeddedNats
from services.common import wire
from services.common.bus import Bus


async def test_a_waiting_handler_holds_up_no_other_request() -> None:
    first_arrived, second_arrived = asyncio.Event(), asyncio.Event()

    async def handler(request: wire.DetokenizeRequest) -> wire.DetokenizeReply:
        if request.skip_special_tokens:     # the first request waits for the second
            first_arrived.set()
            await second_arrived.wait()
            return wire.DetokenizeReply(text="first")
        second_arrived.set()
        return wire.DetokenizeReply(text="second")

    with EmbeddedNats() as server:
        bus = await Bus.connect(server.url, "serve-test", retry_for_s=10.0)
        try:
            await bus.serve("test.serve", wire.DetokenizeRequest, handler, concurrent=True)
            first = asyncio.create_task(bus.request(
                "test.serve", wire.DetokenizeRequest(skip_special_tokens=True),
                wire.DetokenizeReply, timeout=10.0))
            await first_arrived.wait()
            second = await bus.request("test.serve", wire.DetokenizeRequest(),
                                       wire.DetokenizeReply, timeout=2.0)
            assert second.text == "second"
            assert (await first).text == "first"
        finally:
            await bus.close()
