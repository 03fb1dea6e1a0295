"""POST /v1/completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.packing import pack_int32
from services.frontend.context import FrontendContext
from services.frontend.engine_client.generation import TextDelta
from services.frontend.engine_client.request_run import PromptInput, RequestPlan
from services.frontend.errors import invalid
from services.frontend.openai.choice_state import ChoiceState, finish_reason, stop_reason
from services.frontend.openai.grammar_request import grammar_request
from services.frontend.openai.logprobs import (
    CompletionLogprobs,
    LogprobRow,
    prompt_logprobs_json,
    split_logprobs,
)
from services.frontend.openai.protocol import CompletionRequest
from services.frontend.openai.sampling import check_limits, detokenize_params, sampling_params
from services.frontend.openai.serving import OpenAIServing


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


@dataclass
class CompletionChoice(ChoiceState):
    logprobs: CompletionLogprobs | None = None
    prompt_rows: list[LogprobRow] = field(default_factory=list)
    echoed: bool = False       # the echoed prompt went out with the first streamed chunk
    sent_prompt_ids: bool = False   # return_token_ids: went out with its first chunk


class Completion(OpenAIServing[CompletionRequest, CompletionChoice]):
    """One /v1/completions request from validation to its response."""
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, body: CompletionRequest, ctx: FrontendContext) -> None:
        super().__init__(body, ctx)
        self.echo_logprobs = body.echo and body.logprobs is not None
        self.prompt_logprobs = body.prompt_logprobs
        if self.echo_logprobs and self.prompt_logprobs is None:
            self.prompt_logprobs = body.logprobs
        self.wants_logprobs = body.logprobs is not None or self.prompt_logprobs is not None
        self.prompt_inputs: list[PromptInput] = []
        self.echo_texts: list[str] | None = None          # per prompt, when echo is set
        self.first_prompt_tokens: list[str] | None = None  # per prompt, for echo + logprobs

    def plan(self) -> RequestPlan:
        body = self.body
        if body.suffix:
            raise invalid("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise invalid("best_of other than n is not supported", param="best_of")
        check_limits(body, self.ctx.settings, body.logprobs)
        self.prompt_inputs = prompt_inputs(body)
        return RequestPlan(
            model=body.model, prompts=self.prompt_inputs, n=body.n, max_tokens=body.max_tokens,
            make_sampling=lambda max_tokens, seed: sampling_params(
                body, max_tokens=max_tokens, logprobs=body.logprobs,
                prompt_logprobs=self.prompt_logprobs, seed=seed),
            make_detokenize=lambda engine_id: detokenize_params(
                body, self.ctx.client.gateway_id, engine_id, self.wants_logprobs),
            seed=body.seed, priority=body.priority, cache_salt=body.cache_salt or "",
            grammar=grammar_request(body))

    async def prepare(self) -> None:
        if self.body.echo:
            self.echo_texts = await self._echo_texts()
        if self.echo_logprobs:
            self.first_prompt_tokens = await self._first_prompt_tokens()

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

    def new_choice(self, index: int) -> CompletionChoice:
        if not self.wants_logprobs:
            return CompletionChoice()
        logprobs = CompletionLogprobs()
        if self.first_prompt_tokens is not None:
            logprobs.add_first_prompt_token(self.first_prompt_tokens[self._prompt_index(index)])
        return CompletionChoice(logprobs=logprobs)

    def add(self, choice: CompletionChoice, delta: TextDelta) -> None:
        choice.add(delta)
        if choice.logprobs is None:
            return
        prompt_rows, output_rows = split_logprobs(delta.logprobs)
        if self.body.prompt_logprobs is not None:
            choice.prompt_rows.extend(prompt_rows)
        if self.echo_logprobs:
            for row in prompt_rows:
                choice.logprobs.add(row)
        if self.body.logprobs is not None:
            for row in output_rows:
                choice.logprobs.add(row)

    def _echo_text(self, index: int) -> str:
        return self.echo_texts[self._prompt_index(index)] if self.echo_texts else ""

    def choice_json(self, index: int, choice: CompletionChoice) -> dict[str, Any]:
        output = {"index": index, "text": self._echo_text(index) + choice.text,
                  "logprobs": choice.logprobs.to_json() if choice.logprobs is not None else None,
                  "finish_reason": finish_reason(choice.finish),
                  "stop_reason": stop_reason(choice.finish)}
        if self.body.prompt_logprobs is not None:
            output["prompt_logprobs"] = prompt_logprobs_json(choice.prompt_rows)
        if self.body.return_token_ids:   # vLLM's: on the choice, as each has its own prompt
            output["prompt_token_ids"] = self.run.prompt_token_ids(self._prompt_index(index))
        return output

    def chunk_choice(self, index: int, choice: CompletionChoice,
                     delta: TextDelta) -> dict[str, Any] | None:
        text = delta.text
        if not choice.echoed:
            text = self._echo_text(index) + text
            choice.echoed = True
        chunk_logprobs = choice.logprobs.take() if choice.logprobs is not None else None
        if (not text and delta.finish is None and not (chunk_logprobs and chunk_logprobs["tokens"])
                and not self.carries_token_ids(delta)):
            return None
        output = {"index": index, "text": text, "logprobs": chunk_logprobs,
                  "finish_reason": finish_reason(delta.finish),
                  "stop_reason": stop_reason(delta.finish)}
        if self.body.return_token_ids and not choice.sent_prompt_ids:
            output["prompt_token_ids"] = self.run.prompt_token_ids(self._prompt_index(index))
            choice.sent_prompt_ids = True
        return output


async def create_completion(body: CompletionRequest, ctx: FrontendContext,
                            request: Request) -> JSONResponse | StreamingResponse:
    return await Completion(body, ctx).respond(request)

