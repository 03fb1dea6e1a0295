"""The Responses API on the real mesh, through the official openai client: the answer equals
the chat completion of the same conversation, streamed events add up to the whole response,
stored responses chain with previous_response_id, tools and text.format constrain the output,
input items are listed in pages, background responses are polled, resumed from any event
and cancelled, and misuse is a 400 or a 404."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from services.common.ports import free_port
from tests.mesh import Mesh, http_get

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather",
                "description": "The current weather in a city", "parameters": WEATHER}
LONG_ANSWER = "Write a long story about a dragon and a knight, with many details."


def chat_text(client: openai.OpenAI, model: str, messages: list[dict[str, Any]],
              max_tokens: int) -> str:
    out = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                         max_tokens=max_tokens)
    return out.choices[0].message.content or ""


def test_the_answer_is_the_chat_completion_of_the_same_conversation(
        client: openai.OpenAI, model_name: str) -> None:
    response = client.responses.create(model=model_name, instructions="Answer briefly.",
                                       input="What is the capital of France?",
                                       temperature=0, max_output_tokens=24)
    assert response.status in ("completed", "incomplete") and response.id.startswith("resp")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == chat_text(client, model_name, [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"}], 24)
    assert response.output_text
    usage = response.usage
    assert usage is not None and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_streamed_events_add_up_to_the_whole_response(client: openai.OpenAI,
                                                      model_name: str) -> None:
    whole = client.responses.create(model=model_name, input="Name three colours.",
                                    temperature=0, max_output_tokens=20, store=False)
    events = list(client.responses.create(model=model_name, input="Name three colours.",
                                          temperature=0, max_output_tokens=20, store=False,
                                          stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text and deltas
    assert events[-1].response.output_text == whole.output_text


def test_a_stored_response_continues_with_previous_response_id(client: openai.OpenAI,
                                                               model_name: str) -> None:
    first = client.responses.create(model=model_name, input="My name is Ada.", temperature=0,
                                    max_output_tokens=16)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=model_name, previous_response_id=first.id,
                                     input="What is my name?", temperature=0,
                                     max_output_tokens=16)
    assert second.previous_response_id == first.id
    assert second.output_text == chat_text(client, model_name, [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], 16)
    [listed] = client.responses.input_items.list(second.id).data
    assert listed.type == "message" and listed.role == "user"
    assert [part.text for part in listed.content] == ["What is my name?"]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_a_named_tool_choice_calls_the_tool_and_its_output_goes_back(
        client: openai.OpenAI, model_name: str) -> None:
    question = "What is the weather in Paris?"
    response = client.responses.create(
        model=model_name, input=question, tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=60)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(
        model=model_name, tools=[WEATHER_TOOL], temperature=0,  # type: ignore[list-item]
        max_output_tokens=16, tool_choice="none",
        input=[{"role": "user", "content": question},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "sunny, 21 degrees"}])
    assert answer.output_text and answer.output[0].type == "message"


def test_input_items_list_in_pages(client: openai.OpenAI, model_name: str) -> None:
    turns = [{"role": "user", "content": f"Message {i}."} for i in range(5)]
    response = client.responses.create(model=model_name, input=turns,  # type: ignore[arg-type]
                                       temperature=0, max_output_tokens=4)
    newest_first = client.responses.input_items.list(response.id)
    texts = [item.content[0].text for item in newest_first.data]
    assert texts == [f"Message {i}." for i in reversed(range(5))]
    first = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.content[0].text for item in first.data] == ["Message 0.", "Message 1."]
    assert first.has_more
    rest = client.responses.input_items.list(response.id, order="asc", after=first.data[-1].id)
    assert [item.content[0].text for item in rest.data] == [f"Message {i}." for i in (2, 3, 4)]
    assert not rest.has_more


def test_a_json_schema_text_format_gives_matching_json(client: openai.OpenAI,
                                                       model_name: str) -> None:
    response = client.responses.create(
        model=model_name, input="Give the weather in Tokyo as JSON.", temperature=0,
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}})
    jsonschema.validate(json.loads(response.output_text), WEATHER)


def wait_for_status(client: openai.OpenAI, response_id: str, done: set[str]) -> Any:
    deadline = time.monotonic() + 120
    while (response := client.responses.retrieve(response_id)).status not in done:
        assert time.monotonic() < deadline, f"still {response.status}"
        time.sleep(0.1)
    return response


def test_a_background_response_is_polled_to_its_end(client: openai.OpenAI,
                                                    model_name: str) -> None:
    started = client.responses.create(model=model_name, input="Name three fruits.",
                                      temperature=0, max_output_tokens=20, background=True)
    assert started.status in ("queued", "in_progress") and started.background
    done = wait_for_status(client, started.id, {"completed", "incomplete"})
    foreground = client.responses.create(model=model_name, input="Name three fruits.",
                                         temperature=0, max_output_tokens=20, store=False)
    assert done.output_text == foreground.output_text and done.output_text


def test_a_background_stream_resumes_after_any_event(client: openai.OpenAI,
                                                     model_name: str) -> None:
    stream = client.responses.create(model=model_name, input="Name five animals.",
                                     temperature=0, max_output_tokens=40, background=True,
                                     stream=True)
    head = []
    for event in stream:
        head.append(event)
        if event.type == "response.output_text.delta" and len(head) >= 8:
            break
    stream.close()   # the client goes away; the response runs on
    response_id = head[0].response.id
    tail = list(client.responses.retrieve(response_id, stream=True,
                                          starting_after=head[-1].sequence_number))
    numbers = [e.sequence_number for e in head + tail]
    assert numbers == list(range(len(numbers)))   # nothing lost, nothing twice
    text = "".join(e.delta for e in head + tail if e.type == "response.output_text.delta")
    final = client.responses.retrieve(response_id)
    assert text == final.output_text and text


def test_a_background_stream_outlives_its_gateway(mesh: Mesh, client: openai.OpenAI,
                                                  model_name: str) -> None:
    """Streamed through gateway A, A killed mid-stream, resumed through gateway B: the text
    equals an uninterrupted run's, every event once."""
    port = free_port()
    gateway_a = mesh.add_service("gateway-a", ["--port", str(port)], kind="gateway")
    try:
        deadline = time.monotonic() + 30
        while http_get(f"http://127.0.0.1:{port}/health")[0] != 200:   # it sees the engine
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=120) as client_a:
            head = []
            for event in client_a.responses.create(model=model_name, input=LONG_ANSWER,
                                                   temperature=0, max_output_tokens=80,
                                                   background=True, stream=True):
                head.append(event)
                if event.type == "response.output_text.delta" and len(head) >= 12:
                    break
            gateway_a.stop(signal.SIGKILL)   # the run dies with it, mid-generation
    finally:
        mesh.services.pop("gateway-a").stop()
    response_id = head[0].response.id
    tail = list(client.responses.retrieve(response_id, stream=True,
                                          starting_after=head[-1].sequence_number))
    numbers = [e.sequence_number for e in head + tail]
    assert numbers == list(range(len(numbers)))
    assert tail[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in head + tail if e.type == "response.output_text.delta")
    uninterrupted = client.responses.create(model=model_name, input=LONG_ANSWER, temperature=0,
                                            max_output_tokens=80, store=False)
    assert text == uninterrupted.output_text
    assert client.responses.retrieve(response_id).output_text == text


def test_a_background_response_is_cancelled(client: openai.OpenAI, model_name: str) -> None:
    started = client.responses.create(model=model_name, input=LONG_ANSWER, temperature=0,
                                      max_output_tokens=400, background=True)
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(started.id).status == "cancelled"


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tool type 'web_search'"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     400, "input_image"),
    ({"input": "hi", "previous_response_id": "resp-nope"}, 404, "resp-nope"),
    ({"input": "hi", "background": True, "store": False}, 400, "store"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "call_id"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "schema"),
])
def test_misuse_is_a_clear_error(mesh: Mesh, model_name: str, body: dict[str, Any],
                                 status: int, needle: str) -> None:
    reply = httpx.post(f"{mesh.base_url}/v1/responses", json={"model": model_name, **body},
                       timeout=60)
    assert reply.status_code == status, reply.text
    assert needle in reply.json()["error"]["message"]
