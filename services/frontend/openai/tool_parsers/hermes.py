"""Hermes tool calls: Hermes 2 Pro/3, Qwen2, Qwen2.5, Qwen3, and our tool_use.jinja.

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from services.frontend.openai.tool_parsers.json_call import json_call
from services.frontend.openai.tool_parsers.text_cursor import Malformed, Pending, TextCursor
from services.frontend.openai.tool_parsers.tool_parser import MarkerToolParser


class HermesToolParser(MarkerToolParser):
    name = "hermes"
    marker = "<tool_call>"

    def calls(self, cursor: TextCursor) -> Pending[None]:
        yield from json_call(cursor)
        # NOTE: a reply that ends at the stop token may lack the closing tag; that call stands.
        if not (yield from cursor.accept("</tool_call>")) and not (yield from cursor.at_end()):
            raise Malformed("expected </tool_call>")
