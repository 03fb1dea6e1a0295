"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.packing import pack_int32
from services.gateway.auth import tenant_of
from services.gateway.context import GatewayContext
from services.gateway.errors import invalid
from services.gateway.generation import GenerationPlan, PromptInput
from services.gateway.logprobs import CompletionLogprobs, split_logprobs
from services.gateway.protocol import CompletionRequest
from services.gateway.responses import (SSE_DONE, ChoiceState, error_of, finish_reason, sse,
                                        stop_reason, until_disconnect, usage)
from services.gateway.sampling import check_limits, detokenize_params, sampling_params


def prompt_inputs(body: CompletionRequest) -> list[PromptInput]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [PromptInput(prompt=prompt, add_special_tokens=body.add_special_tokens)]
    if not prompt:
        raise invalid("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [PromptInput(token_ids=pack_int32(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [PromptInput(prompt=p, add_special_tokens=body.add_special_tokens) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise invalid("token prompts must not be empty", param="prompt")
        return [PromptInput(token_ids=pack_int32(p)) for p in prompt]
    raise invalid("prompt must be a string, a list of strings, or token ids", param="prompt")


class Completion:
    """One /v1/completions request from validation to its response."""

    def __init__(self, body: CompletionRequest, ctx: GatewayContext) -> None:
        self.body = body
        self.ctx = ctx
        self.run = ctx.new_run("cmpl", body.model)
        self.echo_logprobs = body.echo and body.logprobs is not None
        self.prompt_logprobs = body.prompt_logprobs
        if self.echo_logprobs and self.prompt_logprobs is None:
            self.prompt_logprobs = body.logprobs
        self.wants_logprobs = body.logprobs is not None or self.prompt_logprobs is not None
        self.prompt_inputs: list[PromptInput] = []
        self.echo_texts: list[str] | None = None          # per prompt, when echo is set
        self.first_prompt_tokens: list[str] | None = None  # per prompt, for echo + logprobs

    def plan(self) -> GenerationPlan:
        body = self.body
        if body.suffix:
            raise invalid("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise invalid("best_of other than n is not supported", param="best_of")
        check_limits(body, self.ctx.settings, body.logprobs)
        self.prompt_inputs = prompt_inputs(body)
        return GenerationPlan(
            model=body.model, prompts=self.prompt_inputs, n=body.n, max_tokens=body.max_tokens,
            make_sampling=lambda max_tokens, seed: sampling_params(
                body, max_tokens=max_tokens, logprobs=body.logprobs,
                prompt_logprobs=self.prompt_logprobs, seed=seed),
            make_detokenize=lambda engine_id: detokenize_params(
                body, self.ctx.client.gateway_id, engine_id, self.wants_logprobs),
            seed=body.seed, priority=body.priority, cache_salt=body.cache_salt or "")

    async def respond(self, request: Request) -> JSONResponse | StreamingResponse:
        await self.run.start(self.plan(), tenant_of(request))
        try:
            if self.body.echo:
                self.echo_texts = await self._echo_texts()
            if self.echo_logprobs:
                self.first_prompt_tokens = await self._first_prompt_tokens()
        except BaseException:
            await self.run.close()
            raise
        if self.body.stream:
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return JSONResponse(await until_disconnect(request, self._collect(), self.run))

    # ---- echo

    async def _echo_texts(self) -> list[str]:
        texts = []
        for index, prompt in enumerate(self.prompt_inputs):
            if prompt.prompt is not None:
                texts.append(prompt.prompt)
            else:
                texts.append(await self.ctx.client.detokenize(self.run.prompts[index].token_ids))
        return texts

    async def _first_prompt_tokens(self) -> list[str]:
        firsts = []
        for prompt in self.run.prompts:
            firsts.append(await self.ctx.client.detokenize(prompt.token_ids[:4]))
        return firsts

    def _prompt_index(self, choice_index: int) -> int:
        return choice_index // self.body.n

    # ---- responses

    def _choice_logprobs(self, choice_index: int) -> CompletionLogprobs | None:
        if not self.wants_logprobs:
            return None
        logprobs = CompletionLogprobs()
        if self.first_prompt_tokens is not None:
            logprobs.add_first_prompt_token(self.first_prompt_tokens[self._prompt_index(choice_index)])
        return logprobs

    def _apply(self, delta_logprobs: CompletionLogprobs | None, entries: list) -> None:
        if delta_logprobs is None:
            return
        prompt_rows, output_rows = split_logprobs(entries)
        if self.echo_logprobs:
            for row in prompt_rows:
                delta_logprobs.add(row)
        if self.body.logprobs is not None:
            for row in output_rows:
                delta_logprobs.add(row)

    async def _collect(self) -> dict[str, Any]:
        count = len(self.run.generations)
        choices = [ChoiceState() for _ in range(count)]
        logprobs = [self._choice_logprobs(i) for i in range(count)]
        async for delta in self.run.deltas():
            if (error := error_of(delta)) is not None:
                raise error
            choices[delta.index].add(delta)
            self._apply(logprobs[delta.index], delta.logprobs)
        return {
            "id": self.run.request_id, "object": "text_completion", "created": self.run.created,
            "model": self.body.model,
            "choices": [{
                "index": i,
                "text": (self.echo_texts[self._prompt_index(i)] if self.echo_texts else "") + c.text,
                "logprobs": logprobs[i].to_json() if logprobs[i] is not None else None,
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
        logprobs = [self._choice_logprobs(i) for i in range(count)]
        echoed = [False] * count
        try:
            async for delta in self.run.deltas():
                if (error := error_of(delta)) is not None:
                    yield sse(error.body())
                    break
                i = delta.index
                choices[i].add(delta)
                self._apply(logprobs[i], delta.logprobs)
                text = delta.text
                if self.echo_texts is not None and not echoed[i]:
                    text = self.echo_texts[self._prompt_index(i)] + text
                    echoed[i] = True
                chunk_logprobs = logprobs[i].take() if logprobs[i] is not None else None
                if not text and delta.finish is None and not (chunk_logprobs and chunk_logprobs["tokens"]):
                    continue
                chunk = self._chunk([{"index": i, "text": text, "logprobs": chunk_logprobs,
                                      "finish_reason": finish_reason(delta.finish),
                                      "stop_reason": stop_reason(delta.finish)}])
                if include_usage:
                    chunk["usage"] = usage(self.run, choices) if continuous else None
                yield sse(chunk)
            else:
                if include_usage:
                    final = self._chunk([])
                    final["usage"] = usage(self.run, choices)
                    yield sse(final)
            yield SSE_DONE
        finally:
            await self.run.close()

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.run.request_id, "object": "text_completion",
                "created": self.run.created, "model": self.body.model, "choices": choices}


async def create_completion(body: CompletionRequest, ctx: GatewayContext,
                            request: Request) -> JSONResponse | StreamingResponse:
    return await Completion(body, ctx).respond(request)

