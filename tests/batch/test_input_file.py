"""Parsing a batch input file: good lines run, malformed ones become error entries."""

from __future__ import annotations

import json

from services.batch.input_file import (
    BatchLine,
    MalformedLine,
    custom_id_key,
    error_entry,
    is_success,
    parse_input,
    response_entry,
)

CHAT = "/v1/chat/completions"


def line(custom_id: object = "a", url: str = CHAT, method: str = "POST",
         body: object = None) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": {"model": "m"} if body is None else body}).encode()


def test_good_lines_keep_their_order_and_line_numbers() -> None:
    data = b"\n".join([line("a"), b"", line("b"), b"  "]) + b"\n"
    lines = parse_input(data, CHAT)
    assert [(type(x), x.line_number, x.custom_id) for x in lines] == [
        (BatchLine, 1, "a"), (BatchLine, 3, "b")]
    assert lines[0].key == custom_id_key("a") and lines[0].body == {"model": "m"}


def test_malformed_lines_are_named_with_a_code() -> None:
    data = b"\n".join([b"{not json", b"[1, 2]", line(custom_id=""), line(custom_id=7),
                       line("m", method="GET"), line("u", url="/v1/completions"),
                       line("b", body=[1]), line("ok"), line("ok")])
    codes = [(x.line_number, x.code) for x in parse_input(data, CHAT)
             if isinstance(x, MalformedLine)]
    assert codes == [(1, "invalid_json"), (2, "invalid_json"), (3, "missing_custom_id"),
                     (4, "missing_custom_id"), (5, "invalid_method"), (6, "mismatched_url"),
                     (7, "invalid_body"), (9, "duplicate_custom_id")]


def test_keys_depend_only_on_content() -> None:
    data = b"\n".join([b"oops", line("x"), line("x")])
    first, second = parse_input(data, CHAT), parse_input(data, CHAT)
    assert [x.key for x in first] == [x.key for x in second]
    assert [x.key for x in first] == ["line-1", custom_id_key("x"), "line-3"]


def test_entries_follow_openai_batch_output_format() -> None:
    ok = json.loads(response_entry("k", "a", 200, "chatcmpl-1", {"object": "chat.completion"}))
    assert ok == {"id": "batch_req_k", "custom_id": "a", "error": None,
                  "response": {"status_code": 200, "request_id": "chatcmpl-1",
                               "body": {"object": "chat.completion"}}}
    assert is_success(ok)
    failed = json.loads(response_entry("k", "a", 400, "", {"error": {"message": "bad"}}))
    assert not is_success(failed)
    bad = json.loads(error_entry(MalformedLine(3, "line-3", None, "invalid_json", "no")))
    assert bad == {"id": "batch_req_line-3", "custom_id": None, "response": None,
                   "error": {"code": "invalid_json", "message": "no"}}
    assert not is_success(bad)


def test_a_line_nested_thousands_deep_is_malformed_and_the_rest_run() -> None:
    deep = b'{"custom_id": "deep", "method": "POST", "url": "%s", "body": {"x": %s1%s}}' % (
        CHAT.encode(), b"[" * 5000, b"]" * 5000)
    lines = parse_input(b"\n".join([line("a"), deep, line("b", body={"x": [[[1]]]})]), CHAT)
    assert [type(x) for x in lines] == [BatchLine, MalformedLine, BatchLine]
    assert lines[1].code == "invalid_json" and "deeper than 128 levels" in lines[1].message
