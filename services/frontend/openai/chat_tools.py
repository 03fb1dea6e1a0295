"""Tools in a chat request: what `tool_choice` asks of the engine, and how each choice's
text becomes OpenAI's `content`, `tool_calls` and `reasoning_content`, whole or streamed.

- "none": tools reach the template (the model sees them) but the text is plain content.
- "auto" (the default with tools): the model decides; its calls are parsed out of the text
  with --tool-call-parser.
- "required" / a named function: the output is constrained by a grammar built from the
  tools' parameter schemas, so every call parses and matches its own schema. Named: the
  output is the call's arguments object. Required: a JSON list of {"name", "arguments"}
  (one item when parallel_tool_calls is false), as vLLM does; that is the mistral format
  after its marker, so the mistral parser reads it, streamed arguments in pieces included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.common import wire
from services.frontend.errors import invalid
from services.frontend.openai.grammar_request import GrammarRequest
from services.frontend.openai.protocol import ChatCompletionRequest, NamedToolChoice
from services.frontend.openai.reasoning import (
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from services.frontend.openai.tool_parsers import (
    ContentDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    drop_later_calls,
    get_tool_parser,
    keep_first_call,
)
from services.frontend.openai.tool_parsers.tool_call import make_tool_call_id
from services.frontend.settings import FrontendSettings

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# A "required" output is a JSON list of calls: the mistral format after this marker.
REQUIRED_CALLS_PARSER, REQUIRED_CALLS_MARKER = "mistral", "[TOOL_CALLS]"


@dataclass(frozen=True)
class ToolPlan:
    mode: str                              # "none" | "auto" | "required" | "named"
    tools: dict[str, dict[str, Any]]       # function name -> its parameters schema
    parallel: bool
    parser: ToolParser | None = None       # auto and required
    function: str | None = None            # named
    marker: str = ""                       # required: what the parser expects before calls

    @property
    def is_forced(self) -> bool:
        return self.mode in ("required", "named")

    def grammar(self) -> GrammarRequest:
        """The constraint a forced choice puts on the output."""
        if self.function is not None:
            schema = self.tools[self.function]
        else:
            call_schemas = [{"type": "object", "properties": {
                "name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"], "additionalProperties": False}
                for name, parameters in self.tools.items()]
            schema = {"type": "array", "minItems": 1,
                      "items": call_schemas[0] if len(call_schemas) == 1
                      else {"anyOf": call_schemas}}
            if not self.parallel:
                schema["maxItems"] = 1
        return GrammarRequest(wire.GrammarSpec(kind=wire.GrammarKind.JSON_SCHEMA,
                                               spec=json.dumps(schema)), "tool_choice")



def plan_tools(body: ChatCompletionRequest, settings: FrontendSettings) -> ToolPlan | None:
    """What the request's tools and tool_choice ask for (None: no tools); 400 on misuse."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools", param="tool_choice")
        return None
    tools = {t.function.name: t.function.parameters or ANY_OBJECT for t in body.tools}
    if len(tools) != len(body.tools):
        raise invalid("tool names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.name not in tools:
            raise invalid(f"tool_choice names {choice.name!r}, which is not among the tools",
                          param="tool_choice")
        return ToolPlan("named", tools, body.parallel_tool_calls, function=choice.name)
    mode = choice or "auto"
    if mode == "auto":
        if not settings.enable_auto_tool_choice:
            raise invalid('tool_choice "auto" needs the server started with '
                          '--enable-auto-tool-choice', param="tool_choice")
        return ToolPlan("auto", tools, body.parallel_tool_calls,
                        parser=get_tool_parser(settings.tool_call_parser))
    if mode == "required":
        return ToolPlan(mode, tools, body.parallel_tool_calls,
                        parser=get_tool_parser(REQUIRED_CALLS_PARSER),
                        marker=REQUIRED_CALLS_MARKER)
    return ToolPlan(mode, tools, body.parallel_tool_calls)


class ChatOutput:
    """One choice's message: reasoning, content and tool calls out of the model's text."""

    def __init__(self, plan: ToolPlan | None, settings: FrontendSettings) -> None:
        self.plan = plan
        self.reasoning: ReasoningParser | None = (
            get_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser
            else None)
        self._reasoning_stream: ReasoningStream | None = None
        self._tool_stream: ToolCallStream | None = None
        self._num_calls = 0

    # ---- the whole message

    def message(self, text: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            split = self.reasoning.parse(text)
            message["reasoning_content"] = message["reasoning"] = split.reasoning
            message["content"] = text = split.content or ""
        calls: list[ToolCall] = []
        if self.plan is not None and self.plan.function is not None:
            calls = [ToolCall(self.plan.function, text.strip())]
            message["content"] = None
        elif self.plan is not None and self.plan.parser is not None:
            parsed = self.plan.parser.parse(self.plan.marker + text)
            if not self.plan.parallel:
                parsed = keep_first_call(parsed)
            calls, message["content"] = parsed.tool_calls, parsed.content
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        self._num_calls = len(calls)
        return message

    @property
    def called_tools(self) -> bool:
        return self._num_calls > 0

    # ---- streamed deltas

    def delta(self, text: str, is_last: bool) -> dict[str, Any]:
        """The delta message for new text (`is_last`: the choice ends with it)."""
        content, reasoning = text, ""
        if self.reasoning is not None:
            if self._reasoning_stream is None:
                self._reasoning_stream = self.reasoning.stream()
            split = self._reasoning_stream.feed(text)
            if is_last:
                rest = self._reasoning_stream.finish()
                split.reasoning += rest.reasoning
                split.content += rest.content
            content, reasoning = split.content, split.reasoning
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if self.plan is None or self.plan.mode == "none":
            if content:
                delta["content"] = content
            return delta
        calls = self._call_deltas(content, is_last, delta)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _call_deltas(self, text: str, is_last: bool,
                     delta: dict[str, Any]) -> list[dict[str, Any]]:
        assert self.plan is not None
        if self.plan.function is not None:      # named: the text is the arguments
            first = self._num_calls == 0
            # NOTE: the call opens with its first arguments, so not while the model reasons.
            if not text and not (first and is_last):
                return []
            self._num_calls = 1
            call = (ToolCallDelta(0, text, id=make_tool_call_id(), name=self.plan.function)
                    if first else ToolCallDelta(0, text))
            return [call.to_openai()]
        assert self.plan.parser is not None
        if self._tool_stream is None:
            self._tool_stream = self.plan.parser.stream()
            text = self.plan.marker + text
        events = (self._tool_stream.finish(text) if is_last else self._tool_stream.feed(text))
        if not self.plan.parallel:
            events = drop_later_calls(events)
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        if content:
            delta["content"] = content
        calls = [e for e in events if isinstance(e, ToolCallDelta)]
        self._num_calls = max([self._num_calls] + [c.index + 1 for c in calls])
        return [c.to_openai() for c in calls]
