"""Hostile input at the gateway: absurd values answer 400 with an OpenAI error object and
never reach an engine; oversized bodies 413; a client that vanishes mid-request has its
request aborted and its KV blocks freed."""

from __future__ import annotations

import json
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2 as httpx
import pytest

from tests.faults.streams import poll
from tests.mesh import Mesh

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# (path, body, the param or a word the error names)
ABSURD: list[tuple[str, dict[str, Any], str]] = [
    (CHAT, {"model": MODEL, "messages": HI, "n": 10**9}, "n"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 10**30}, "n"),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": -5}, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "max_completion_tokens": -1},
     "max_completion_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    (CHAT, {"model": MODEL, "messages": HI, "logprobs": True, "top_logprobs": 10**6},
     "logprobs"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "prompt_logprobs": 500}, "prompt_logprobs"),
    (CHAT, {"model": MODEL, "messages": HI, "stop": [f"s{i}" for i in range(5000)]}, "stop"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": ["x" * 10, ""]}, "stop"),
    (CHAT, {"model": MODEL, "messages": []}, "messages"),
    ("/tokenize", {"model": MODEL, "messages": []}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    (COMPLETIONS, {"model": MODEL, "prompt": ""}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [-1, 5]}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [2**31 - 1]}, "vocabulary"),
    (COMPLETIONS, {"model": MODEL, "prompt": [[1, 2**40]]}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop_token_ids": [2**40]}, "stop_token_ids"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "priority": 2**40}, "priority"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "top_k": 2**40}, "top_k"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logit_bias": {"100000000": 5}},
     "vocabulary"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": -0.1}, "temperature"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logit_bias": {"-3": 1}}, "logit_bias"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "seed": 2**80}, "seed"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hello " * 5000}, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x\ud800y"}, "surrogate"),
    (CHAT, {"model": MODEL, "messages": HI, "stream_options": {"include_usage": True}},
     "stream_options"),
    (CHAT, {"model": MODEL, "messages": HI, "tools": [{"type": "function"}]}, "tools"),
    ("/detokenize", {"model": MODEL, "tokens": [10**9]}, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [2**40]}, "tokens"),
    ("/tokenize", {"model": MODEL}, "prompt"),
]


def post(mesh: Mesh, path: str, body: bytes | dict[str, Any],
         headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(timeout=60) as http:
        return http.post(f"{mesh.base_url}{path}", content=content,
                         headers={"Content-Type": "application/json", **(headers or {})})


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def engine_saw(mesh: Mesh) -> float:
    return mesh.scheduler_metric("vllm:prompt_tokens_total") + \
        mesh.scheduler_metric("vllm:num_requests_running")


def test_absurd_values_answer_400_and_never_reach_an_engine(mesh: Mesh) -> None:
    before = engine_saw(mesh)
    for path, body, names in ABSURD:
        error = assert_openai_error(post(mesh, path, body), 400)
        assert error["type"] == "invalid_request_error"
        assert names in (error["param"] or "") or names in error["message"], (body, error)
    assert engine_saw(mesh) == before


def test_invalid_utf8_and_broken_json_answer_400(mesh: Mesh) -> None:
    for raw in (b'{"model": "m", "prompt": "\xff\xfe\xfd"}', b"\xc3\x28", b"{not json",
                b"[1, 2, 3]", b"", b'"just a string"', b'{"model": "m", "prompt": NaN}'):
        assert_openai_error(post(mesh, COMPLETIONS, raw), 400)


def test_deeply_nested_bodies_answer_400(mesh: Mesh) -> None:
    """Nested past what json or pydantic would recurse through (5,000), or just past the
    limit (129): a 400 naming the nesting, never a 500."""
    for depth in (129, 5_000, 100_000):
        nested = "[" * depth + "]" * depth
        raw = f'{{"model": "{MODEL}", "prompt": "x", "logit_bias": {nested}}}'.encode()
        error = assert_openai_error(post(mesh, COMPLETIONS, raw), 400)
        assert "nests" in error["message"], (depth, error)
    shallow = {"model": MODEL, "messages": HI, "max_tokens": 1,
               "metadata": {"a": {"b": {"c": [[[["fine"]]]]}}}}
    assert post(mesh, CHAT, shallow).status_code == 200


def test_bodies_over_the_limit_answer_413(mesh: Mesh) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (9 * 1024 * 1024)}).encode()
    assert_openai_error(post(mesh, COMPLETIONS, big), 413)

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(10):
            yield b" " * (1024 * 1024)
    with httpx.Client(timeout=60) as http:
        response = http.post(f"{mesh.base_url}{COMPLETIONS}", content=chunks(),
                             headers={"Content-Type": "application/json"})
    assert_openai_error(response, 413)


def retry_after_s(head: bytes) -> float:
    for line in head.decode(errors="replace").lower().splitlines():
        if line.startswith("retry-after:"):
            return float(line.split(":", 1)[1])
    return 1.0


def answered(sock: socket.socket) -> bool:
    """Whether the server has sent something (a response, or closed) on `sock`."""
    return bool(select.select([sock], [], [], 0)[0])


def test_clients_that_vanish_mid_request_free_their_blocks(mesh: Mesh) -> None:
    """Streaming and non-streaming clients close their sockets mid-generation: the gateway
    aborts their requests, and the engine's running gauge and KV usage return to zero."""
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 1500,
            "ignore_eos": True}

    def vanish(stream: bool) -> None:
        payload = json.dumps({**body, "stream": stream}).encode()
        port = int(mesh.base_url.rsplit(":", 1)[1])
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\n"
                             + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                if not stream:
                    poll(lambda: answered(sock)
                         or mesh.scheduler_metric("vllm:num_requests_running") >= 1, 60,
                         "the request to run")
                # Streaming, the response has started (text is flowing); not streaming, an
                # answer before the close means the request is no longer running.
                head = sock.recv(4096) if stream or answered(sock) else b""
                if not head.startswith(b"HTTP/1.1 503"):
                    assert not head or (stream and head.startswith(b"HTTP/1.1 200")), head
                    return   # closed here, with the request still generating
            # A busy engine may refuse for a moment (503 + Retry-After): retry, as clients do.
            time.sleep(retry_after_s(head))
        raise AssertionError(f"refused five times: {head!r}")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(vanish, [True, True, False, False]))
    poll(lambda: mesh.scheduler_metric("vllm:num_requests_running") == 0
         and mesh.scheduler_metric("vllm:num_requests_waiting") == 0
         and mesh.scheduler_metric("vllm:kv_cache_usage_perc") == 0, 30,
         "the engine to free the vanished clients' blocks")
