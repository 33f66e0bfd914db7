"""One retry loop for the calls that redis-py's ``Retry`` and gRPC's ``retryPolicy`` cannot cover.

redis-py retries a command on one connection a fixed number of times; the ring must outlive a Redis restart or a
Sentinel failover of unknown length (bounded by a deadline, or not at all). gRPC's retry policy shares one deadline
across attempts; the rollout's scoring calls give each attempt its own. A scorer over HTTP classifies failures
(4xx: do not retry). Each of these calls :func:`retry` with what may be retried and for how long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def retry(
    call: Callable[[], Awaitable[T]],
    retry_on: Callable[[BaseException], bool],
    *,
    what: str,
    log: logging.Logger,
    attempts: int | None = None,
    deadline: float | None = None,
    initial_s: float = 0.2,
    max_s: float = 5.0,
    level: int = logging.WARNING,
) -> T:
    """``await call()`` until it returns. An exception ``retry_on`` accepts is retried after an exponential
    backoff (``initial_s``, doubling, at most ``max_s``), logged as "``what`` (error); retrying in ...", while
    fewer than ``attempts`` calls were made (None: no limit) and the next try would start before ``deadline``
    (a ``time.monotonic()`` value; None: none). Any other exception, or the last one, is raised as it is."""
    delay, made = initial_s, 0
    while True:
        try:
            return await call()
        except Exception as err:  # retry_on decides; the rest is re-raised unchanged
            made += 1
            if not retry_on(err):
                raise
            if attempts is not None and made >= attempts:
                raise
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            log.log(level, "%s (%s: %s); retrying in %.2fs", what, type(err).__name__, err, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_s)
