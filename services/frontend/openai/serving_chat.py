"""POST /v1/chat/completions."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common import wire
from services.frontend.context import FrontendContext
from services.frontend.engine_client.generation import TextDelta
from services.frontend.engine_client.request_run import PromptInput, RequestPlan
from services.frontend.errors import invalid
from services.frontend.openai.chat_tools import ChatOutput, ToolPlan, plan_tools
from services.frontend.openai.choice_state import ChoiceState, finish_reason, stop_reason
from services.frontend.openai.grammar_request import grammar_request
from services.frontend.openai.logprobs import (
    LogprobRow,
    chat_logprob_entries,
    prompt_logprobs_json,
    split_logprobs,
)
from services.frontend.openai.protocol import ChatCompletionRequest, ChatMessage
from services.frontend.openai.reasoning import get_reasoning_parser
from services.frontend.openai.sampling import check_limits, detokenize_params, sampling_params
from services.frontend.openai.serving import OpenAIServing


def chat_prompt(body: ChatCompletionRequest) -> PromptInput:
    try:
        messages = [_wire_message(m) for m in body.messages]
    except ValueError as exc:
        raise invalid(str(exc), param="messages") from None
    # NOTE: with tool_choice "none" the tools still reach the template, as vLLM does: the
    # model sees them; only calls are not parsed out.
    tools = json.dumps([t.model_dump(exclude_none=True) for t in body.tools]) \
        if body.tools else ""
    return PromptInput(
        chat=wire.ChatMessages(messages=messages), tools_json=tools,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens, chat_template=body.chat_template or "",
        chat_template_kwargs_json=json.dumps(body.chat_template_kwargs)
        if body.chat_template_kwargs else "")


def _wire_message(message: ChatMessage) -> wire.ChatMessage:
    calls = json.dumps([c.model_dump(exclude_none=True) for c in message.tool_calls]) \
        if message.tool_calls else ""
    wired = wire.ChatMessage(role=message.role, name=message.name or "",
                             tool_calls_json=calls, tool_call_id=message.tool_call_id or "")
    if message.has_images():   # the tokenizer fetches the images and renders the parts
        wired.content_parts_json = json.dumps(message.parts())
    else:
        wired.content = message.text()
    return wired


@dataclass
class ChatChoice(ChoiceState):
    output: ChatOutput | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_rows: list[LogprobRow] = field(default_factory=list)
    new_logprobs: list[dict[str, Any]] = field(default_factory=list)   # the last delta's


class ChatCompletion(OpenAIServing[ChatCompletionRequest, ChatChoice]):
    """One /v1/chat/completions request from validation to its response."""
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, body: ChatCompletionRequest, ctx: FrontendContext) -> None:
        super().__init__(body, ctx)
        self.num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self.tools: ToolPlan | None = None     # set by plan()

    def plan(self) -> RequestPlan:
        body = self.body
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", param="top_logprobs")
        self.tools = plan_tools(body, self.ctx.settings)
        grammar = grammar_request(body)
        if self.tools is not None and self.tools.is_forced:
            if grammar is not None:
                raise invalid(f"tool_choice {self.tools.mode!r} constrains the output itself: "
                              f"it cannot be combined with {grammar.param}",
                              param="tool_choice")
            grammar = self.tools.grammar()
        if grammar is not None and self.ctx.settings.reasoning_parser:
            # A reasoning model thinks first: the constraint holds for the answer after it.
            parser = get_reasoning_parser(self.ctx.settings.reasoning_parser)
            grammar.spec.reasoning = parser.markers()
        check_limits(body, self.ctx.settings, self.num_logprobs)
        max_tokens = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        return RequestPlan(
            model=body.model, prompts=[chat_prompt(body)], n=body.n, max_tokens=max_tokens,
            make_sampling=lambda mt, seed: sampling_params(
                body, max_tokens=mt, logprobs=self.num_logprobs,
                prompt_logprobs=body.prompt_logprobs, seed=seed),
            make_detokenize=lambda engine_id: detokenize_params(
                body, self.ctx.client.gateway_id, engine_id,
                self.num_logprobs is not None or body.prompt_logprobs is not None),
            seed=body.seed, priority=body.priority, cache_salt=body.cache_salt or "",
            max_tokens_param=param, grammar=grammar)

    def new_choice(self, index: int) -> ChatChoice:
        return ChatChoice(output=ChatOutput(self.tools, self.ctx.settings))

    def add(self, choice: ChatChoice, delta: TextDelta) -> None:
        choice.add(delta)
        # NOTE: split once per delta; the streamed chunk reuses new_logprobs.
        prompt_rows, output_rows = split_logprobs(delta.logprobs)
        choice.new_logprobs = (chat_logprob_entries(output_rows)
                               if self.num_logprobs is not None else [])
        choice.logprobs.extend(choice.new_logprobs)
        if self.body.prompt_logprobs is not None:
            choice.prompt_rows.extend(prompt_rows)

    def response_extras(self, choices: list[ChatChoice]) -> dict[str, Any]:
        # The choices share one prompt; vLLM answers its logprobs and ids once, beside the
        # choices.
        extras = self.opening_chunk_fields()
        if self.body.prompt_logprobs is not None:
            rows = next((c.prompt_rows for c in choices if c.prompt_rows), [])
            extras["prompt_logprobs"] = prompt_logprobs_json(rows)
        return extras

    def opening_chunk_fields(self) -> dict[str, Any]:
        if not self.body.return_token_ids:
            return {}
        return {"prompt_token_ids": self.run.prompt_token_ids(0)}   # the chat-templated ids

    def _logprobs_field(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        return {"content": entries} if self.num_logprobs is not None else None

    def choice_json(self, index: int, choice: ChatChoice) -> dict[str, Any]:
        assert choice.output is not None
        message = choice.output.message(choice.text)
        return {"index": index, "message": message,
                "logprobs": self._logprobs_field(choice.logprobs),
                "finish_reason": _finish_reason(choice.finish, choice.output),
                "stop_reason": stop_reason(choice.finish)}

    def opening_chunk_choices(self, count: int) -> list[dict[str, Any]]:
        # The role comes first, as OpenAI sends it.
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(count)]

    def chunk_choice(self, index: int, choice: ChatChoice,
                     delta: TextDelta) -> dict[str, Any] | None:
        assert choice.output is not None
        entries = choice.new_logprobs
        message = choice.output.delta(delta.text, is_last=delta.finish is not None)
        if (not message and delta.finish is None and not entries
                and not self.carries_token_ids(delta)):
            return None
        return {"index": index, "delta": message,
                "logprobs": self._logprobs_field(entries),
                "finish_reason": _finish_reason(delta.finish, choice.output),
                "stop_reason": stop_reason(delta.finish)}


def _finish_reason(finish: wire.FinishInfo | None, output: ChatOutput) -> str | None:
    reason = finish_reason(finish)
    return "tool_calls" if reason == "stop" and output.called_tools else reason


async def create_chat_completion(body: ChatCompletionRequest, ctx: FrontendContext,
                                 request: Request) -> JSONResponse | StreamingResponse:
    return await ChatCompletion(body, ctx).respond(request)
