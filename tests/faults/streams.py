"""Streaming clients for fault tests: several SSE streams in threads, each recording its
text, how it ended (finish reason, an SSE error event, a broken connection) and when every
chunk (and every `: keep-alive` comment) came, so a test can strike while they run and
then say what each client saw."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx

# Every client wait is bounded: a stream silent for this long counts as hung.
READ_TIMEOUT_S = 90.0


@dataclass
class StreamResult:
    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None      # an SSE error event's "error" object
    status: int | None = None                # HTTP status of the response
    transport_error: str | None = None       # the connection broke or timed out
    done: bool = False                       # saw data: [DONE]
    usage: dict[str, Any] | None = None      # the last chunk's, with include_usage
    started: float = field(default_factory=time.monotonic)
    chunk_times: list[float] = field(default_factory=list)
    keepalive_times: list[float] = field(default_factory=list)   # SSE comment lines
    ended: float | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_times)

    @property
    def completed(self) -> bool:
        return self.done and self.finish_reason is not None and self.error is None

    @property
    def longest_gap_s(self) -> float:
        start, end = self.longest_gap()
        return end - start

    def longest_gap(self) -> tuple[float, float]:
        """When the longest wait for a chunk began and ended."""
        times = [self.started, *self.chunk_times]
        return max(zip(times, times[1:]), key=lambda gap: gap[1] - gap[0],
                   default=(self.started, self.started))

    def keepalives_between(self, start: float, end: float) -> int:
        return sum(1 for t in self.keepalive_times if start <= t <= end)

    def outcome(self) -> str:
        if self.completed:
            return f"completed ({self.finish_reason})"
        if self.error is not None:
            return f"SSE error {self.error.get('code')}: {self.error.get('message')}"
        if self.status not in (None, 200):
            return f"HTTP {self.status}"
        return f"connection error: {self.transport_error}"


def stream_completion(base_url: str, body: dict[str, Any], result: StreamResult,
                      headers: dict[str, str] | None = None) -> StreamResult:
    """POSTs a streaming /v1/completions request and fills `result` as chunks arrive."""
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=10.0)
    try:
        with httpx.Client(timeout=timeout) as http, http.stream(
                "POST", f"{base_url}/v1/completions", json={**body, "stream": True},
                headers=headers or {}) as response:
            result.status = response.status_code
            if response.status_code != 200:
                response.read()
                result.error = response.json().get("error")
                return result
            for line in response.iter_lines():
                if line.startswith(":"):
                    result.keepalive_times.append(time.monotonic())
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    result.done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = chunk["error"]
                    continue
                result.usage = chunk.get("usage") or result.usage
                for choice in chunk.get("choices", []):
                    result.text += choice.get("text") or ""
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                result.chunk_times.append(time.monotonic())
    except (httpx.TransportError, httpx.StreamError) as exc:
        result.transport_error = type(exc).__name__
    finally:
        result.ended = time.monotonic()
    return result


class StreamSet:
    """N concurrent streams; `wait_until` polls a condition over their progress."""

    def __init__(self, base_url: str, bodies: list[dict[str, Any]],
                 headers: dict[str, str] | None = None) -> None:
        self.results = [StreamResult() for _ in bodies]
        self._pool = ThreadPoolExecutor(len(bodies))
        self._futures: list[Future[StreamResult]] = [
            self._pool.submit(stream_completion, base_url, body, result, headers)
            for body, result in zip(bodies, self.results)]
        self._lock = threading.Lock()

    def wait_until(self, condition: Callable[[list[StreamResult]], bool],
                   timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition(self.results):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: "
                                     f"{[r.outcome() for r in self.results]}")
            time.sleep(0.02)

    def wait_for_chunks(self, num_chunks: int, timeout_s: float = 60.0) -> None:
        self.wait_until(lambda rs: all(r.num_chunks >= num_chunks or r.ended for r in rs),
                        timeout_s, f"{num_chunks} chunks on every stream")

    def finish(self, timeout_s: float) -> list[StreamResult]:
        """Every stream's result; fails if any is still open after `timeout_s` (a hang)."""
        deadline = time.monotonic() + timeout_s
        for future in self._futures:
            future.result(timeout=max(0.1, deadline - time.monotonic()))
        self._pool.shutdown()
        return self.results


def poll(condition: Callable[[], bool], timeout_s: float, what: str,
         interval_s: float = 0.05, state: Callable[[], object] | None = None) -> float:
    """Waits for `condition` (a deadline, never a bare sleep); returns the seconds it took.
    On a timeout the error names `state()`, what was seen last, for a failure read in CI."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            seen = f"; last seen: {state()}" if state is not None else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{seen}")
        time.sleep(interval_s)
    return time.monotonic() - started


def post_json(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
              timeout_s: float = 60.0) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A non-streaming POST: (status, response headers, JSON body); never raises on 4xx/5xx."""
    with httpx.Client(timeout=timeout_s) as http:
        response = http.post(url, json=body, headers=headers or {})
    try:
        payload = response.json()
    except ValueError:
        payload = {"raw": response.text}
    return response.status_code, dict(response.headers), payload
