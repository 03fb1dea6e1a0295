"""A step's output lost in flight (what a NATS restart can do to core-NATS messages):
the receiver notices from the output positions every batch carries, and the gateway moves
the request from the last token it has, so the client's stream continues with no hole.

A real loss cannot be timed, so the test stands in for one: it watches the real traffic
and, while streams run, delivers one batch that starts far past where the request's stream
ends (exactly what a receiver sees after losing the batches between) — once to a tokenizer,
as from an engine, and once to the gateway, as from a tokenizer."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import nats
import pytest

from services.common import wire
from services.common.packing import pack_int32, pack_strings, pack_uint8, unpack_strings
from tests.faults.conftest import bodies, gateway_metric
from tests.faults.streams import StreamSet
from tests.mesh import Mesh

pytestmark = pytest.mark.slow

FAR_AHEAD = 10_000   # an output position no request of this test reaches


@dataclass
class Seen:
    subject: str
    engine_id: str
    request_id: str


async def _watch_and_forge(nats_url: str, namespace: str) -> tuple[str, str]:
    """Waits for a delta batch to a tokenizer and a text batch to the gateway, naming two
    different requests, and follows each with a forged batch far ahead; returns the two
    request ids (the one forged to the tokenizer first)."""
    client = await nats.connect(nats_url)
    deltas: asyncio.Queue[Seen] = asyncio.Queue()
    texts: asyncio.Queue[Seen] = asyncio.Queue()

    async def on_delta(msg) -> None:  # noqa: ANN001
        batch = wire.RequestDeltaBatch().parse(msg.data)
        for request_id in unpack_strings(batch.request_ids):
            deltas.put_nowait(Seen(msg.subject, batch.engine_id, request_id))

    async def on_text(msg) -> None:  # noqa: ANN001
        for request_id in unpack_strings(wire.TextOutputBatch().parse(msg.data).request_ids):
            texts.put_nowait(Seen(msg.subject, "", request_id))

    try:
        await client.subscribe(f"{namespace}.tokenizer.*.deltas", cb=on_delta)
        await client.subscribe(f"{namespace}.gateway.*.outputs", cb=on_text)
        to_tokenizer = await asyncio.wait_for(deltas.get(), 30)
        await client.publish(to_tokenizer.subject, bytes(wire.RequestDeltaBatch(
            engine_id=to_tokenizer.engine_id, step=1 << 40,
            request_ids=pack_strings([to_tokenizer.request_id]),
            num_new_tokens=pack_int32([1]), new_token_ids=pack_int32([42]),
            finish_reasons=pack_uint8([wire.FinishReason.NONE]),
            num_cached_tokens=pack_int32([0]), output_positions=pack_int32([FAR_AHEAD]))))
        to_gateway = await asyncio.wait_for(texts.get(), 30)
        while to_gateway.request_id.split(".m")[0] == to_tokenizer.request_id.split(".m")[0]:
            to_gateway = await asyncio.wait_for(texts.get(), 30)
        await client.publish(to_gateway.subject, bytes(wire.TextOutputBatch(
            request_ids=pack_strings([to_gateway.request_id]), texts=pack_strings(["HOLE"]),
            num_new_tokens=pack_int32([1]), token_ids=pack_int32([42]),
            finish_reasons=pack_uint8([wire.FinishReason.NONE]),
            output_positions=pack_int32([FAR_AHEAD]))))
        await client.flush()
        return to_tokenizer.request_id, to_gateway.request_id
    finally:
        await client.close()


def test_a_lost_output_batch_moves_the_request_without_a_hole(
        fault_mesh: Mesh, reference: list[str]) -> None:
    assert fault_mesh.nats is not None
    moved = gateway_metric(fault_mesh, "llm_mesh:request_migrations_total", outcome="moved")
    streams = StreamSet(fault_mesh.base_url, bodies())
    streams.wait_for_chunks(2)
    forged = asyncio.run(_watch_and_forge(fault_mesh.nats.url, fault_mesh.namespace))
    results = streams.finish(120)
    assert [r.outcome() for r in results] == ["completed (length)"] * len(results)
    assert [r.text for r in results] == reference      # no hole, nothing duplicated
    assert all("HOLE" not in r.text for r in results)
    moves = [json.loads(line) for line in
             fault_mesh.services["gateway"].log_path.read_text().splitlines()
             if '"request moved"' in line and "lost in flight" in line]
    assert {m["request_id"] for m in moves} >= set(forged)
    assert gateway_metric(fault_mesh, "llm_mesh:request_migrations_total",
                          outcome="moved") - moved >= 2
