"""Pythonic tool calls: a Python list of calls opening the reply, as Llama 3.2 and Llama 4
write them (Llama 4 wraps it in <|python_start|> ... <|python_end|>):

    [get_weather(city="Paris", unit="celsius"), get_time(zone='Europe/Paris')]

Arguments are keyword literals only (ast.literal_eval: no names, calls or expressions),
turned into a JSON object one argument at a time, so they stream as they complete.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from services.frontend.openai.tool_parsers.text_cursor import Malformed, Pending, TextCursor
from services.frontend.openai.tool_parsers.tool_parser import LeadingToolParser

_START, _END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(LeadingToolParser):
    name = "pythonic"
    openings = (_START, "[")

    def calls(self, cursor: TextCursor) -> Pending[None]:
        yield from cursor.accept(_START)
        yield from cursor.expect("[")
        yield from self._call(cursor)
        while (yield from cursor.accept(",")):
            yield from self._call(cursor)
        yield from cursor.expect("]")
        yield from cursor.accept(_END)

    @staticmethod
    def _call(cursor: TextCursor) -> Pending[None]:
        name = yield from cursor.word()
        if not all(part.isidentifier() for part in name.split(".")):
            raise Malformed(f"{name!r} is not a function name")
        yield from cursor.expect("(")
        keys: set[str] = set()
        index: int | None = None            # the call goes out with its first argument
        while not (yield from cursor.accept(")")):
            if keys:
                yield from cursor.expect(",")
            key = yield from cursor.word()
            if not key.isidentifier() or key in keys:
                raise Malformed(f"{key!r} is not a new keyword argument")
            yield from cursor.expect("=")
            value = _literal_to_json((yield from cursor.value(is_python=True)))
            if index is None:
                index = cursor.open_call(name)
            key_json = json.dumps(key, ensure_ascii=False)
            cursor.emit_arguments(index, f'{", " if keys else "{"}{key_json}: {value}')
            keys.add(key)
        if index is None:
            index = cursor.open_call(name)
        cursor.emit_arguments(index, "}" if keys else "{}")


def _literal_to_json(text: str) -> str:
    try:
        value: Any = ast.literal_eval(text)
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise Malformed(f"not a JSON-able Python literal: {text!r}") from exc
