"""SSE parsing of canned streams, and the raw client's chunked decoding (no server)."""

from __future__ import annotations

import json
import random

import pytest

from llm_mesh.bench.raw_http import ChunkedDecoder
from llm_mesh.bench.stream_parser import RequestResult, StreamParser


def sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def completion_stream(texts: list[str], usage: dict | None) -> bytes:
    body = b"".join(sse({"choices": [{"index": 0, "text": t, "finish_reason": None}],
                         "usage": None}) for t in texts)
    body += sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    if usage is not None:
        body += sse({"choices": [], "usage": usage})
    return body + b"data: [DONE]\n\n"


def parse(pieces: list[bytes], start: float = 10.0, step: float = 0.01) -> StreamParser:
    parser = StreamParser(RequestResult(start_time=start, prompt_tokens=99))
    now = start
    for piece in pieces:
        now += step
        parser.feed(piece, now)
    parser.finish(now + step)
    return parser


def test_usage_chunk_gives_exact_counts_and_timings() -> None:
    stream = completion_stream(["Hel", "lo", " wor", "ld"], {"prompt_tokens": 7,
                                                             "completion_tokens": 5})
    events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    p = parse(events)
    r = p.result
    assert r.success and p.is_done and r.has_usage
    assert (r.prompt_tokens, r.output_tokens, r.num_chunks) == (7, 5, 4)
    assert r.ttft == pytest.approx(0.01)
    assert r.itl == pytest.approx([0.01, 0.01, 0.01])
    assert r.latency == pytest.approx(0.08)  # 7 events + finish


def test_without_usage_content_chunks_are_counted() -> None:
    r = parse([completion_stream(["a", "b", "c"], None)]).result
    assert r.success and not r.has_usage
    assert (r.output_tokens, r.prompt_tokens) == (3, 99)  # the local prompt count stays
    assert r.itl == [0.0, 0.0]  # one network read: the chunks share its timestamp


def test_events_split_anywhere_and_crlf_parse_the_same() -> None:
    stream = completion_stream(["x"] * 6, {"prompt_tokens": 3, "completion_tokens": 6})
    rng = random.Random(0)
    for variant in (stream, stream.replace(b"\n", b"\r\n")):
        cuts = sorted(rng.sample(range(1, len(variant)), 25))
        pieces = [variant[a:b] for a, b in zip([0, *cuts], [*cuts, len(variant)], strict=True)]
        r = parse(pieces).result
        assert r.success and r.num_chunks == 6 and r.output_tokens == 6


def test_chat_deltas_skip_the_role_chunk() -> None:
    stream = (sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
              + sse({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
              + sse({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]})
              + sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
              + b"data: [DONE]\n\n")
    p = parse([e + b"\n\n" for e in stream.split(b"\n\n") if e])
    assert p.result.success and p.result.num_chunks == 2
    assert p.result.ttft == pytest.approx(0.02)  # the role chunk is not a token


def test_error_event_fails_the_request() -> None:
    stream = (sse({"choices": [{"index": 0, "text": "a"}]})
              + sse({"error": {"message": "engine died", "type": "ServiceUnavailable",
                               "code": 503}})
              + b"data: [DONE]\n\n")
    r = parse([stream]).result
    assert not r.success and r.error == "engine died"


@pytest.mark.parametrize("stream", [
    b"event: error\ndata: {\"message\": \"bad\"}\n\n",
    b"error: {\"code\": 500, \"message\": \"llama.cpp failed\"}\n\n",
    b"data: {not json\n\n",
    b"data: [DONE]\n\n",  # no text at all
])
def test_other_failures_are_counted_not_raised(stream: bytes) -> None:
    r = parse([stream]).result
    assert not r.success and r.error


def test_tokens_without_text_are_timed_from_the_first_chunk_with_choices() -> None:
    """Under ignore_eos a model may emit only special tokens: no text, yet 32 tokens."""
    stream = [sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
              sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 32}}),
              b"data: [DONE]\n\n"]
    r = parse(stream).result
    assert r.success and r.num_chunks == 0 and r.output_tokens == 32
    assert r.ttft == pytest.approx(0.01) and r.tpot == pytest.approx(0.03 / 31)
    no_usage = parse([stream[0], stream[2]]).result
    assert not no_usage.success  # nothing says a token was made


def test_a_last_event_without_its_blank_line_is_kept() -> None:
    r = parse([sse({"choices": [{"text": "a"}]}) + b'data: {"choices":[{"text":"b"}]}']).result
    assert r.success and r.num_chunks == 2


def test_chunked_decoder_reassembles_any_split() -> None:
    payloads = [b"data: one\n\n", b"data: two\n\n", b"x" * 300]
    framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in payloads)
    framed += b"0\r\nX-Trailer: 1\r\n\r\n"
    rng = random.Random(1)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(framed)), 8))
        decoder, out = ChunkedDecoder(), b""
        for a, b in zip([0, *cuts], [*cuts, len(framed)], strict=True):
            assert not decoder.is_done
            out += decoder.feed(framed[a:b])
        assert decoder.is_done and out == b"".join(payloads)


def test_chunked_decoder_waits_for_the_final_crlf() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"3\r\nabc\r\n0\r\n") == b"abc"
    assert not decoder.is_done  # the empty line closing the trailers is still to come
    decoder.feed(b"\r\n")
    assert decoder.is_done
