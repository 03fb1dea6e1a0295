"""Prefill/decode disaggregation at the gateway (vLLM's disaggregated-prefill proxy).

When the model has a ready producer engine (--kv-role producer) and a ready consumer engine
(--kv-role consumer), each prompt first runs on the producer as a prefill-only request
(do_remote_decode: one greedy token, discarded) that finishes once the kvstore holds the
prompt's KV; then the request proper goes to a consumer, which loads that KV instead of
computing it. A prefill that fails or times out costs only that: the consumer computes what
the store lacks, so the client's request never fails because of this stage.
"""

from __future__ import annotations

import asyncio

import structlog

from services.common import wire
from services.frontend.engine_client.generation import Generation, TextDelta
from services.frontend.engine_client.mesh_client import MeshClient
from services.frontend.engine_client.mesh_view import EngineView
from services.frontend.errors import ApiError

log = structlog.get_logger(__name__)


def prefill_request_id(request_id: str, prompt_index: int) -> str:
    """The id of a prompt's prefill request (registered with the tokenizer at encode, so its
    finish reaches this gateway like any request's)."""
    return f"{request_id}-{prompt_index}-prefill"


async def prefill_remotely(client: MeshClient, producer: EngineView, model: str,
                           requests: list[wire.GenerateRequest], timeout_s: float) -> None:
    """Runs the prefill requests (`as_prefill`, one per prompt) on the producer and waits,
    at most timeout_s, until every one finished."""
    queue: asyncio.Queue[TextDelta] = asyncio.Queue()
    generations: list[Generation] = []
    for index, request in enumerate(requests):
        try:
            generations.append(await client.submit(producer, request, index, queue,
                                                   model=model))
        except ApiError as exc:
            log.info("prefill engine refused a request; the decode engine computes it",
                     request_id=request.request_id, engine=producer.engine_id, error=exc.message)
    remaining = len(generations)
    try:
        async with asyncio.timeout(timeout_s):
            while remaining:
                delta = await queue.get()
                if delta.finish is not None:
                    remaining -= 1
                    if delta.finish.finish_reason == wire.FinishReason.ERROR:
                        log.info("prefill failed; the decode engine computes it",
                                 request_id=delta.finish.request_id, error=delta.finish.error)
    except TimeoutError:
        log.warning("prefill timed out; the decode engine computes it", timeout_s=timeout_s,
                    engine=producer.engine_id)
        await client.abort(generations)


def as_prefill(request: wire.GenerateRequest, prefill_id: str) -> wire.GenerateRequest:
    """A prompt's prefill-only twin: same tokens and cache salt (so the same block hashes),
    one greedy token that nobody reads."""
    return wire.GenerateRequest(
        request_id=prefill_id, prompt_token_ids=request.prompt_token_ids,
        sampling=wire.SamplingParams(max_tokens=1, top_p=1.0), priority=request.priority,
        cache_salt=request.cache_salt, tokenizer_id=request.tokenizer_id,
        arrival_time=request.arrival_time, do_remote_decode=True, lora=request.lora,
        mm_items=request.mm_items)
