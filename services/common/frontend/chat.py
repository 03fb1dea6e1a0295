"""POST /v1/chat/completions."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common import wire
from services.common.frontend.context import FrontendContext
from services.common.frontend.errors import invalid
from services.common.frontend.generation import GenerationPlan, PromptInput
from services.common.frontend.handler import GenerationHandler
from services.common.frontend.logprobs import (
    LogprobRow,
    chat_logprob_entries,
    prompt_logprobs_json,
    split_logprobs,
)
from services.common.frontend.mesh_client import TextDelta
from services.common.frontend.protocol import ChatCompletionRequest
from services.common.frontend.responses import ChoiceState, finish_reason, stop_reason
from services.common.frontend.sampling import check_limits, detokenize_params, sampling_params
from services.common.frontend.structured_outputs import grammar_request


def chat_prompt(body: ChatCompletionRequest) -> PromptInput:
    try:
        messages = [wire.ChatMessage(role=m.role, content=m.text(), name=m.name or "")
                    for m in body.messages]
    except ValueError as exc:
        raise invalid(str(exc), param="messages") from None
    return PromptInput(
        chat=wire.ChatMessages(messages=messages),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens, chat_template=body.chat_template or "",
        chat_template_kwargs_json=json.dumps(body.chat_template_kwargs)
        if body.chat_template_kwargs else "")


@dataclass
class ChatChoice(ChoiceState):
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_rows: list[LogprobRow] = field(default_factory=list)


class ChatCompletion(GenerationHandler[ChatCompletionRequest, ChatChoice]):
    """One /v1/chat/completions request from validation to its response."""
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, body: ChatCompletionRequest, ctx: FrontendContext) -> None:
        super().__init__(body, ctx)
        self.num_logprobs = (body.top_logprobs or 0) if body.logprobs else None

    def plan(self) -> GenerationPlan:
        body = self.body
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", param="top_logprobs")
        if body.tools and body.tool_choice != "none":
            raise invalid("tool calling is not supported yet", param="tools")
        check_limits(body, self.ctx.settings, self.num_logprobs)
        max_tokens = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        return GenerationPlan(
            model=body.model, prompts=[chat_prompt(body)], n=body.n, max_tokens=max_tokens,
            make_sampling=lambda mt, seed: sampling_params(
                body, max_tokens=mt, logprobs=self.num_logprobs,
                prompt_logprobs=body.prompt_logprobs, seed=seed),
            make_detokenize=lambda engine_id: detokenize_params(
                body, self.ctx.client.gateway_id, engine_id,
                self.num_logprobs is not None or body.prompt_logprobs is not None),
            seed=body.seed, priority=body.priority, cache_salt=body.cache_salt or "",
            max_tokens_param=param, grammar=grammar_request(body))

    def _logprobs_of(self, entries: list[wire.TokenLogprobs]) -> list[dict[str, Any]]:
        if self.num_logprobs is None:
            return []
        _, output_rows = split_logprobs(entries)
        return chat_logprob_entries(output_rows)

    def new_choice(self, index: int) -> ChatChoice:
        return ChatChoice()

    def add(self, choice: ChatChoice, delta: TextDelta) -> None:
        choice.add(delta)
        choice.logprobs.extend(self._logprobs_of(delta.logprobs))
        if self.body.prompt_logprobs is not None:
            prompt_rows, _ = split_logprobs(delta.logprobs)
            choice.prompt_rows.extend(prompt_rows)

    def response_extras(self, choices: list[ChatChoice]) -> dict[str, Any]:
        if self.body.prompt_logprobs is None:
            return {}
        # The choices share one prompt; vLLM answers its logprobs once, beside the choices.
        rows = next((c.prompt_rows for c in choices if c.prompt_rows), [])
        return {"prompt_logprobs": prompt_logprobs_json(rows)}

    def _logprobs_field(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        return {"content": entries} if self.num_logprobs is not None else None

    def choice_json(self, index: int, choice: ChatChoice) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": self._logprobs_field(choice.logprobs),
                "finish_reason": finish_reason(choice.finish),
                "stop_reason": stop_reason(choice.finish)}

    def opening_chunk_choices(self, count: int) -> list[dict[str, Any]]:
        # The role comes first, as OpenAI sends it.
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(count)]

    def chunk_choice(self, index: int, choice: ChatChoice,
                     delta: TextDelta) -> dict[str, Any] | None:
        entries = self._logprobs_of(delta.logprobs)
        if not delta.text and delta.finish is None and not entries:
            return None
        return {"index": index, "delta": {"content": delta.text} if delta.text else {},
                "logprobs": self._logprobs_field(entries),
                "finish_reason": finish_reason(delta.finish),
                "stop_reason": stop_reason(delta.finish)}


async def create_chat_completion(body: ChatCompletionRequest, ctx: FrontendContext,
                                 request: Request) -> JSONResponse | StreamingResponse:
    return await ChatCompletion(body, ctx).respond(request)
