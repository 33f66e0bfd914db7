"""Admission control that bounds staleness, and the published policy version.

:class:`Admission` keeps the prompt jobs issued but not yet trained on within ``(max_staleness + 1) * batch_size``
(AReaL's rule; ``batch_size`` counts prompt jobs), with its counters in Redis so a restarted trainer resumes them:
in flight = issued - trained - released; free = capacity - in flight. Keep the trained count in every checkpoint
and :meth:`Admission.restore` it after a restart. :func:`publish_policy_version` / :func:`get_policy_version`: the
run's published version (it only goes up).

Design (the counters, restore after a restart): docs/reliability.md#the-guarantees ("Admission").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from rlhf.transport.connection import NO_WAIT, WaitPolicy, one, wait_policy, waited
from rlhf.transport.keys import RunKeys

# KEYS: version key. ARGV: version. Sets it only upward; returns the stored version.
_SET_VERSION = """
local cur = redis.call('GET', KEYS[1])
local v = tonumber(ARGV[1])
if cur and tonumber(cur) >= v then return tonumber(cur) end
redis.call('SET', KEYS[1], ARGV[1])
return v
"""


@dataclass(frozen=True)
class AdmissionState:
    issued: int
    trained: int
    released: int
    capacity: int

    @property
    def in_flight(self) -> int:
        return self.issued - self.trained - self.released

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.in_flight)


class Admission:
    """Staleness bound of a run. The trainer asks :meth:`free` (or passes this object to
    :meth:`PromptQueue.publish`, which refuses atomically past the bound) and reports :meth:`set_trained`."""

    def __init__(
        self,
        redis: aioredis.Redis,
        run_id: str,
        max_staleness: int,
        batch_size: int,
        *,
        wait: WaitPolicy | None = None,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0 = synchronous), got {max_staleness}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.redis = redis
        self.keys = RunKeys(run_id)
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.wait = wait if wait is not None else wait_policy(redis)  # WAIT after set_trained / the version
        self._set_version = redis.register_script(_SET_VERSION)

    @property
    def capacity(self) -> int:
        """Jobs allowed in flight: ``(max_staleness + 1) * batch_size``."""
        return (self.max_staleness + 1) * self.batch_size

    async def state(self) -> AdmissionState:
        k = self.keys
        issued, trained, released = await self.redis.mget(k.issued, k.trained, k.released)
        return AdmissionState(int(issued or 0), int(trained or 0), int(released or 0), self.capacity)

    async def free(self) -> int:
        """How many new jobs may be issued now."""
        return (await self.state()).free

    async def wait_free(self, min_free: int = 1, timeout_s: float | None = None, poll_s: float = 0.05) -> int:
        """Wait until at least ``min_free`` (capped at the capacity) jobs may be issued; returns the free count.
        Raises TimeoutError after ``timeout_s``."""
        need = min(min_free, self.capacity)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            free = await self.free()
            if free >= need:
                return free
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"admission: only {free} of {need} slots free after {timeout_s} s")
            await asyncio.sleep(poll_s)

    async def set_trained(self, total: int) -> None:
        """The trainer has consumed ``total`` jobs in all (trained on them, or dropped them as stale; not records
        dropped as duplicates: their job was counted when it was trained). An absolute value, so a call retried
        after a connection error counts nothing twice: prefer it to :meth:`mark_trained`. The trainer keeps the
        total in its own state and checkpoints it."""
        if total < 0:
            raise ValueError("total must be >= 0")

        await waited(self.redis, self.wait, self.keys.fence, lambda c: one(c.set(self.keys.trained, total)))

    async def restore(self, trained: int) -> None:
        """After a trainer restart: set the trained counter to the value saved in the checkpoint it resumed from."""
        await self.set_trained(trained)

    async def mark_trained(self, n: int) -> int:
        """Add ``n`` to the trained counter (INCRBY); returns the total. Not idempotent: a retry after a lost reply
        counts twice; :meth:`set_trained` is the retry-safe form."""
        if n < 0:
            raise ValueError("n must be >= 0")
        return int(await self.redis.incrby(self.keys.trained, n))

    async def policy_version(self) -> int | None:
        return await get_policy_version(self.redis, self.keys.run_id)

    async def publish_policy_version(self, version: int) -> int:
        return await publish_policy_version(
            self.redis, self.keys.run_id, version, script=self._set_version, wait=self.wait
        )


async def get_policy_version(redis: aioredis.Redis, run_id: str) -> int | None:
    """The newest policy version published for the run, or None before the first."""
    v = await redis.get(RunKeys(run_id).policy_version)
    return int(v) if v is not None else None


async def publish_policy_version(
    redis: aioredis.Redis, run_id: str, version: int, *, script: Any = None, wait: WaitPolicy = NO_WAIT
) -> int:
    """Record ``version`` as the run's policy version. Versions never go backwards: publishing the current one
    again is a no-op, a lower one raises ValueError (the stored one is kept). With ``wait``, returns once that many
    replicas have it (see rlhf.transport.connection.waited)."""

    if version < 0:
        raise ValueError("version must be >= 0")
    script = script or redis.register_script(_SET_VERSION)
    k = RunKeys(run_id)
    (raw,) = await waited(
        redis, wait, k.fence, lambda c: one(script(keys=[k.policy_version], args=[version], client=c))
    )
    stored = int(raw)
    if stored > version:
        raise ValueError(f"policy version {version} is older than the published version {stored}")
    return stored
