"""A run's streams seen from outside any one consumer: depth and counters (:class:`QueueStats`, :func:`queue_stats`),
trimming (:func:`trim_stream`), the dead letters (:func:`dead_letters`) and deleting a run (:func:`delete_run`).

Functions of a Redis client and a run id or stream key, for status endpoints, autoscaling, operators and tests; the
queues of :mod:`rlhf.transport.streams` use the same helpers for their own ``backlog()`` and ``trim()``.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from rlhf.transport.keys import ROLLOUT_GROUP, TRAINER_GROUP, RunKeys


def _s(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def _parse_id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = _s(entry_id).partition("-")
    return int(ms), int(seq or 0)


async def group_backlog(redis: aioredis.Redis, stream: str, group: str) -> int:
    """Entries of ``stream`` not yet delivered to ``group`` (every entry when the group does not exist)."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:  # no such key
        return 0
    for g in groups:
        if _s(g["name"]) == group:
            return await _lag(redis, stream, g)
    return await redis.xlen(stream)


async def _lag(redis: aioredis.Redis, stream: str, g: dict, limit: int = 100_000) -> int:
    lag = g.get("lag")
    if lag is not None:
        return int(lag)
    # Redis cannot tell (entries deleted in the middle): count what lies after last-delivered-id, up to ``limit``.
    rows = await redis.xrange(stream, min=b"(" + (g["last-delivered-id"] or b"0-0"), max="+", count=limit)
    return len(rows)


async def trim_stream(redis: aioredis.Redis, stream: str) -> int:
    """Trim ``stream`` to what every group has delivered and acknowledged: see
    :meth:`rlhf.transport.streams.PromptQueue.trim` (the bound, and why it is safe against concurrent consumers)."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:
        return 0
    if not groups:
        return 0
    bound: tuple[int, int] | None = None
    for g in groups:
        ms, seq = _parse_id(g["last-delivered-id"] or b"0-0")
        cand = (ms, seq + 1)
        if int(g["pending"]) > 0:
            summary = await redis.xpending(stream, g["name"])
            if summary["min"] is not None:
                cand = min(cand, _parse_id(summary["min"]))
        bound = cand if bound is None else min(bound, cand)
    assert bound is not None
    return int(await redis.xtrim(stream, minid=f"{bound[0]}-{bound[1]}", approximate=False))


@dataclass
class QueueStats:
    """Queue depth of a run, for status endpoints and autoscaling (rollout scales on ``prompts_backlog``)."""

    prompts_length: int = 0
    prompts_pending: int = 0  # handed to a replica, not yet acknowledged
    prompts_backlog: int = 0  # not yet handed to any replica
    experience_length: int = 0
    experience_pending: int = 0  # read by the trainer, not yet covered by a checkpoint
    experience_backlog: int = 0  # not yet read by the trainer
    dead_letters: int = 0  # dead-lettered, ever (the dead stream itself is capped)
    dead_by_stream: dict[str, int] = field(default_factory=dict)
    issued: int = 0
    trained: int = 0
    released: int = 0
    policy_version: int | None = None

    @property
    def in_flight(self) -> int:
        return self.issued - self.trained - self.released

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["in_flight"] = self.in_flight
        return d


async def _group_depth(redis: aioredis.Redis, stream: str, group: str) -> tuple[int, int, int]:
    """(length, pending, backlog) of one group on one stream; zeros when the stream does not exist."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:
        return 0, 0, 0
    length = await redis.xlen(stream)
    for g in groups:
        if _s(g["name"]) == group:
            return length, int(g["pending"]), await _lag(redis, stream, g)
    return length, 0, length


async def queue_stats(redis: aioredis.Redis, run_id: str) -> QueueStats:
    k = RunKeys(run_id)
    (pl, pp, pb), (el, ep, eb) = await asyncio.gather(
        _group_depth(redis, k.prompts, ROLLOUT_GROUP), _group_depth(redis, k.experience, TRAINER_GROUP)
    )
    dead = {_s(s): int(n) for s, n in (await redis.hgetall(k.dead_count)).items()}
    issued, trained, released, version = await redis.mget(k.issued, k.trained, k.released, k.policy_version)
    return QueueStats(
        prompts_length=pl,
        prompts_pending=pp,
        prompts_backlog=pb,
        experience_length=el,
        experience_pending=ep,
        experience_backlog=eb,
        dead_letters=sum(dead.values()),
        dead_by_stream=dead,
        issued=int(issued or 0),
        trained=int(trained or 0),
        released=int(released or 0),
        policy_version=int(version) if version is not None else None,
    )


async def dead_letters(redis: aioredis.Redis, run_id: str, count: int = 100) -> list[dict[str, Any]]:
    """The newest dead letters (newest first) as dicts: id, source, entry id, group, reason, consumer, payload."""
    rows = await redis.xrevrange(RunKeys(run_id).dead, count=count)
    out = []
    for raw_id, fields in rows:
        d = {_s(key): (v if key in (b"payload", "payload") else _s(v)) for key, v in fields.items()}
        d["dead_id"] = _s(raw_id)
        out.append(d)
    return out


async def delete_run(redis: aioredis.Redis, run_id: str) -> int:
    """Delete every key of a run (streams, groups, counters, issued ids). For tests and starting a run over."""
    return int(await redis.delete(*RunKeys(run_id).all()))
