"""Images at the gateway: a message with image_url parts goes to the tokenizer as its parts in
order (content_parts_json), for chat completions and /tokenize alike; other part types stay a
400; a refused image comes back as a 400 whose `param` is the tokenizer's error_param."""

from __future__ import annotations

import json
from typing import Any

import httpx2 as httpx
from prometheus_client import CollectorRegistry

from services.common import wire
from services.common.metrics import GatewayMetrics
from services.common.packing import pack_int32
from services.common.subjects import Subjects
from services.frontend.context import FrontendContext
from services.frontend.engine_client.mesh_client import MeshClient
from services.frontend.engine_client.mesh_view import MeshView
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings

IMAGE = {"type": "image_url", "image_url": {"url": "https://images.example/cat.png",
                                            "detail": "low"}}
PARTS = [{"type": "text", "text": "What is "}, IMAGE, {"type": "text", "text": "?"}]
PARAM = "messages[1].content[1].image_url.url"


class FakeTokenizerBus:
    """A tokenizer that answers every encode with `reply` and records what it was sent."""

    def __init__(self, reply: wire.EncodeReply) -> None:
        self.reply = reply
        self.encoded: list[wire.EncodeRequest] = []

    async def request(self, subject: str, message: Any, reply_type: type,
                      timeout: float) -> wire.EncodeReply:
        assert isinstance(message, wire.EncodeRequest), subject
        self.encoded.append(message)
        return self.reply


def gateway(bus: FakeTokenizerBus) -> httpx.AsyncClient:
    view = MeshView(stale_after_s=60.0)
    view.on_heartbeat(wire.Heartbeat(service="scheduler", instance_id="s0", ready=True,
                                     engine_id="e0", engine=wire.EngineInfo(model="m")))
    client = MeshClient(bus, Subjects("test"), "g1", view, 5.0, 5.0)  # type: ignore[arg-type]
    ctx = FrontendContext(GatewaySettings(), client, view, GatewayMetrics(CollectorRegistry()))
    app = create_app(ctx, CollectorRegistry())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def chat_body(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": parts}]}


async def test_a_refused_image_is_a_400_naming_the_tokenizers_param() -> None:
    bus = FakeTokenizerBus(wire.EncodeReply(error="image host 'x' is not in the allowed "
                                            "media domains", error_param=PARAM))
    async with gateway(bus) as http:
        response = await http.post("/v1/chat/completions", json=chat_body(PARTS))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == PARAM and "allowed media domains" in error["message"]
    assert error["type"] == "invalid_request_error"
    [sent] = bus.encoded
    system, user = sent.chat.messages
    assert (system.content, system.content_parts_json) == ("Be brief.", "")
    assert user.content == "" and json.loads(user.content_parts_json) == PARTS


async def test_tokenize_sends_image_parts_too() -> None:
    bus = FakeTokenizerBus(wire.EncodeReply(token_ids=pack_int32([1, 2, 2, 3]),
                                            tokenizer_id="t1"))
    async with gateway(bus) as http:
        response = await http.post("/tokenize", json={"model": "m", "messages": [
            {"role": "user", "content": [IMAGE, {"type": "text", "text": "Describe it."}]}]})
    assert response.status_code == 200 and response.json()["tokens"] == [1, 2, 2, 3]
    [sent] = bus.encoded
    assert json.loads(sent.chat.messages[0].content_parts_json) == [
        IMAGE, {"type": "text", "text": "Describe it."}]


async def test_text_parts_alone_stay_one_string_and_other_parts_stay_refused() -> None:
    bus = FakeTokenizerBus(wire.EncodeReply(error="stop here"))
    async with gateway(bus) as http:
        await http.post("/v1/chat/completions", json=chat_body(
            [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]))
        audio = await http.post("/v1/chat/completions", json=chat_body(
            [IMAGE, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]))
    [sent] = bus.encoded
    assert (sent.chat.messages[1].content, sent.chat.messages[1].content_parts_json) == ("ab", "")
    assert audio.status_code == 400
    assert "input_audio" in audio.json()["error"]["message"]
