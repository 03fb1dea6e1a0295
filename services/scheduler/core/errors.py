"""Typed errors the engine core raises at admission; the service maps them to HTTP codes."""

from __future__ import annotations


class AdmissionRejected(Exception):
    """The waiting queue is full (requests or tokens): answer 503 + Retry-After now
    rather than queue without bound."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class RequestTooLong(ValueError):
    """The request can never run: prompt + max_tokens exceeds the context length, or it
    needs more KV blocks than the engine has. A 400 (`context_length_exceeded`)."""
