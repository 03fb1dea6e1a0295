"""Turns an OpenAI-style SSE stream into one request's timings and token counts.

Handles completions (`choices[0].text`) and chat (`choices[0].delta.content`) chunks, the
final usage chunk (`stream_options.include_usage`, with `prompt_tokens_details.cached_tokens`
when the server reports prefix-cache hits), `data: [DONE]`, and error events
(`data: {"error": ...}`, or llama.cpp's `error: ...` line). The first token is the first chunk
with text (a chat role chunk is not one); a stream whose tokens all decode to no text (special
tokens under ignore_eos) is timed from its first chunk with choices, as vLLM's bench does.
Per-chunk work is kept small —
one `json.loads` and a few dict lookups — because on a 2-core machine the client shares the
CPUs with the server under test and must not become the bottleneck.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds on `time.perf_counter`."""

    tag: str = ""
    success: bool = False
    error: str = ""
    start_time: float = 0.0
    ttft: float = 0.0                                   # to the first chunk with content
    latency: float = 0.0                                # end to end
    itl: list[float] = field(default_factory=list)      # gaps between content chunks
    prompt_tokens: int = 0                              # usage, else the local count
    output_tokens: int = 0                              # usage, else content chunks
    num_chunks: int = 0
    has_usage: bool = False
    cached_tokens: int | None = None                    # prompt tokens the server had cached
    text: str = ""                                      # the answer, when kept (multi-turn)
    turn: int = 0                                       # multi-turn: 1-based turn; else 0

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None below two tokens (undefined)."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def fail(self, message: str) -> None:
        if not self.error:  # NOTE: keep the first error: later ones are usually its echo
            self.error = message[:500]


class StreamParser:
    """Fed raw body bytes as they arrive; `finish()` settles success and token counts."""

    def __init__(self, result: RequestResult, keep_text: bool = False) -> None:
        self.result = result
        self.is_done = False        # saw `data: [DONE]`
        # NOTE: only a multi-turn session needs the answer back (its next turn's history).
        self._answer: list[str] | None = [] if keep_text else None
        self._buffer = b""
        self._last_token_time = 0.0
        self._first_choice_time: float | None = None

    def feed(self, data: bytes, now: float) -> None:
        buffer = self._buffer + data
        if b"\r" in buffer:  # rare (most servers send bare LF): normalise only when needed
            buffer = buffer.replace(b"\r\n", b"\n")
        *events, self._buffer = buffer.split(b"\n\n")
        for event in events:
            self._on_event(event, now)

    def finish(self, now: float) -> RequestResult:
        if self._buffer.strip():  # a last event without its blank line
            self._on_event(self._buffer.strip(), now)
            self._buffer = b""
        r = self.result
        r.latency = now - r.start_time
        if self._answer is not None:
            r.text = "".join(self._answer)
        if not r.has_usage:
            r.output_tokens = r.num_chunks
        if not r.error and r.num_chunks == 0:
            if self._first_choice_time is not None and r.output_tokens > 0:
                r.ttft = self._first_choice_time - r.start_time  # tokens, but no text
            else:  # no first token: TTFT is undefined
                r.fail(f"the stream carried no generated text ([DONE] "
                       f"{'seen' if self.is_done else 'missing'})")
        r.success = not r.error
        return r

    def _on_event(self, event: bytes, now: float) -> None:
        if event.startswith(b"data: ") and b"\n" not in event:  # the fast, common case
            self._on_data(event[6:], now)
            return
        data, is_error_event = [], False
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
            elif line.startswith(b"error:"):  # llama.cpp's server
                self.result.fail(line[6:].strip().decode(errors="replace"))
            elif line.strip() == b"event: error":
                is_error_event = True
        if is_error_event:
            self.result.fail(b"\n".join(data).decode(errors="replace") or "error event")
        elif data:
            self._on_data(b"\n".join(data), now)

    def _on_data(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            self.is_done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            self.result.fail(f"unparsable SSE data: {data[:100]!r}")
            return
        if not isinstance(chunk, dict):
            return
        if error := chunk.get("error"):
            message = error.get("message", error) if isinstance(error, dict) else error
            self.result.fail(str(message))
            return
        if choices := chunk.get("choices"):
            if self._first_choice_time is None:
                self._first_choice_time = now
            choice = choices[0]
            content, thinking = choice.get("text"), None
            if content is None:
                delta = choice.get("delta") or {}
                content = delta.get("content")
                if not content:  # a reasoning model's thinking: generated, but not the answer
                    thinking = delta.get("reasoning_content") or delta.get("reasoning")
            if content or thinking:
                self._on_token_chunk(now)
                if content and self._answer is not None:
                    self._answer.append(content)
        if usage := chunk.get("usage"):
            r = self.result
            r.has_usage = True
            r.prompt_tokens = usage.get("prompt_tokens", r.prompt_tokens)
            r.output_tokens = usage.get("completion_tokens", r.output_tokens)
            if isinstance(details := usage.get("prompt_tokens_details"), dict):
                r.cached_tokens = details.get("cached_tokens", r.cached_tokens)

    def _on_token_chunk(self, now: float) -> None:
        r = self.result
        if r.num_chunks == 0:
            r.ttft = now - r.start_time
        else:
            r.itl.append(now - self._last_token_time)
        self._last_token_time = now
        r.num_chunks += 1
