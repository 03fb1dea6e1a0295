"""One response's run: its chat request through the mesh, every event it streams (numbered
from 0, as OpenAI numbers them), and the response object as it stands at each point."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from services.frontend.context import FrontendContext
from services.frontend.engine_client.generation import Generation, TextDelta
from services.frontend.errors import ApiError
from services.frontend.openai.choice_state import error_of, finish_reason, usage
from services.frontend.openai.responses_api.items import Message, chat_request, input_item_list
from services.frontend.openai.responses_api.protocol import ResponsesRequest
from services.frontend.openai.responses_api.response_output import Event, ResponseOutput
from services.frontend.openai.responses_api.resume import Checkpoint, ResumeState
from services.frontend.openai.serving import request_deadline_s, session_id
from services.frontend.openai.serving_chat import ChatChoice, ChatCompletion
from services.frontend.tenancy.auth import tenant_of

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed",
                             "response.cancelled"})


class _ResponseChat(ChatCompletion):
    id_prefix = "resp"


class ResponseRun:
    def __init__(self, body: ResponsesRequest, ctx: FrontendContext,
                 conversation: list[Message]) -> None:
        self.body = body
        self.conversation = conversation   # the stored history, then this input
        self.input_items = input_item_list(body)
        self._chat = _ResponseChat(chat_request(body, conversation), ctx)
        self.output = ResponseOutput()
        self.status = "queued"
        self.failure: ApiError | None = None
        self._usage: dict[str, Any] | None = None
        self._incomplete: dict[str, str] | None = None
        self._sequence = 0
        self._choice: ChatChoice | None = None   # set once output is read (or replayed)
        # The output tokens and text consumed since the last checkpoint; `checkpoint` holds
        # them on the event that closes a delta (resume.py), else None.
        self._new_tokens = 0
        self._new_text = ""
        self._num_tokens = 0
        self.checkpoint: tuple[list[int], str] | None = None
        self.cancel_requested = False   # a background run's cancel (POST .../cancel)

    @classmethod
    def resumed(cls, body: ResponsesRequest, ctx: FrontendContext,
                conversation: list[Message], response: dict[str, Any],
                generation: Generation, checkpoint: Checkpoint) -> ResponseRun:
        """The run another gateway started, rebuilt here to its checkpoint; its generation
        is this run's, to be moved here (migration.py)."""
        run = cls(body, ctx, conversation)
        run._chat.plan()   # the tool and reasoning parsers the output is read with
        run._chat.run.request_id, run._chat.run.created = response["id"], response["created_at"]
        run._chat.run.adopt(generation)
        run.status = "in_progress"
        run.output = ResponseOutput(known_ids=checkpoint.item_ids)
        run._choice = run._chat.new_choice(0)
        run._read(TextDelta(0, checkpoint.text, len(checkpoint.token_ids)))   # replayed
        run._take_checkpoint()   # the replayed output is the first gateway's checkpoint
        run._sequence = checkpoint.sequence + 1
        return run

    @property
    def generation(self) -> Generation:
        return self._chat.run.generations[0]

    @property
    def id(self) -> str:
        return self._chat.run.request_id

    async def start(self, request: Request) -> None:
        """Validates and submits the request (400 / 503 here, before any event)."""
        plan = self._chat.plan()
        plan.deadline_s = request_deadline_s(request, self._chat.ctx.settings.request_deadline_s)
        plan.session_id = session_id(request, self.body.prompt_cache_key)
        await self._chat.run.start(plan, tenant_of(request))

    async def close(self) -> None:
        """Stops the run where it is (the engine frees it); a finished run is untouched."""
        await self._chat.run.close()

    async def events(self) -> AsyncIterator[Event]:
        """Every event of the response from where it stands, through its terminal one;
        closes the run."""
        try:
            if self._choice is None:
                yield self._numbered({"type": "response.created", "response": self.response()})
                self.status = "in_progress"
                yield self._numbered({"type": "response.in_progress",
                                      "response": self.response()})
                self._choice = self._chat.new_choice(0)
            choice = self._choice
            async for delta in self._chat.run.deltas():
                if (error := error_of(delta)) is not None:
                    for event in self._failed(error):
                        yield event
                    return
                events = self._read(delta)
                for i, event in enumerate(events):
                    self.checkpoint = self._take_checkpoint() if i == len(events) - 1 else None
                    yield self._numbered(event)
            self.checkpoint = None
            cut = finish_reason(choice.finish) == "length"
            for event in self.output.finish(incomplete=cut):
                yield self._numbered(event)
            self._usage = _response_usage(usage(self._chat.run, [choice]))
            self.status = "incomplete" if cut else "completed"
            if cut:
                self._incomplete = {"reason": "max_output_tokens"}
            yield self._numbered({"type": f"response.{self.status}", "response": self.response()})
        finally:
            await self._chat.run.close()

    def _read(self, delta: TextDelta) -> list[Event]:
        """Adds a delta to the choice; the events of what it makes visible."""
        assert self._choice is not None and self._choice.output is not None
        self._chat.add(self._choice, delta)
        self._new_tokens += delta.num_new_tokens
        self._new_text += delta.text
        return self.output.add(self._choice.output.delta(delta.text,
                                                         is_last=delta.finish is not None))

    def _take_checkpoint(self) -> tuple[list[int], str]:
        start = self._num_tokens
        self._num_tokens += self._new_tokens
        checkpoint = (self.generation.output_token_ids[start:self._num_tokens], self._new_text)
        self._new_tokens, self._new_text = 0, ""
        return checkpoint

    def resume_state(self) -> ResumeState:
        return ResumeState.of(self.generation)

    def cancelled_event(self) -> Event:
        """The terminal event of a run cancelled part way (its followers stop on it)."""
        self.status = "cancelled"
        return self._numbered({"type": "response.cancelled", "response": self.response()})

    def _failed(self, error: ApiError) -> list[Event]:
        self.failure = error
        self.status = "failed"
        return [self._numbered({"type": "error", "code": error.code or "server_error",
                                "message": error.message, "param": error.param}),
                self._numbered({"type": "response.failed", "response": self.response()})]

    def _numbered(self, event: Event) -> Event:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return event

    def response(self) -> dict[str, Any]:
        """The response object as it stands now."""
        body = self.body
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self._chat.run.created,
            "status": self.status, "background": body.background,
            "error": ({"code": self.failure.code or "server_error",
                       "message": self.failure.message} if self.failure else None),
            "incomplete_details": self._incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "model": body.model, "output": copy.deepcopy(self.output.items),
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": (choice or "auto") if isinstance(choice, str | None)
            else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled", "usage": self._usage,
            "user": body.user}


def _response_usage(chat: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]
                                     ["cached_tokens"]},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}
