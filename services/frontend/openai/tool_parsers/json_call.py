"""A tool call written as JSON, the reads hermes, llama3_json and mistral share."""

from __future__ import annotations

import json
from typing import Any

from services.frontend.openai.tool_parsers.text_cursor import Malformed, Pending, TextCursor

# hermes and mistral models say "arguments", Llama 3.1/3.2 say "parameters".
ARGUMENTS_KEYS = ("arguments", "parameters")


def json_call(cursor: TextCursor) -> Pending[None]:
    """One call as a JSON object: {"name": ..., "arguments": {...}}, other keys skipped.
    The arguments go out as they arrive when the name came first (as models write it),
    else once the object closes; a call with no arguments gets {}."""
    yield from cursor.expect("{")
    name: str | None = None
    arguments: str | None = None
    index: int | None = None                # set once the call went out
    while True:
        key = yield from _json_value(cursor, str)
        yield from cursor.expect(":")
        if key == "name" and name is None:
            name = yield from _json_value(cursor, str)
        elif key in ARGUMENTS_KEYS and arguments is None:
            if name is not None:
                index = yield from json_arguments(cursor, name)
                arguments = ""
            else:
                arguments = yield from cursor.value()
                _loads(arguments, dict)
        else:
            yield from cursor.value()
        if not (yield from cursor.accept(",")):
            break
    yield from cursor.expect("}")
    if name is None:
        raise Malformed("a call without a name")
    if index is None:
        cursor.emit_arguments(cursor.open_call(name), arguments or "{}")


def json_arguments(cursor: TextCursor, name: str) -> Pending[int]:
    """Call `name`'s arguments, a JSON object streamed out as it arrives; the call's index."""
    if (yield from cursor.peek(("{",))) is None:
        raise Malformed("the arguments are not an object")
    index = cursor.open_call(name)
    _loads((yield from cursor.value(stream_to=index)), dict)
    return index


def _json_value(cursor: TextCursor, kind: type) -> Pending[Any]:
    return _loads((yield from cursor.value()), kind)


def _loads(text: str, kind: type) -> Any:
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise Malformed(f"invalid JSON: {exc}") from None
    if not isinstance(value, kind):
        raise Malformed(f"expected a JSON {kind.__name__}")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")         # json.loads takes NaN and Infinity
