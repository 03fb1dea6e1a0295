"""A Responses request as the chat request it runs as: input items become chat messages
(after the stored conversation of `previous_response_id`), flat function tools become chat
tools, `text.format` becomes `response_format`. Chat validation then applies unchanged, so
tools, tool_choice and structured outputs behave as in /v1/chat/completions."""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import ValidationError

from services.frontend.errors import invalid
from services.frontend.openai.protocol import ChatCompletionRequest
from services.frontend.openai.responses_api.protocol import (
    InputContentPart,
    InputItem,
    ResponsesRequest,
)

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
SKIPPED_ITEMS = frozenset({"reasoning", "item_reference"})   # nothing in them to replay

Message = dict[str, Any]   # a chat message, as /v1/chat/completions takes it


def input_messages(body: ResponsesRequest) -> list[Message]:
    """The request's `input` as chat messages (the instructions are not among them: they
    hold for this response only, so a later turn does not inherit them)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[Message] = []
    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        if item.type == "message":
            if item.role is None:
                raise invalid("a message item needs a role", param=f"{param}.role")
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content, param)})
        elif item.type == "function_call":
            _add_call(messages, item, param)
        elif item.type == "function_call_output":
            if not item.call_id:
                raise invalid("a function_call_output item needs its call_id",
                              param=f"{param}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, param)})
        elif item.type not in SKIPPED_ITEMS:
            raise invalid(f"input item type {item.type!r} is not supported; send messages, "
                          f"function_call and function_call_output items", param=param)
    return messages


def input_item_list(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as the items `GET /v1/responses/{id}/input_items` lists: each
    with an id and a status, a message's text as content parts (call it after
    input_messages, which validates the input)."""
    if isinstance(body.input, str):
        return [_message_item("user", [{"type": "input_text", "text": body.input}])]
    listed: list[dict[str, Any]] = []
    for item in body.input:
        if item.type == "message":
            content = item.content
            parts = ([{"type": "input_text", "text": content or ""}]
                     if content is None or isinstance(content, str)
                     else [{"type": p.type, "text": p.text or ""} for p in content])
            listed.append(_message_item(item.role or "user", parts))
        elif item.type == "function_call":
            listed.append({"id": _new_id("fc"), "type": "function_call", "status": "completed",
                           "call_id": item.call_id, "name": item.name,
                           "arguments": item.arguments or "{}"})
        elif item.type == "function_call_output":
            output = item.output if isinstance(item.output, str) else "".join(
                p.text or "" for p in item.output or [])
            listed.append({"id": _new_id("fco"), "type": "function_call_output",
                           "status": "completed", "call_id": item.call_id, "output": output})
    return listed


def _message_item(role: str, parts: list[dict[str, str]]) -> dict[str, Any]:
    return {"id": _new_id("msg"), "type": "message", "status": "completed", "role": role,
            "content": parts}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _add_call(messages: list[Message], item: InputItem, param: str) -> None:
    """A call the model made: on the assistant message just before it when there is one
    (the model's text, then its calls, is one chat turn), else on a message of its own."""
    if not item.call_id or not item.name:
        raise invalid("a function_call item needs call_id and name", param=param)
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments or "{}"}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text(content: str | list[InputContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    unsupported = [p.type for p in content if p.type not in TEXT_PARTS]
    if unsupported:
        raise invalid(f"content part type {unsupported[0]!r} is not supported; send "
                      f"input_text parts", param=param)
    return "".join(p.text or "" for p in content)


def chat_request(body: ResponsesRequest, conversation: list[Message]) -> ChatCompletionRequest:
    """The chat request that produces this response: the instructions, then `conversation`
    (the stored history and this input)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "model": body.model, "messages": system + conversation,
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "seed": body.seed, "user": body.user,
        "prompt_cache_key": body.prompt_cache_key, "response_format": _response_format(body)}
    if body.tools:
        fields["tools"] = [_chat_tool(t.model_dump(exclude_none=True), i)
                           for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise invalid(f"{error['msg']} (at {'.'.join(map(str, error['loc']))})") from None


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function" or "name" not in tool:
        raise invalid(f"tool type {tool.get('type')!r} is not supported; only function "
                      f"tools (with a name) are", param=f"tools[{index}]")
    function = {k: v for k, v in tool.items() if k != "type"}
    return {"type": "function", "function": function}


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    format_ = body.text.format
    if format_.type == "text":
        return None
    if format_.type == "json_object":
        return {"type": "json_object"}
    if format_.json_schema is None:
        raise invalid("text.format of type json_schema needs a schema", param="text.format")
    return {"type": "json_schema",
            "json_schema": {"name": format_.name or "response", "schema": format_.json_schema}}
