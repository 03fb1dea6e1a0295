"""Llama 3.1/3.2 JSON tool calls, opening the reply (after <|python_tag|> when the
detokenizer keeps special tokens), several joined by ';':

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}
"""

from __future__ import annotations

from services.frontend.openai.tool_parsers.json_call import json_call
from services.frontend.openai.tool_parsers.text_cursor import Pending, TextCursor
from services.frontend.openai.tool_parsers.tool_parser import LeadingToolParser

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(LeadingToolParser):
    name = "llama3_json"
    openings = (_PYTHON_TAG, "{")

    def calls(self, cursor: TextCursor) -> Pending[None]:
        yield from cursor.accept(_PYTHON_TAG)
        yield from json_call(cursor)
        while (yield from cursor.accept(";")):
            yield from json_call(cursor)
