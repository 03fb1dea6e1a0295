"""What completions and chat responses share about their choices: each choice's output as
it arrives, its finish reason (and vLLM's stop_reason), an engine error as the API's, and
the usage of the whole request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common import wire
from services.frontend.engine_client.generation import TextDelta
from services.frontend.engine_client.request_run import RequestRun
from services.frontend.errors import ApiError, deadline_exceeded, invalid, unavailable

FINISH_REASON_NAMES = {
    wire.FinishReason.STOP: "stop",
    wire.FinishReason.LENGTH: "length",
    wire.FinishReason.ABORT: "abort",
}


@dataclass
class ChoiceState:
    """One choice's output as it arrives."""
    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish: wire.FinishInfo | None = None
    token_ids: list[int] = field(default_factory=list)

    def add(self, delta: TextDelta) -> None:
        self.text_parts.append(delta.text)
        self.num_tokens += delta.num_new_tokens
        self.token_ids += delta.token_ids
        if delta.finish is not None:
            self.finish = delta.finish

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def finish_reason(finish: wire.FinishInfo | None) -> str | None:
    return None if finish is None else FINISH_REASON_NAMES.get(finish.finish_reason)


def stop_reason(finish: wire.FinishInfo | None) -> str | int | None:
    """vLLM's extra field: the stop string or stop token id that ended the choice."""
    if finish is None or finish.finish_reason != wire.FinishReason.STOP:
        return None
    if finish.stop_reason:
        return finish.stop_reason
    return finish.stop_token_id


def error_of(delta: TextDelta) -> ApiError | None:
    if delta.finish is not None and delta.finish.finish_reason == wire.FinishReason.ERROR:
        code = delta.finish.error_code
        if code == "invalid_request":    # its own input (a grammar no token continues)
            return invalid(f"the request cannot be completed: {delta.finish.error}")
        if code == "deadline_exceeded":
            return deadline_exceeded()
        return unavailable(delta.finish.error or "the engine failed the request",
                           code="engine_error")
    return None


def usage(run: RequestRun, choices: list[ChoiceState]) -> dict[str, Any]:
    completion_tokens = sum(c.num_tokens for c in choices)
    cached = max((c.finish.num_cached_tokens for c in choices if c.finish), default=0)
    return {"prompt_tokens": run.num_prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": run.num_prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}
