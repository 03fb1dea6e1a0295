"""Tool calls out of model text, for chat completions with `tools`.

One parser per model family, under vLLM's names: `parse(text)` for a whole reply, `stream()`
for an object fed text deltas that gives OpenAI content and tool-call deltas. Both run the
same grammar (tool_parser.py, text_cursor.py), so a stream adds up to the whole-text parse.
"""

from __future__ import annotations

from services.frontend.openai.tool_parsers.hermes import HermesToolParser
from services.frontend.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from services.frontend.openai.tool_parsers.mistral import MistralToolParser
from services.frontend.openai.tool_parsers.pythonic import PythonicToolParser
from services.frontend.openai.tool_parsers.tool_call import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    drop_later_calls,
    keep_first_call,
)
from services.frontend.openai.tool_parsers.tool_parser import ToolCallStream, ToolParser

__all__ = ["ContentDelta", "ParsedOutput", "StreamEvent", "ToolCall", "ToolCallDelta",
           "ToolCallStream", "ToolParser", "UnknownToolParser", "drop_later_calls",
           "get_tool_parser", "keep_first_call"]

_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}


class UnknownToolParser(ValueError):
    pass


def get_tool_parser(name: str) -> ToolParser:
    """The parser vLLM calls `name` (`--tool-call-parser`)."""
    parser = _PARSERS.get(name)
    if parser is None:
        raise UnknownToolParser(f"unknown tool parser {name!r}; known: {sorted(_PARSERS)}")
    return parser()
