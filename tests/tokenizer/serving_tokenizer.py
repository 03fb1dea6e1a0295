"""A tokenizer service in the test's process on a real nats-server, asked over NATS as the
gateway asks it; and chat requests with image parts."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common import wire
from services.common.bus import Bus
from services.common.mm_inputs import MultiModalInputs
from services.tokenizer.service import TokenizerService
from services.tokenizer.settings import TokenizerSettings


@dataclass
class ServingTokenizer:
    service: TokenizerService
    client: Bus
    store: MultiModalInputs

    async def encode(self, request: wire.EncodeRequest) -> wire.EncodeReply:
        return await self.client.request(self.service.subjects.tokenizer_encode, request,
                                         wire.EncodeReply, timeout=30.0)


@asynccontextmanager
async def serving_tokenizer(nats_url: str, model: Path | str,
                            **settings: Any) -> AsyncIterator[ServingTokenizer]:
    """The service set up (NATS subscriptions, model, image step) in its own namespace."""
    service = TokenizerService(TokenizerSettings(
        nats_url=nats_url, namespace=f"t{secrets.token_hex(4)}", model=str(model), **settings))
    service.bus = await Bus.connect(nats_url, service.instance_id, retry_for_s=10.0)
    client = await Bus.connect(nats_url, "test-gateway", retry_for_s=10.0)
    try:
        await service.setup()
        store = await MultiModalInputs.open(client.client.jetstream(), service.subjects)
        yield ServingTokenizer(service, client, store)
    finally:
        await service.background.close()
        await service.close()
        await service.bus.close()
        await client.close()


def chat_request(*parts: dict[str, Any], request_id: str = "chat-1") -> wire.EncodeRequest:
    """One user message of these content parts (as the gateway sends a message with images),
    with a generation prompt, registering detokenizer state for `request_id`."""
    message = wire.ChatMessage(role="user", content_parts_json=json.dumps(list(parts)))
    return wire.EncodeRequest(chat=wire.ChatMessages(messages=[message]),
                              add_generation_prompt=True, request_ids=[request_id],
                              detokenize=wire.DetokenizeParams(gateway_id="gateway-1"))


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def template_view(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    """The same message as HF's processors are given it: images as {"type": "image"}."""
    return [{"role": "user", "content": [
        {"type": "image"} if part["type"] == "image_url" else part for part in parts]}]
