"""A tiny OpenAI-compatible stand-in that streams canned tokens, for parsing edge cases.

Prompts steer it: "FAIL_HTTP" answers 500, "FAIL_STREAM" sends two tokens then an error
event. Every other request streams `max_tokens` one-token chunks (optionally `token_delay_s`
apart) and, when asked, the final usage chunk with prompt_tokens = the prompt's word count.
Runs uvicorn in a thread of the test process.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.ports import free_port

MODEL = "stub-model"


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def create_app(token_delay_s: float = 0.0, send_usage: bool = True) -> FastAPI:
    app = FastAPI()
    app.state.bodies = []

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def generate(request: Request, chat: bool) -> Any:
        body = await request.json()
        app.state.bodies.append(body)
        prompt = (" ".join(m["content"] for m in body["messages"]) if chat
                  else body["prompt"])
        if "FAIL_HTTP" in prompt:
            return JSONResponse({"error": {"message": "stub failure"}}, status_code=500)
        num_tokens = int(body.get("max_tokens") or 16)

        def chunk(text: str) -> dict[str, Any]:
            choice = ({"index": 0, "delta": {"content": text}} if chat
                      else {"index": 0, "text": text})
            return {"id": "x", "model": MODEL, "choices": [choice], "usage": None}

        async def stream() -> AsyncIterator[bytes]:
            if chat:
                yield _sse({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(num_tokens):
                if token_delay_s:
                    await asyncio.sleep(token_delay_s)
                if "FAIL_STREAM" in prompt and i == 2:
                    yield _sse({"error": {"message": "engine died", "code": 503}})
                    return
                yield _sse(chunk(f"t{i} "))
            if send_usage and (body.get("stream_options") or {}).get("include_usage"):
                yield _sse({"id": "x", "choices": [], "usage": {
                    "prompt_tokens": len(prompt.split()), "completion_tokens": num_tokens,
                    "total_tokens": len(prompt.split()) + num_tokens}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await generate(request, chat=True)

    return app


@contextmanager
def running_stub(keep_alive_s: int = 5, **app_options: Any) -> Iterator[tuple[str, FastAPI]]:
    """Yields (base_url, app) while the stub serves on a free loopback port."""
    app = create_app(**app_options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off",
                                           timeout_keep_alive=keep_alive_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the stub server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)
