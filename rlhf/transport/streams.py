"""Durable queues between the trainer and the rollout replicas: Redis Streams with consumer groups.

:class:`PromptQueue` (``rlhf:{run}:prompts``, group ``rollout``) and :class:`ExperienceQueue`
(``rlhf:{run}:experience``, group ``trainer``) share :class:`_StreamQueue` (read, ack, reclaim, dead letters to
``rlhf:{run}:dead``); :func:`drop_trained` drops the records of jobs already trained. Use a client made by
:func:`~rlhf.transport.connection.connect` (with a wait policy, see :func:`~rlhf.transport.connection.waited`).

Design (at least once, idempotent publishing, experience before ack, trimming, dead letters):
docs/reliability.md#the-guarantees; Redis HA: docs/redis-ha.md.
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlhf.transport.codec import (
    Experience,
    MalformedRecord,
    PromptJob,
    decode_experience,
    decode_prompt_job,
    encode,
    validate_experience,
    validate_prompt_job,
)
from rlhf.transport.connection import NO_WAIT, WaitPolicy, one, wait_policy, waited
from rlhf.transport.connection import connect as connect  # re-exported: rlhf.transport.streams.connect
from rlhf.transport.keys import PAYLOAD_FIELD, ROLLOUT_GROUP, TRAINER_GROUP, RunKeys
from rlhf.transport.stream_admin import group_backlog, trim_stream

if TYPE_CHECKING:  # pragma: no cover
    from rlhf.transport.admission import Admission

M = TypeVar("M", PromptJob, Experience)
Record = tuple[str, M]  # (stream entry id, decoded message)


def _s(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def _entries(resp: Any) -> list[tuple[bytes, dict | None]]:
    """XREADGROUP reply (RESP2 list or RESP3 dict) -> [(id, fields)] of the single stream read."""
    if not resp:
        return []
    if isinstance(resp, dict):
        (value,) = resp.values()
        return list(value[0]) if value and isinstance(value[0], list) else list(value)
    return list(resp[0][1])


# Scripts. Each runs atomically and is written to the AOF as one unit (effects replication, MULTI/EXEC). They are
# not rolled back when a command fails half-way: each checks first, writes, and acknowledges last, so a failed
# write leaves the source entry pending (delivered again), never lost.

# KEYS: jobs hash, prompts stream, issued, trained, released. ARGV: job_id, payload, capacity (-1 = unbounded).
_PUBLISH_JOB = """
local existing = redis.call('HGET', KEYS[1], ARGV[1])
if existing then return {'duplicate', existing} end
local cap = tonumber(ARGV[3])
if cap >= 0 then
  local inflight = tonumber(redis.call('GET', KEYS[3]) or '0') - tonumber(redis.call('GET', KEYS[4]) or '0')
                   - tonumber(redis.call('GET', KEYS[5]) or '0')
  if inflight >= cap then return {'full', tostring(inflight)} end
end
local id = redis.call('XADD', KEYS[2], '*', 'pb', ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], id)
redis.call('INCR', KEYS[3])
return {'published', id}
"""

# KEYS: prompts stream, experience stream. ARGV: group, prompt entry id, payload.
_PUBLISH_AND_ACK = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then return false end
local id = redis.call('XADD', KEYS[2], '*', 'pb', ARGV[3])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return id
"""

# KEYS: source stream, dead stream, dead_count hash, released counter, issued jobs hash, released jobs hash.
# ARGV: group, entry id, reason, payload, consumer, unix ms, dead stream cap, job id ('' when it did not parse).
# The admission slot is released only for a job this run issued, once per job: a foreign or repeated record must
# not let more jobs into flight than the staleness bound allows.
_DEAD_LETTER = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'source', KEYS[1], 'id', ARGV[2], 'group', ARGV[1],
           'reason', ARGV[3], 'consumer', ARGV[5], 'at_unix_ms', ARGV[6], 'payload', ARGV[4], 'job_id', ARGV[8])
redis.call('HINCRBY', KEYS[3], KEYS[1], 1)
if ARGV[8] ~= '' and redis.call('HEXISTS', KEYS[5], ARGV[8]) == 1
   and redis.call('HSETNX', KEYS[6], ARGV[8], '1') == 1 then
  redis.call('INCR', KEYS[4])
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# KEYS: stream. ARGV: group, consumer, min idle ms, start id, count. Claims without returning data (JUSTID).
_CLAIM_IDS = """
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5], 'JUSTID')
return {r[1], #r[2]}
"""


# The idle time a handed-back entry gets (a day): past every consumer's reclaim threshold.
HANDED_BACK_IDLE_MS = 86_400_000


@dataclass
class _ConsumerState:
    draining: bool = True  # still returning this consumer's own pending entries (id cursor), before ">"
    cursor: str = "0-0"
    skip: set[str] = field(default_factory=set)  # ids already handed out by reclaim() while draining


@dataclass
class LocalCounters:
    """What this queue object saw (per process); the Redis-wide numbers are in
    :class:`~rlhf.transport.stream_admin.QueueStats`."""

    delivered: int = 0
    dead_lettered: int = 0
    vanished: int = 0  # pending ids whose entry no longer exists (acked away)
    reclaimed: int = 0


class _StreamQueue(Generic[M]):
    group: str
    kind: str
    wait_reads = False  # WAIT after reads too (the trainer's: it must not train on a record a failover takes back)

    def __init__(
        self,
        redis: aioredis.Redis,
        run_id: str,
        *,
        max_deliveries: int | None = None,
        dead_maxlen: int = 100_000,
        wait: WaitPolicy | None = None,
    ):
        kwargs = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", {})
        if kwargs.get("decode_responses"):
            raise ValueError("the Redis client must use decode_responses=False (payloads are binary); see connect()")
        self.redis = redis
        self.keys = RunKeys(run_id)
        self.run_id = run_id
        self.max_deliveries = max_deliveries
        self.dead_maxlen = dead_maxlen
        self.wait = wait if wait is not None else wait_policy(redis)  # see waited()
        self.counters = LocalCounters()
        self._groups_ready = False
        self._consumers: dict[str, _ConsumerState] = {}
        self._dead_script = redis.register_script(_DEAD_LETTER)
        self._claim_ids_script = redis.register_script(_CLAIM_IDS)

    # ------------------------------------------------------------------------------------------------- plumbing

    @property
    def stream(self) -> str:
        raise NotImplementedError

    def _decode(self, data: bytes | None) -> M:
        raise NotImplementedError

    def _job_id_of(self, data: bytes | None) -> str:
        """The job id of a payload, or '' when it does not decode."""
        try:
            return self._decode(data).job_id
        except MalformedRecord as err:
            return err.job_id

    async def ensure_groups(self) -> None:
        """Create the stream and its consumer group at id 0 (so nothing published before is skipped). Idempotent."""
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
        self._groups_ready = True

    async def _ready(self) -> None:
        if not self._groups_ready:
            await self.ensure_groups()

    async def _xreadgroup(self, consumer: str, start: str, count: int, block_ms: int | None) -> list:
        await self._ready()
        for attempt in range(2):
            try:
                (resp,) = await waited(
                    self.redis,
                    self.wait if self.wait_reads else NO_WAIT,
                    self.keys.fence,
                    lambda c: one(
                        c.xreadgroup(self.group, consumer, {self.stream: start}, count=count, block=block_ms)
                    ),
                )
                return _entries(resp)
            except ResponseError as err:  # the group vanished (a Redis without persistence restarted)
                if "NOGROUP" not in str(err) or attempt:
                    raise
                await self.ensure_groups()
        return []

    async def dead_letter(self, items: Sequence[tuple[str, bytes | None, str, str]], consumer: str) -> int:
        """Move (entry id, payload, reason, job id) to the dead-letter stream, ack them here, count them; atomic per
        record. Only entries still pending in this group move (returns how many did). For a consumer that finds a
        record unusable after decoding it (the trainer: token ids outside its vocabulary)."""
        if not items:
            return 0
        now = str(int(time.time() * 1000))
        k = self.keys
        keys = [self.stream, k.dead, k.dead_count, k.released, k.jobs, k.released_jobs]

        async def queue(c: Any) -> list:
            out = []
            for entry_id, payload, reason, job_id in items:
                args = [self.group, entry_id, reason, payload or b"", consumer, now, self.dead_maxlen, job_id]
                out.append(await self._dead_script(keys=keys, args=args, client=c))
            return out

        moved = sum(int(x) for x in await waited(self.redis, self.wait, k.fence, queue, batch=True))
        self.counters.dead_lettered += moved
        return moved

    async def _decode_entries(
        self, entries: Iterable[tuple[bytes, dict | None]], consumer: str, skip: Container[str] = ()
    ) -> list[Record]:
        out: list[Record] = []
        dead: list[tuple[str, bytes | None, str, str]] = []
        vanished: list[str] = []
        for raw_id, fields in entries:
            entry_id = _s(raw_id)
            if entry_id in skip:
                continue
            if not fields:  # a pending id whose entry was deleted: nothing left to deliver
                vanished.append(entry_id)
                continue
            payload = fields.get(PAYLOAD_FIELD)
            if payload is None:
                payload = fields.get(PAYLOAD_FIELD.decode())
            try:
                out.append((entry_id, self._decode(payload)))
            except MalformedRecord as err:
                dead.append((entry_id, payload, err.reason, err.job_id))
        if vanished:
            await self.redis.xack(self.stream, self.group, *vanished)
            self.counters.vanished += len(vanished)
        await self.dead_letter(dead, consumer)
        self.counters.delivered += len(out)
        return out

    # ------------------------------------------------------------------------------------------------- consuming

    async def read(self, consumer: str, count: int = 16, block_ms: int | None = 1000) -> list[Record]:
        """Up to ``count`` records for ``consumer`` as (entry id, message), oldest first.

        The first calls of a consumer name in this object return the entries already pending for that name (a
        restarted consumer gets back what it had read but not acknowledged); then new entries (``>``), waiting up
        to ``block_ms`` for one (``None``: do not wait; ``0``: wait forever, as in Redis). Malformed records are
        dead-lettered and left out, so fewer than ``count`` (even none) may come back before the stream is empty.
        After a connection error the next call drains the pending list again (a lost reply strands nothing).
        """
        if count <= 0:
            raise ValueError("count must be positive")
        st = self._consumers.setdefault(consumer, _ConsumerState())
        while st.draining:
            entries = await self._xreadgroup(consumer, st.cursor, count, None)
            if not entries:
                st.draining = False
                st.skip.clear()
                break
            st.cursor = _s(entries[-1][0])
            out = await self._decode_entries(entries, consumer, st.skip)
            if out:
                return out
        try:
            entries = await self._xreadgroup(consumer, ">", count, block_ms)
        except (RedisConnectionError, RedisTimeoutError):
            # The server may have delivered entries whose reply never arrived: they sit in this consumer's pending
            # list. Drain it again on the next call so they are not stranded (they may come twice: at least once).
            self._consumers[consumer] = _ConsumerState()
            raise
        return await self._decode_entries(entries, consumer)

    async def ack(self, entry_ids: Iterable[str | bytes]) -> int:
        """Acknowledge entries in this queue's group; returns how many were pending (re-acking is harmless)."""
        ids = list(entry_ids)
        if not ids:
            return 0

        async def queue(c: Any) -> list:
            return [await c.xack(self.stream, self.group, *ids[i : i + 1000]) for i in range(0, len(ids), 1000)]

        return sum(int(n) for n in await waited(self.redis, self.wait, self.keys.fence, queue))

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int = 16) -> list[Record]:
        """Take over up to ``count`` entries pending longer than ``min_idle_ms`` in the group (a dead consumer's)
        and return them (XAUTOCLAIM). With ``max_deliveries`` set, an entry delivered more often than that is
        dead-lettered instead ("poison": it killed every consumer that took it).
        """
        await self._ready()
        st = self._consumers.setdefault(consumer, _ConsumerState())
        cursor: bytes | str = "0-0"
        claimed: list[tuple[bytes, dict | None]] = []
        while len(claimed) < count:
            resp = await self.redis.xautoclaim(
                self.stream, self.group, consumer, min_idle_ms, start_id=cursor, count=count - len(claimed)
            )
            cursor, entries = resp[0], resp[1]
            claimed.extend(entries)
            if _s(cursor) == "0-0":
                break
        if not claimed:
            return []
        self.counters.reclaimed += len(claimed)
        if self.max_deliveries is not None:
            async with self.redis.pipeline(transaction=False) as pipe:
                for raw_id, _ in claimed:
                    pipe.xpending_range(self.stream, self.group, raw_id, raw_id, 1, consumer)
                infos = await pipe.execute()
            poison, keep = [], []
            for (raw_id, fields), info in zip(claimed, infos, strict=True):
                times = info[0]["times_delivered"] if info else 0
                if times > self.max_deliveries and fields:
                    reason = f"delivered {times} times (max_deliveries={self.max_deliveries}); consumers kept dying"
                    payload = fields.get(PAYLOAD_FIELD)
                    poison.append((_s(raw_id), payload, reason, self._job_id_of(payload)))
                else:
                    keep.append((raw_id, fields))
            await self.dead_letter(poison, consumer)
            claimed = keep
        out = await self._decode_entries(claimed, consumer)
        if st.draining:
            st.skip.update(e for e, _ in out)
        return out

    async def hand_back(self, consumer: str, entry_ids: Sequence[str]) -> int:
        """Give up ``consumer``'s pending ``entry_ids`` without finishing them (a replica leaving): each stays
        pending, its idle time set past any reclaim threshold (XCLAIM IDLE, JUSTID: not counted as a delivery), so
        the next :meth:`reclaim` of any live consumer takes it instead of waiting out the idle timeout. Returns how
        many were still pending."""
        if not entry_ids:
            return 0
        await self._ready()
        ids = await self.redis.xclaim(
            self.stream, self.group, consumer, 0, list(entry_ids), idle=HANDED_BACK_IDLE_MS, justid=True
        )
        return len(ids)

    async def recover(self, consumer: str, min_idle_ms: int = 0) -> int:
        """Give ``consumer`` every entry pending in the group (idle at least ``min_idle_ms``); the next
        :meth:`read` calls return them first. For a group with one consumer, such as the trainer after a restart
        under a new name. Returns how many entries it now holds that way.
        """
        await self._ready()
        cursor: bytes | str = "0-0"
        total = 0
        while True:
            cursor, n = await self._claim_ids_script(
                keys=[self.stream], args=[self.group, consumer, min_idle_ms, cursor, 1000]
            )
            total += int(n)
            if _s(cursor) == "0-0":
                break
        self._consumers[consumer] = _ConsumerState()
        self.counters.reclaimed += total
        return total

    # ------------------------------------------------------------------------------------------------- depth, trim

    async def length(self) -> int:
        return await self.redis.xlen(self.stream)

    async def pending(self) -> int:
        """Entries delivered to some consumer of the group and not yet acknowledged."""
        await self._ready()
        return int((await self.redis.xpending(self.stream, self.group))["pending"])

    async def backlog(self) -> int:
        """Entries not yet delivered to the group."""
        await self._ready()
        return await group_backlog(self.redis, self.stream, self.group)

    async def trim(self) -> int:
        """Delete the entries every group has delivered and acknowledged; returns how many were deleted.

        The bound is the smallest of, over the stream's groups, the oldest pending id and the first id after the
        group's last-delivered-id; ``XTRIM MINID`` (exact) keeps everything from it on. Safe against concurrent
        consumers: a read moves last-delivered forward and creates pending entries only above it, a claim moves
        pending entries between consumers, an ack removes them, so the bound never passes a live entry.
        A stream without a group is not trimmed.
        """
        await self._ready()
        return await trim_stream(self.redis, self.stream)


# ----------------------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class PublishResult:
    job_id: str
    status: Literal["published", "duplicate", "full"]
    entry_id: str | None  # the job's entry in the prompts stream (the earlier one for a duplicate); None when full
    in_flight: int | None = None  # when full: the jobs in flight that made it so

    @property
    def published(self) -> bool:
        return self.status == "published"


class PromptQueue(_StreamQueue[PromptJob]):
    """``rlhf:{run}:prompts``: the trainer publishes prompt jobs, rollout replicas read them (group ``rollout``).

    A replica acknowledges a job with :meth:`ExperienceQueue.publish_and_ack` (never before its experience is
    written). Jobs of a replica that died stay pending; another replica takes them with :meth:`reclaim`.
    ``max_deliveries`` (default 10) dead-letters a job that was handed out that many times without finishing.
    """

    group = ROLLOUT_GROUP
    kind = "prompts"

    def __init__(self, redis: aioredis.Redis, run_id: str, *, max_deliveries: int | None = 10, **kwargs: Any):
        super().__init__(redis, run_id, max_deliveries=max_deliveries, **kwargs)
        self._publish_script = redis.register_script(_PUBLISH_JOB)

    @property
    def stream(self) -> str:
        return self.keys.prompts

    def _decode(self, data: bytes | None) -> PromptJob:
        return decode_prompt_job(data, self.run_id)

    def _check_publishable(self, job: PromptJob, admission: Admission | None) -> None:
        try:
            validate_prompt_job(job, self.run_id)
        except MalformedRecord as err:
            raise ValueError(f"refusing to publish: {err.reason}") from None
        if admission is not None and admission.keys != self.keys:
            raise ValueError(f"admission is for run {admission.keys.run_id!r}, this queue for {self.run_id!r}")

    def _publish_call(self, job: PromptJob, admission: Admission | None, client: Any) -> Any:
        self._check_publishable(job, admission)
        capacity = admission.capacity if admission is not None else -1
        k = self.keys
        return self._publish_script(
            keys=[k.jobs, k.prompts, k.issued, k.trained, k.released],
            args=[job.job_id, encode(job), capacity],
            client=client,
        )

    @staticmethod
    def _result(job: PromptJob, raw: Sequence) -> PublishResult:
        status = _s(raw[0])
        if status == "full":
            return PublishResult(job.job_id, "full", None, int(raw[1]))
        return PublishResult(job.job_id, status, _s(raw[1]))  # type: ignore[arg-type]

    async def publish(self, job: PromptJob, admission: Admission | None = None) -> PublishResult:
        """Publish ``job`` unless its job_id was issued before (then: status ``duplicate`` and the first entry id).

        With ``admission``, the job is published only while the jobs in flight stay under its capacity (checked
        in the same atomic script): otherwise status ``full`` and nothing is written. ``ValueError`` for a job
        without job_id / prompt, or for another run.
        """
        return (await self.publish_many([job], admission))[0]

    async def publish_many(self, jobs: Sequence[PromptJob], admission: Admission | None = None) -> list[PublishResult]:
        """:meth:`publish` for many jobs in one round trip (each job atomic; in order, so once ``full`` is reached
        the rest are ``full`` too unless one was a duplicate)."""
        await self._ready()
        calls = [(job, admission) for job in jobs]  # validated before anything is sent

        async def queue(c: Any) -> list:
            return [await self._publish_call(job, adm, c) for job, adm in calls]

        for job in jobs:
            self._check_publishable(job, admission)
        raws = await waited(self.redis, self.wait, self.keys.fence, queue, batch=True)
        return [self._result(j, r) for j, r in zip(jobs, raws, strict=True)]

    async def issued_entry(self, job_id: str) -> str | None:
        """The prompts-stream entry id a job was published under, or None if it never was (or was forgotten)."""
        return _s(await self.redis.hget(self.keys.jobs, job_id))

    async def forget_jobs(self, job_ids: Iterable[str]) -> int:
        """Drop job ids from the issued-ids hash (memory): only for jobs the trainer will never publish again,
        e.g. trained and covered by a checkpoint. A forgotten job published again is a new job."""
        ids = list(job_ids)
        return int(await self.redis.hdel(self.keys.jobs, *ids)) if ids else 0


# -------------------------------------------------------------------------------------------------- experience


class ExperienceQueue(_StreamQueue[Experience]):
    """``rlhf:{run}:experience``: rollout replicas publish, the trainer reads (group ``trainer``).

    The trainer acknowledges records only after the step they fed is covered by a checkpoint (:meth:`ack` takes
    the entry ids); after a restart :meth:`read` hands back its unacknowledged records first (same consumer name),
    or :meth:`recover` moves them to a new name. Drop records of jobs already trained with :func:`drop_trained`.
    """

    group = TRAINER_GROUP
    kind = "experience"
    wait_reads = True

    def __init__(self, redis: aioredis.Redis, run_id: str, **kwargs: Any):
        super().__init__(redis, run_id, **kwargs)
        self._publish_ack_script = redis.register_script(_PUBLISH_AND_ACK)

    @property
    def stream(self) -> str:
        return self.keys.experience

    def _decode(self, data: bytes | None) -> Experience:
        return decode_experience(data, self.run_id)

    def _payload(self, experience: Experience) -> bytes:
        try:
            validate_experience(experience, self.run_id)
        except MalformedRecord as err:
            raise ValueError(f"refusing to publish: {err.reason}") from None
        return encode(experience)

    async def publish(self, experience: Experience) -> str:
        """Append an experience record; returns its entry id. Prefer :meth:`publish_and_ack` in a replica."""
        await self._ready()
        payload = self._payload(experience)
        return _s(await self.redis.xadd(self.stream, {PAYLOAD_FIELD: payload}))

    async def publish_and_ack(self, experience: Experience, prompt_entry_id: str | bytes) -> str | None:
        """Acknowledge prompt job ``prompt_entry_id`` (group ``rollout``) and append ``experience``, atomically.

        Returns the experience entry id, or None when the prompt job was no longer pending (another replica that
        reclaimed it finished first, or it was dead-lettered): then nothing is written, which keeps duplicates
        out of the experience stream.
        """
        await self._ready()
        payload = self._payload(experience)
        keys = [self.keys.prompts, self.keys.experience]
        args = [ROLLOUT_GROUP, prompt_entry_id, payload]
        (raw,) = await waited(
            self.redis,
            self.wait,
            self.keys.fence,
            lambda c: one(self._publish_ack_script(keys=keys, args=args, client=c)),
        )
        return _s(raw)


@dataclass
class Deduped:
    """Records split by :func:`drop_trained`; ack ``duplicate_ids`` together with the fresh ones."""

    fresh: list[tuple[str, Experience]]
    duplicate_ids: list[str]

    @property
    def duplicates(self) -> int:
        return len(self.duplicate_ids)


def drop_trained(records: Iterable[tuple[str, Experience]], trained_job_ids: Container[str]) -> Deduped:
    """Consumer-side idempotence: leave out records whose job_id is in ``trained_job_ids`` (the trainer's
    checkpointed set) or already came earlier in ``records``."""
    fresh: list[tuple[str, Experience]] = []
    dup: list[str] = []
    seen: set[str] = set()
    for entry_id, exp in records:
        if exp.job_id in trained_job_ids or exp.job_id in seen:
            dup.append(entry_id)
        else:
            seen.add(exp.job_id)
            fresh.append((entry_id, exp))
    return Deduped(fresh, dup)
