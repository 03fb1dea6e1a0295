"""POST /v1/chat/completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common import wire
from services.gateway.auth import tenant_of
from services.gateway.context import GatewayContext
from services.gateway.errors import invalid
from services.gateway.generation import GenerationPlan, PromptInput
from services.gateway.logprobs import chat_logprob_entries, split_logprobs
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.responses import (SSE_DONE, ChoiceState, error_of, finish_reason, sse,
                                        stop_reason, until_disconnect, usage)
from services.gateway.sampling import check_limits, detokenize_params, sampling_params


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


class ChatCompletion:
    """One /v1/chat/completions request from validation to its response."""

    def __init__(self, body: ChatCompletionRequest, ctx: GatewayContext) -> None:
        self.body = body
        self.ctx = ctx
        self.run = ctx.new_run("chatcmpl", body.model)
        self.num_logprobs = (body.top_logprobs or 0) if body.logprobs else None

    def plan(self) -> GenerationPlan:
        body = self.body
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", param="top_logprobs")
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            raise invalid("response_format other than text is not supported yet",
                          param="response_format")
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
                body, self.ctx.client.gateway_id, engine_id, self.num_logprobs is not None),
            seed=body.seed, priority=body.priority, cache_salt=body.cache_salt or "",
            max_tokens_param=param)

    async def respond(self, request: Request) -> JSONResponse | StreamingResponse:
        await self.run.start(self.plan(), tenant_of(request))
        if self.body.stream:
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return JSONResponse(await until_disconnect(request, self._collect(), self.run))

    def _logprobs_of(self, entries: list[wire.TokenLogprobs]) -> list[dict[str, Any]]:
        if self.num_logprobs is None:
            return []
        _, output_rows = split_logprobs(entries)
        return chat_logprob_entries(output_rows)

    async def _collect(self) -> dict[str, Any]:
        count = len(self.run.generations)
        choices = [ChoiceState() for _ in range(count)]
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(count)]
        async for delta in self.run.deltas():
            if (error := error_of(delta)) is not None:
                raise error
            choices[delta.index].add(delta)
            logprobs[delta.index].extend(self._logprobs_of(delta.logprobs))
        return {
            "id": self.run.request_id, "object": "chat.completion", "created": self.run.created,
            "model": self.body.model,
            "choices": [{
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": logprobs[i]} if self.num_logprobs is not None else None,
                "finish_reason": finish_reason(c.finish), "stop_reason": stop_reason(c.finish),
            } for i, c in enumerate(choices)],
            "usage": usage(self.run, choices),
        }

    async def _stream(self) -> AsyncIterator[bytes]:
        options = self.body.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options is not None and options.continuous_usage_stats
        count = len(self.run.generations)
        choices = [ChoiceState() for _ in range(count)]
        try:
            for i in range(count):  # the role comes first, as OpenAI sends it
                yield sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}],
                                      include_usage))
            async for delta in self.run.deltas():
                if (error := error_of(delta)) is not None:
                    yield sse(error.body())
                    break
                i = delta.index
                choices[i].add(delta)
                entries = self._logprobs_of(delta.logprobs)
                if not delta.text and delta.finish is None and not entries:
                    continue
                chunk = self._chunk([{
                    "index": i, "delta": {"content": delta.text} if delta.text else {},
                    "logprobs": {"content": entries} if self.num_logprobs is not None else None,
                    "finish_reason": finish_reason(delta.finish),
                    "stop_reason": stop_reason(delta.finish)}], include_usage)
                if continuous:
                    chunk["usage"] = usage(self.run, choices)
                yield sse(chunk)
            else:
                if include_usage:
                    final = self._chunk([], include_usage)
                    final["usage"] = usage(self.run, choices)
                    yield sse(final)
            yield SSE_DONE
        finally:
            await self.run.close()

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.run.request_id, "object": "chat.completion.chunk",
                                 "created": self.run.created, "model": self.body.model,
                                 "choices": choices}
        if include_usage:
            chunk["usage"] = None
        return chunk


async def create_chat_completion(body: ChatCompletionRequest, ctx: GatewayContext,
                                 request: Request) -> JSONResponse | StreamingResponse:
    return await ChatCompletion(body, ctx).respond(request)
