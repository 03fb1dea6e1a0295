"""Mistral tool calls after [TOOL_CALLS], content before them. Two forms:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
        (Mistral 7B v0.3, Nemo, Small 3.1: tokenizers before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
        (v11 and later: Small 3.2, Magistral, Devstral; [ARGS] is gone when the
        detokenizer skips special tokens, and [CALL_ID]id may precede it)
"""

from __future__ import annotations

from services.frontend.openai.tool_parsers.json_call import json_arguments, json_call
from services.frontend.openai.tool_parsers.text_cursor import Pending, TextCursor
from services.frontend.openai.tool_parsers.tool_parser import MarkerToolParser


class MistralToolParser(MarkerToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def calls(self, cursor: TextCursor) -> Pending[None]:
        opening = yield from cursor.peek(("[", "{"))
        if opening is None:
            yield from self._named_call(cursor)
        elif opening == "{":
            yield from json_call(cursor)
        else:
            yield from cursor.expect("[")
            yield from json_call(cursor)
            while (yield from cursor.accept(",")):
                yield from json_call(cursor)
            yield from cursor.expect("]")

    @staticmethod
    def _named_call(cursor: TextCursor) -> Pending[None]:
        name = yield from cursor.word()
        if (yield from cursor.accept("[CALL_ID]")):
            yield from cursor.word()
        yield from cursor.accept("[ARGS]")
        yield from json_arguments(cursor, name)
