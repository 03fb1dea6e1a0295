"""Tool-call parsers on the outputs models really write, and the stream against the whole text:
for any split of a text, the deltas add up to what parse() gives."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.openai.tool_parsers import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCallDelta,
    ToolParser,
    UnknownToolParser,
    drop_later_calls,
    get_tool_parser,
    keep_first_call,
)

Calls = list[tuple[str, dict[str, Any]]]


def sample(name: str, parser_name: str, text: str, content: str | None,
           calls: Calls) -> Any:
    """A model output, with the content and calls (name, arguments object) it holds."""
    return pytest.param(parser_name, text, content, calls, id=f"{parser_name}-{name}")


SAMPLES = [
    sample("qwen2.5-one-call", "hermes",
           '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": '
           '"San Francisco, CA", "unit": "fahrenheit"}}\n</tool_call>',
           None, [("get_current_weather", {"location": "San Francisco, CA",
                                           "unit": "fahrenheit"})]),
    sample("qwen2.5-parallel-after-content", "hermes",
           "I'll check both cities.\n\n<tool_call>\n"
           '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>',
           "I'll check both cities.",
           [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "東京"})]),
    sample("qwen3-after-thinking", "hermes",
           "<think>\nThe user wants the time; I should call get_time.\n</think>\n\n"
           '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
           "<think>\nThe user wants the time; I should call get_time.\n</think>",
           [("get_time", {})]),
    sample("markers-and-unicode-in-strings", "hermes",
           '<tool_call>\n{"name": "render", "arguments": {"html": "<tool_call>x</tool_call>", '
           '"code": "print(\\"}\\")", "emoji": "café ☕ 😀", "esc": "\\u00e9"}}\n</tool_call>',
           None, [("render", {"html": "<tool_call>x</tool_call>", "code": 'print("}")',
                              "emoji": "café ☕ 😀", "esc": "é"})]),
    sample("nested-arguments-then-content", "hermes",
           '<tool_call>\n{"name": "search", "arguments": {"filter": {"and": [{"field": '
           '"price", "lt": 100.5}, {"tags": ["a", "b"]}]}, "limit": 10, "exact": false, '
           '"cursor": null}}\n</tool_call>\n\nDone.',
           "Done.", [("search", {"filter": {"and": [{"field": "price", "lt": 100.5},
                                                    {"tags": ["a", "b"]}]},
                                 "limit": 10, "exact": False, "cursor": None})]),
    sample("no-arguments", "hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>',
           None, [("get_time", {})]),
    sample("unclosed-at-end", "hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}',
           None, [("f", {"a": 1})]),
    sample("plain-text-with-tags", "hermes", "a < b, and <b>bold</b> <tool_call",
           "a < b, and <b>bold</b> <tool_call", []),
    sample("llama3.1-parameters", "llama3_json",
           '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
           None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    sample("python-tag", "llama3_json",
           '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}',
           None, [("get_weather", {"city": "Zürich"})]),
    sample("two-calls-semicolon", "llama3_json",
           '{"type": "function", "name": "a", "parameters": {"x": [1, {"y": "};"}]}}; '
           '{"name": "b", "parameters": {}}',
           None, [("a", {"x": [1, {"y": "};"}]}), ("b", {})]),
    sample("json-answer-is-content", "llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    sample("plain-text", "llama3_json", '  The capital of France is Paris. {"name": "x"}',
           '  The capital of France is Paris. {"name": "x"}', []),
    sample("v0.3-list", "mistral",
           '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": '
           '"get_current_weather", "arguments": {"city": "San Francisco", "state": "CA"}}]',
           None, [("add", {"a": 3.5, "b": 4}),
                  ("get_current_weather", {"city": "San Francisco", "state": "CA"})]),
    sample("content-before-with-id", "mistral",
           'Hello[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}, '
           '"id": "abc123xyz"}]',
           "Hello", [("add", {"a": 1, "b": 2})]),
    sample("arguments-before-name", "mistral",
           '[TOOL_CALLS][{"arguments": {"name": "John Doe"}, "name": "get_age"}]',
           None, [("get_age", {"name": "John Doe"})]),
    sample("v11-two-calls", "mistral",
           '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]multiply[ARGS]{"a": 3}',
           None, [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3})]),
    sample("v11-special-tokens-skipped", "mistral",
           'hi{hi[TOOL_CALLS]bash{"command": "print(\\"[TOOL_CALLS]\\")\\nre.compile('
           "r'{}')\"}",
           "hi{hi", [("bash", {"command": "print(\"[TOOL_CALLS]\")\nre.compile(r'{}')"})]),
    sample("v11-call-id", "mistral",
           '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
           None, [("get_weather", {"city": "Paris"})]),
    sample("llama3.2-two-calls", "pythonic",
           '[get_weather(city="San Francisco", metric="celsius"), '
           "get_time(zone='Europe/Paris')]",
           None, [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
                  ("get_time", {"zone": "Europe/Paris"})]),
    sample("llama4-wrapped", "pythonic",
           '<|python_start|>[search(query="东京 weather ☔")]<|python_end|>',
           None, [("search", {"query": "东京 weather ☔"})]),
    sample("python-literals", "pythonic",
           "[f(a=True, b=None, c=[1, 2.5, 'x'], d={'k': (1, 2)}, e=-3, "
           "s='it\\'s (a) [b], c=d', t=\"\"\"multi\nline\"\"\", r=r'\\d+'), get_time()]",
           None, [("f", {"a": True, "b": None, "c": [1, 2.5, "x"], "d": {"k": [1, 2]},
                         "e": -3, "s": "it's (a) [b], c=d", "t": "multi\nline", "r": "\\d+"}),
                  ("get_time", {})]),
    sample("markdown-link-is-content", "pythonic",
           "[Paris](https://en.wikipedia.org/wiki/Paris) is the capital.",
           "[Paris](https://en.wikipedia.org/wiki/Paris) is the capital.", []),
]

MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": NaN}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "unterminated'),
    ("hermes", "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": 3}'),
    ("mistral", "[TOOL_CALLS] not json at all"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}'),
    ("pythonic", '[get_weather("Paris")]'),
    ("pythonic", '[f(x=os.system("ls"))]'),
    ("pythonic", "[f(x=a)]"),
    ("pythonic", "[f(x={1, 2})]"),
    ("pythonic", "[f(x=1, x=2)]"),
    ("pythonic", "[f(x=float('nan'))]"),
    ("pythonic", "[1, 2, 3]"),
]


def stream_events(parser: ToolParser, text: str, cuts: Sequence[int]) -> list[StreamEvent]:
    stream, events, last = parser.stream(), [], 0
    for cut in sorted(set(cuts)):
        events += stream.feed(text[last:cut])
        last = cut
    return events + stream.finish(text[last:])


def summary(output: ParsedOutput) -> tuple[str | None, list[tuple[str, str]]]:
    return output.content, [(call.name, call.arguments) for call in output.tool_calls]


def assert_openai_deltas(events: list[StreamEvent]) -> None:
    """Each call's first delta has its id, type and name, the later ones only arguments."""
    seen: set[int] = set()
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            continue
        wire = event.to_openai()
        if event.index in seen:
            assert wire == {"index": event.index, "function": {"arguments": event.arguments}}
            assert event.arguments
            continue
        assert event.index == len(seen)
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", wire["id"]) and wire["type"] == "function"
        assert wire["function"]["name"] == event.name
        seen.add(event.index)


def assert_stream_matches(parser_name: str, text: str, cuts: Sequence[int]) -> None:
    parser = get_tool_parser(parser_name)
    events = stream_events(parser, text, cuts)
    assert_openai_deltas(events)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta)) or None
    calls: dict[int, list[str]] = {}        # index -> [name, argument pieces...]
    for e in events:
        if isinstance(e, ToolCallDelta):
            calls.setdefault(e.index, [str(e.name)]).append(e.arguments)
    streamed = [(parts[0], "".join(parts[1:])) for _, parts in sorted(calls.items())]
    assert (content, streamed) == summary(parser.parse(text))


@pytest.mark.parametrize("parser_name,text,content,calls", SAMPLES)
def test_parses_real_outputs(parser_name: str, text: str, content: str | None,
                             calls: Calls) -> None:
    output = get_tool_parser(parser_name).parse(text)
    assert output.content == content
    assert [(c.name, json.loads(c.arguments)) for c in output.tool_calls] == calls
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in output.tool_calls)


@pytest.mark.parametrize("parser_name,text,content,calls", SAMPLES)
def test_stream_one_character_at_a_time(parser_name: str, text: str, content: str | None,
                                        calls: Calls) -> None:
    assert_stream_matches(parser_name, text, range(len(text)))


@pytest.mark.parametrize("parser_name,text", MALFORMED)
def test_malformed_calls_are_content(parser_name: str, text: str) -> None:
    assert summary(get_tool_parser(parser_name).parse(text)) == (text, [])


@pytest.mark.parametrize("parser_name,text,content,calls", SAMPLES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_split_adds_up_to_the_whole_text(parser_name: str, text: str, content: str | None,
                                             calls: Calls, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_stream_matches(parser_name, text, cuts)


def test_hermes_stream_holds_back_a_marker_cut_in_half() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Let me look. <tool") == [ContentDelta("Let me look.")]
    assert stream.feed("_call>\n{\"name\": \"f\", ") == []
    first = stream.feed('"arguments": {"q": "<tool_')
    assert [e.to_openai() for e in first] == [{
        "index": 0, "id": first[0].id, "type": "function",
        "function": {"name": "f", "arguments": '{"q": "<tool_'}}]
    assert stream.feed('call>"}}\n</tool_call>') == [ToolCallDelta(0, 'call>"}')]
    assert stream.finish() == []


def test_held_back_text_goes_out_when_it_is_no_marker() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("x <") == [ContentDelta("x")]
    assert stream.feed("b>") == [ContentDelta(" <b>")]
    assert stream.feed("\n") == []
    assert stream.finish() == [ContentDelta("\n")]


def test_a_stream_cannot_take_back_a_call_that_went_out() -> None:
    """Text that ends mid-call is content to parse(); a stream had sent the call already."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": '
    stream = get_tool_parser("hermes").stream()
    assert [e.to_openai()["function"] for e in stream.feed(text)] == [
        {"name": "f", "arguments": '{"a": '}]
    assert stream.finish() == []
    assert summary(get_tool_parser("hermes").parse(text)) == (text, [])


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    parser = get_tool_parser("pythonic")
    text = '[a(x=1), b(y="2")]'
    assert summary(keep_first_call(parser.parse(text))) == (None, [("a", '{"x": 1}')])
    events = drop_later_calls(stream_events(parser, text, range(len(text))))
    assert {e.index for e in events if isinstance(e, ToolCallDelta)} == {0}
    assert parser.parse(text).tool_calls[0].to_openai()["function"] == {
        "name": "a", "arguments": '{"x": 1}'}


def test_unknown_parser_name() -> None:
    with pytest.raises(UnknownToolParser, match="hermes"):
        get_tool_parser("granite")


# -- generated outputs: well-formed calls around random content --------------------------

SCALARS = (st.none() | st.booleans() | st.integers() | st.text(max_size=8)
           | st.floats(allow_nan=False, allow_infinity=False))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
# Content rich in the characters markers are made of, never a whole marker.
CONTENT = st.text(alphabet="ab <>/_[]{}()\n\"'tolcaTOLCS|", max_size=12).map(str.strip).filter(
    lambda text: "<tool_call>" not in text and "[TOOL_CALLS]" not in text)


def _call_text(parser_name: str, name: str, arguments: dict[str, Any], compact: bool) -> str:
    separators = (",", ":") if compact else None
    if parser_name == "hermes":
        body = json.dumps({"name": name, "arguments": arguments}, separators=separators)
        return f"\n<tool_call>\n{body}\n</tool_call>\n"
    if parser_name == "mistral":
        return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments, separators=separators)}"
    return json.dumps({"name": name, "parameters": arguments}, separators=separators)


@pytest.mark.parametrize("parser_name", ["hermes", "mistral", "llama3_json"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_generated_json_calls(parser_name: str, data: st.DataObject) -> None:
    calls = data.draw(st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3))
    compact = data.draw(st.booleans())
    call_texts = [_call_text(parser_name, name, args, compact) for name, args in calls]
    if parser_name == "llama3_json":        # the calls open the reply; content may follow
        contents = ["", data.draw(CONTENT).lstrip(";").strip()]
        text = "; ".join(call_texts) + " " + contents[1]
    else:                                   # content around the calls
        contents = data.draw(st.lists(CONTENT, min_size=len(calls) + 1,
                                      max_size=len(calls) + 1))
        text = contents[0] + "".join(c + after for c, after in zip(call_texts, contents[1:]))
    separators = (",", ":") if compact else None
    expected = ("".join(contents) or None,
                [(name, json.dumps(args, separators=separators)) for name, args in calls])
    assert summary(get_tool_parser(parser_name).parse(text)) == expected
    assert_stream_matches(parser_name, text, data.draw(st.lists(st.integers(0, len(text)))))


PY_LITERALS = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.tuples(inner, inner)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(NAMES, st.dictionaries(NAMES, PY_LITERALS, max_size=4)),
                      min_size=1, max_size=3), data=st.data())
def test_generated_pythonic_calls(calls: list[tuple[str, dict[str, Any]]],
                                  data: st.DataObject) -> None:
    text = "[" + ", ".join(f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
                           for name, kwargs in calls) + "]"
    expected = (None, [(name, json.dumps(kwargs, ensure_ascii=False)) for name, kwargs in calls])
    assert summary(get_tool_parser("pythonic").parse(text)) == expected
    assert_stream_matches("pythonic", text, data.draw(st.lists(st.integers(0, len(text)))))


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral", "pythonic"])
@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from([
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '{"name": "f"',
    ', "arguments": {', '"a": [1, "}"]', "}", "]", ";", "f(", "x=1", ")", ",", " ", "\n", "[",
    "hi", '"', "\\"]), max_size=14), data=st.data())
def test_any_text_parses_without_error(parser_name: str, pieces: list[str],
                                       data: st.DataObject) -> None:
    """Whatever the model writes, no exception; and where no call went out, a stream cannot
    have taken anything back, so it adds up to parse() exactly."""
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text))))
    events = stream_events(get_tool_parser(parser_name), text, cuts)
    assert_openai_deltas(events)
    if not any(isinstance(e, ToolCallDelta) for e in events):
        assert_stream_matches(parser_name, text, cuts)
