"""Telling a JetStream failover (a replica answering "not leader", a stream with no leader
yet, a request timing out) from a real error, and waiting the failover out for idempotent
writes."""

from __future__ import annotations

import nats.errors
import nats.js.errors as js_errors
import pytest

from services.common.jetstream import is_transient, retry_transient


@pytest.mark.parametrize("exc", [
    nats.errors.TimeoutError(), nats.errors.NoRespondersError(),
    js_errors.ServiceUnavailableError(code=503),
    js_errors.ServerError(code=500, err_code=10009, description="JetStream not leader"),
    js_errors.APIError(code=408, description="Request Timeout"),
    js_errors.NoStreamResponseError(),   # a publish before the stream's interest is known
])
def test_failover_errors_are_transient(exc: Exception) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    js_errors.BadRequestError(code=400, description="invalid config"),
    js_errors.NotFoundError(code=404), js_errors.KeyWrongLastSequenceError(),
    js_errors.APIError(code=413, description="message size exceeds maximum allowed"),
])
def test_real_errors_are_not(exc: Exception) -> None:
    assert not is_transient(exc)


async def test_a_write_is_retried_until_the_stream_answers() -> None:
    failures = [js_errors.ServerError(code=500, description="stream offline"),
                nats.errors.TimeoutError()]

    async def write() -> str:
        if failures:
            raise failures.pop(0)
        return "stored"

    assert await retry_transient(write, within_s=5.0) == "stored"
    assert failures == []


async def test_a_real_error_is_raised_at_once() -> None:
    calls = 0

    async def write() -> None:
        nonlocal calls
        calls += 1
        raise js_errors.BadRequestError(code=400, description="bad")

    with pytest.raises(js_errors.BadRequestError):
        await retry_transient(write, within_s=5.0)
    assert calls == 1


async def test_a_failover_outlasting_the_window_raises_its_error() -> None:
    async def write() -> None:
        raise js_errors.ServiceUnavailableError(code=503)

    with pytest.raises(js_errors.ServiceUnavailableError):
        await retry_transient(write, within_s=0.3)
