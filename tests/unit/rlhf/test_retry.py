"""rlhf.retry: the one retry loop (attempts, deadline, what is retried, the backoff)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from rlhf.retry import retry

log = logging.getLogger("test.retry")


def _flaky(fail: int, exc: type[Exception] = ConnectionError):
    calls = []

    async def call():
        calls.append(time.monotonic())
        if len(calls) <= fail:
            raise exc(f"try {len(calls)}")
        return len(calls)

    return call, calls


def _run(coro):
    return asyncio.run(coro)


def test_retries_until_it_succeeds_with_a_growing_backoff(caplog):
    call, calls = _flaky(3)
    with caplog.at_level(logging.WARNING, "test.retry"):
        got = _run(retry(call, lambda e: isinstance(e, ConnectionError), what="x failed", log=log, initial_s=0.01))
    assert got == 4 and len(calls) == 4
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert gaps[0] >= 0.01 and gaps[1] >= 0.02 and gaps[2] >= 0.04  # doubling
    assert [r.getMessage() for r in caplog.records][0] == "x failed (ConnectionError: try 1); retrying in 0.01s"


def test_attempts_bound_the_calls_and_the_last_error_is_raised():
    call, calls = _flaky(10)
    with pytest.raises(ConnectionError, match="try 3"):
        _run(retry(call, lambda e: True, what="x", log=log, attempts=3, initial_s=0.001))
    assert len(calls) == 3


def test_an_error_retry_on_refuses_is_raised_at_once():
    call, calls = _flaky(10, ValueError)
    with pytest.raises(ValueError, match="try 1"):
        _run(retry(call, lambda e: isinstance(e, ConnectionError), what="x", log=log, initial_s=0.001))
    assert len(calls) == 1


def test_no_try_starts_past_the_deadline():
    call, calls = _flaky(100)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        _run(retry(call, lambda e: True, what="x", log=log, deadline=t0 + 0.3, initial_s=0.05, max_s=0.1))
    assert calls[-1] <= t0 + 0.3 and 3 <= len(calls) <= 6
