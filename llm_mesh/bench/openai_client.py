"""Sends one streamed request to an OpenAI-compatible server and times it.

Bodies are JSON-encoded before the benchmark starts (`encode_body`); while a response
streams, the client only stamps each network read and hands it to the StreamParser.
The HTTP layer is a transport: raw_http (default, cheapest per chunk) or httpx2.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from llm_mesh.bench.httpx_transport import HttpxTransport
from llm_mesh.bench.raw_http import OnData, RawHttpTransport
from llm_mesh.bench.stream_parser import RequestResult, StreamParser
from llm_mesh.bench.workloads import SampleRequest

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
TRANSPORTS = {"raw": RawHttpTransport, "httpx2": HttpxTransport}
SESSION_HEADER = "x-session-id"


class Transport(Protocol):
    async def post_stream(self, path: str, body: bytes, on_data: OnData,
                          headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        ...

    async def get(self, path: str) -> tuple[int, bytes]:
        ...

    async def aclose(self) -> None:
        ...


@dataclass(frozen=True)
class EncodedRequest:
    body: bytes
    tag: str
    prompt_len: int
    headers: dict[str, str] = field(default_factory=dict)  # besides the client's own


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)   # merged into every body


def encode_body(sample: SampleRequest, model: str, endpoint: str,
                sampling: SamplingOptions) -> EncodedRequest:
    body: dict[str, Any] = {"model": model, "max_tokens": sample.output_len,
                            "temperature": sampling.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = sample.messages
    else:
        body["prompt"] = sample.prompt
    if sampling.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra field: output lengths become exact
    headers: dict[str, str] = {}
    if sample.session_id is not None:
        # Both of the hints a router may keep a conversation on one engine by: OpenAI's
        # body field and the header (for routers that do not parse bodies).
        body["prompt_cache_key"] = sample.session_id
        headers[SESSION_HEADER] = sample.session_id
    body.update(sampling.extra_body)
    return EncodedRequest(json.dumps(body).encode(), sample.tag, sample.prompt_len, headers)


class OpenAIClient:
    """One client, and one keep-alive pool sized to the concurrency, for a whole benchmark."""

    def __init__(self, base_url: str, endpoint: str = "completions", api_key: str | None = None,
                 max_connections: int = 100, timeout_s: float = 600.0,
                 http_client: str = "raw") -> None:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
                   # NOTE: identity, so the body bytes are the SSE text as sent (no gzip).
                   "Accept-Encoding": "identity"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        base_url = base_url.rstrip("/")
        if base_url.endswith("/v1"):  # a common slip: the paths below carry /v1 already
            base_url = base_url[:-3]
        self.base_url = base_url
        self.path = ENDPOINT_PATHS[endpoint]
        self._transport: Transport = TRANSPORTS[http_client](base_url, headers, max_connections,
                                                              timeout_s)

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._transport.aclose()

    async def first_model(self) -> str:
        """The first id of GET /v1/models: the default model, as vLLM's bench does."""
        status, body = await self._transport.get("/v1/models")
        if status != 200:
            raise RuntimeError(f"GET {self.base_url}/v1/models answered {status}: "
                               f"{body[:200].decode(errors='replace')}")
        models = json.loads(body).get("data") or []
        if not models:
            raise RuntimeError(f"{self.base_url}/v1/models lists no model: pass --model")
        return str(models[0]["id"])

    async def send(self, request: EncodedRequest, keep_text: bool = False) -> RequestResult:
        """Never raises for server or network errors: they become a failed result.
        `keep_text` keeps the answer's text in the result (a session's next turn needs it)."""
        result = RequestResult(tag=request.tag, prompt_tokens=request.prompt_len)
        parser = StreamParser(result, keep_text)
        result.start_time = time.perf_counter()
        try:
            status, error = await self._transport.post_stream(self.path, request.body,
                                                              parser.feed, request.headers)
            if status != 200:
                result.fail(f"HTTP {status}: {error[:300].decode(errors='replace')}")
        except Exception as exc:  # noqa: BLE001 — any failure is one failed request, not a crash
            result.fail(f"{type(exc).__name__}: {exc}")
        return parser.finish(time.perf_counter())
