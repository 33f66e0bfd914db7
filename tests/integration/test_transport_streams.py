"""rlhf.transport queues against a real redis-server (fixture ``redis_server``: private port, AOF on).

Each test runs its async body with ``asyncio.run`` (no pytest-asyncio needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from rlhf.transport import (
    Admission,
    ExperienceQueue,
    PromptQueue,
    connect,
    dead_letters,
    drop_trained,
    get_policy_version,
    publish_policy_version,
    queue_stats,
)
from rlhf.transport.keys import PAYLOAD_FIELD, RunKeys
from rlhf.v1 import common_pb2, experience_pb2
from tests.support import make_experience, make_prompt_job, make_sample

RUN = "t1"


def make_job(i: int, run: str = RUN) -> experience_pb2.PromptJob:
    return make_prompt_job(f"job-{i}", [1, 2, 3 + i], run_id=run, data_index=i, params={"n": 2})


def make_exp(job: experience_pb2.PromptJob, replica: str = "r1", version: int = 0) -> experience_pb2.Experience:
    sample = make_sample(
        [7, 8],
        sampling_logprobs=[-0.5, -1.0],
        policy_version=version,
        score=1.0,
        score_status=common_pb2.ITEM_STATUS_UNSPECIFIED,
    )
    return make_experience(job=job, samples=[sample, sample], replica_id=replica)


@contextlib.asynccontextmanager
async def session(server):
    r = connect(server.url)
    try:
        yield r, PromptQueue(r, RUN), ExperienceQueue(r, RUN)
    finally:
        await r.aclose()


def test_publish_read_ack(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, eq):
            for i in range(3):
                assert (await pq.publish(make_job(i))).published
            got = await pq.read("r1", count=10, block_ms=100)
            assert [j.job_id for _, j in got] == ["job-0", "job-1", "job-2"]
            assert got[1][1] == make_job(1)
            assert await pq.pending() == 3 and await pq.backlog() == 0
            assert await pq.read("r1", count=10, block_ms=50) == []  # nothing new
            for entry_id, job in got:
                assert await eq.publish_and_ack(make_exp(job), entry_id) is not None
            assert await pq.pending() == 0
            exps = await eq.read("trainer", count=10, block_ms=100)
            assert [e.job_id for _, e in exps] == ["job-0", "job-1", "job-2"]
            assert exps[0][1] == make_exp(make_job(0))
            assert await eq.ack([i for i, _ in exps]) == 3
            assert await eq.ack([i for i, _ in exps]) == 0  # re-acking is harmless
            st = await queue_stats(r, RUN)
            assert (st.prompts_length, st.prompts_pending, st.prompts_backlog) == (3, 0, 0)
            assert (st.experience_length, st.experience_pending, st.experience_backlog) == (3, 0, 0)
            assert st.issued == 3 and st.dead_letters == 0

    asyncio.run(body())


def test_blocking_read_wakes_on_publish(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, _):
            await pq.ensure_groups()

            async def later():
                await asyncio.sleep(0.2)
                r2 = connect(redis_server.url)
                await PromptQueue(r2, RUN).publish(make_job(0))
                await r2.aclose()

            t0 = time.monotonic()
            task = asyncio.create_task(later())
            got = await pq.read("r1", count=1, block_ms=5000)
            await task
            assert [j.job_id for _, j in got] == ["job-0"]
            assert 0.15 < time.monotonic() - t0 < 3

    asyncio.run(body())


def test_publish_is_idempotent_by_job_id(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, _):
            first = await pq.publish(make_job(0))
            again = await pq.publish(make_job(0))  # a restarted trainer publishing the same job
            assert first.status == "published" and again.status == "duplicate"
            assert again.entry_id == first.entry_id
            res = await pq.publish_many([make_job(0), make_job(1), make_job(1), make_job(2)])
            assert [x.status for x in res] == ["duplicate", "published", "duplicate", "published"]
            assert await pq.length() == 3
            assert (await queue_stats(r, RUN)).issued == 3
            assert await pq.issued_entry("job-1") == res[1].entry_id
            with pytest.raises(ValueError, match="job_id is empty"):
                await pq.publish(make_prompt_job(prompt_ids=[1]))
            with pytest.raises(ValueError, match="belongs to run"):
                await pq.publish(make_job(9, run="other"))

    asyncio.run(body())


def test_dead_replica_jobs_are_reclaimed_after_idle_timeout(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, eq):
            for i in range(4):
                await pq.publish(make_job(i))
            dead = await pq.read("replica-a", count=2, block_ms=100)  # replica-a "dies" holding two jobs
            live = await pq.read("replica-b", count=2, block_ms=100)
            assert len(dead) == 2 and len(live) == 2
            for entry_id, job in live:
                await eq.publish_and_ack(make_exp(job, "replica-b"), entry_id)
            assert await pq.reclaim("replica-b", min_idle_ms=400) == []  # not idle long enough yet
            await asyncio.sleep(0.5)
            taken = await pq.reclaim("replica-b", min_idle_ms=400, count=10)
            assert sorted(j.job_id for _, j in taken) == sorted(j.job_id for _, j in dead)
            for entry_id, job in taken:
                assert await eq.publish_and_ack(make_exp(job, "replica-b"), entry_id) is not None
            # replica-a was only slow: its late results are not written twice
            for entry_id, job in dead:
                assert await eq.publish_and_ack(make_exp(job, "replica-a"), entry_id) is None
            assert await pq.pending() == 0
            exps = await eq.read("trainer", count=10, block_ms=100)
            assert sorted(e.job_id for _, e in exps) == [f"job-{i}" for i in range(4)]
            assert {e.replica_id for _, e in exps} == {"replica-b"}

    asyncio.run(body())


def test_restarted_replica_gets_its_own_pending_jobs_first(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, _):
            for i in range(5):
                await pq.publish(make_job(i))
            first = await pq.read("replica-a", count=3, block_ms=100)
            # the replica restarts under the same name (a StatefulSet pod): a fresh queue object
            pq2 = PromptQueue(r, RUN)
            again = await pq2.read("replica-a", count=2, block_ms=100)
            again += await pq2.read("replica-a", count=2, block_ms=100)
            assert [e for e, _ in again] == [e for e, _ in first]
            new = await pq2.read("replica-a", count=10, block_ms=100)
            assert [j.job_id for _, j in new] == ["job-3", "job-4"]
            assert await pq2.read("replica-a", count=10, block_ms=50) == []

    asyncio.run(body())


def test_publish_and_ack_is_atomic(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, eq):
            await pq.publish(make_job(0))
            await pq.publish(make_job(1))
            (e0, j0), (e1, j1) = await pq.read("r1", count=2, block_ms=100)
            # both: the experience is written and the job acknowledged
            assert await eq.publish_and_ack(make_exp(j0), e0) is not None
            assert await eq.length() == 1 and await pq.pending() == 1
            # neither: the experience write fails (the key holds a string) -> the job stays pending
            await r.rename(eq.stream, "saved")
            await r.set(eq.stream, "not a stream")
            with pytest.raises(Exception, match="WRONGTYPE"):
                await eq.publish_and_ack(make_exp(j1), e1)
            assert await pq.pending() == 1
            await r.delete(eq.stream)
            await r.rename("saved", eq.stream)
            # racing replicas finishing the same job: exactly one record
            results = await asyncio.gather(*(eq.publish_and_ack(make_exp(j1, f"r{k}"), e1) for k in range(8)))
            assert sum(x is not None for x in results) == 1
            assert await eq.length() == 2 and await pq.pending() == 0
            with pytest.raises(ValueError, match="sampling_logprobs"):
                bad = make_exp(j1)
                bad.samples[0].sampling_logprobs.append(-1.0)
                await eq.publish_and_ack(bad, e1)
            with pytest.raises(ValueError, match="non-finite"):
                bad = make_exp(j1)
                bad.samples[1].sampling_logprobs[0] = float("nan")
                await eq.publish(bad)

    asyncio.run(body())


def test_trainer_restart_redelivers_unacked_experience(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, eq):
            jobs = [make_job(i) for i in range(6)]
            for j in jobs:
                await eq.publish(make_exp(j))
            batch = await eq.read("trainer-0", count=4, block_ms=100)
            trained = {e.job_id for _, e in batch}  # trained on 4 ...
            await eq.ack([i for i, _ in batch[:2]])  # ... but only 2 are covered by a checkpoint when it dies
            ckpt_trained = {e.job_id for _, e in batch[:2]}

            # restart under the same name: pending first, then new
            eq2 = ExperienceQueue(r, RUN)
            got = await eq2.read("trainer-0", count=10, block_ms=100)
            assert [e.job_id for _, e in got] == ["job-2", "job-3"]
            got += await eq2.read("trainer-0", count=10, block_ms=100)
            assert [e.job_id for _, e in got] == ["job-2", "job-3", "job-4", "job-5"]
            assert trained - ckpt_trained <= {e.job_id for _, e in got}

            # restart under a new name: recover() takes everything pending in the group
            eq3 = ExperienceQueue(r, RUN)
            assert await eq3.recover("trainer-new") == 4
            got3 = await eq3.read("trainer-new", count=10, block_ms=100)
            assert [e.job_id for _, e in got3] == ["job-2", "job-3", "job-4", "job-5"]
            assert await eq3.read("trainer-new", count=10, block_ms=50) == []

    asyncio.run(body())


def test_drop_trained_filters_duplicates():
    jobs = [make_job(i) for i in range(4)]
    records = [(f"1-{i}", make_exp(j)) for i, j in enumerate(jobs)] + [("1-9", make_exp(jobs[3]))]
    d = drop_trained(records, trained_job_ids={"job-0", "job-2"})
    assert [e.job_id for _, e in d.fresh] == ["job-1", "job-3"]
    assert d.duplicate_ids == ["1-0", "1-2", "1-9"] and d.duplicates == 3


def test_trim_never_drops_pending_or_undelivered(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, _):
            assert await pq.trim() == 0  # empty stream
            for i in range(10):
                await pq.publish(make_job(i))
            read = await pq.read("r1", count=6, block_ms=100)
            ids = [e for e, _ in read]
            await pq.ack([ids[0], ids[1], ids[3], ids[4]])  # ids[2] and ids[5] still pending, 4 undelivered
            assert await pq.trim() == 2  # only the two before the oldest pending entry
            assert await pq.length() == 8
            assert (await pq.backlog(), await pq.pending()) == (4, 2)
            await pq.ack([ids[2]])
            assert await pq.trim() == 3  # up to ids[5], still pending
            assert (await r.xrange(pq.stream, count=1))[0][0].decode() == ids[5]
            # the pending one is still claimable, the undelivered ones still readable
            await asyncio.sleep(0.05)
            assert [e for e, _ in await pq.reclaim("r2", min_idle_ms=10)] == [ids[5]]
            rest = await pq.read("r2", count=10, block_ms=100)
            assert [j.job_id for _, j in rest] == ["job-6", "job-7", "job-8", "job-9"]
            await pq.ack([ids[5]] + [e for e, _ in rest])
            assert await pq.trim() == 5
            assert await pq.length() == 0
            assert await pq.read("r2", count=10, block_ms=50) == []
            await pq.publish(make_job(10))
            assert [j.job_id for _, j in await pq.read("r2", count=10, block_ms=100)] == ["job-10"]
            st = await queue_stats(r, RUN)
            assert st.prompts_backlog == 0 and st.prompts_pending == 1

    asyncio.run(body())


def test_admission_bounds_staleness(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, eq):
            sync = Admission(r, RUN, max_staleness=0, batch_size=4)
            assert sync.capacity == 4
            res = await pq.publish_many([make_job(i) for i in range(6)], admission=sync)
            assert [x.status for x in res] == ["published"] * 4 + ["full"] * 2
            assert res[4].in_flight == 4 and await sync.free() == 0
            # the synchronous trainer must train the whole batch before the next one is issued
            await sync.mark_trained(3)
            assert await sync.free() == 3
            with pytest.raises(TimeoutError):
                await sync.wait_free(4, timeout_s=0.1)
            await sync.mark_trained(1)
            assert await sync.wait_free(4, timeout_s=1) == 4
            assert (await pq.publish(make_job(0), admission=sync)).status == "duplicate"  # not counted
            res = await pq.publish_many([make_job(i) for i in range(4, 10)], admission=sync)
            assert [x.status for x in res] == ["published"] * 4 + ["full"] * 2

            # max_staleness=1: one batch ahead of the trainer
            ahead = Admission(r, RUN, max_staleness=1, batch_size=4)
            assert ahead.capacity == 8
            res = await pq.publish_many([make_job(i) for i in range(8, 14)], admission=ahead)
            assert [x.status for x in res] == ["published"] * 4 + ["full"] * 2
            st = await ahead.state()
            assert (st.issued, st.trained, st.in_flight, st.free) == (12, 4, 8, 0)

            # a restarted trainer resumes the counters from Redis and rewinds 'trained' to its checkpoint
            again = Admission(r, RUN, max_staleness=1, batch_size=4)
            await again.mark_trained(4)
            assert (await again.state()).trained == 8
            await again.restore(trained=4)
            assert (await again.state()).in_flight == 8

            # a dead-lettered record of an issued job releases its slot, once; records of jobs never issued (garbage,
            # or a well-formed job id this run never published) release nothing: they must not loosen the bound
            await r.xadd(pq.stream, {PAYLOAD_FIELD: b"\xff\xfe garbage"})
            foreign = make_exp(make_job(99))
            foreign.samples[0].score, foreign.samples[0].score_status = float("nan"), common_pb2.ITEM_STATUS_OK
            await r.xadd(eq.stream, {PAYLOAD_FIELD: foreign.SerializeToString()})
            await pq.read("r1", count=100, block_ms=100)
            await eq.read("t", count=100, block_ms=100)
            st = await again.state()
            assert (st.released, st.in_flight) == (0, 8)
            for _ in range(2):  # the same issued job dead-lettered twice releases one slot
                poisoned = make_exp(make_job(5))
                poisoned.samples[1].sampling_logprobs[0] = float("inf")
                await r.xadd(eq.stream, {PAYLOAD_FIELD: poisoned.SerializeToString()})
                assert await eq.read("t", count=100, block_ms=100) == []
            st = await again.state()
            assert (st.released, st.in_flight) == (1, 7)
            assert (await queue_stats(r, RUN)).dead_letters == 4
            with pytest.raises(ValueError):
                Admission(r, RUN, max_staleness=-1, batch_size=4)

    asyncio.run(body())


def test_malformed_records_go_to_dead_letters(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, eq):
            k = RunKeys(RUN)
            await pq.publish(make_job(0))
            await r.xadd(pq.stream, {PAYLOAD_FIELD: b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"})  # bad varint
            await r.xadd(pq.stream, {b"other": b"x"})  # no payload field
            await r.xadd(pq.stream, {PAYLOAD_FIELD: make_prompt_job("no-prompt").SerializeToString()})
            await r.xadd(pq.stream, {PAYLOAD_FIELD: make_job(5, run="other-run").SerializeToString()})
            await pq.publish(make_job(1))
            got = await pq.read("r1", count=10, block_ms=100)  # does not raise
            assert [j.job_id for _, j in got] == ["job-0", "job-1"]
            assert await pq.pending() == 2  # the malformed ones were acknowledged
            letters = await dead_letters(r, RUN)
            reasons = [d["reason"] for d in reversed(letters)]
            assert "not a valid PromptJob" in reasons[0]
            assert "no payload field" in reasons[1]
            assert "neither prompt_ids nor prompt_text" in reasons[2]
            assert "belongs to run" in reasons[3]
            assert letters[-1]["source"] == k.prompts and letters[-1]["consumer"] == "r1"
            assert letters[-1]["payload"].startswith(b"\x0a\xff")

            await r.xadd(eq.stream, {PAYLOAD_FIELD: b"garbage bytes that do not parse \x80\x80"})
            await eq.publish(make_exp(make_job(2)))
            empty = make_exp(make_job(3))
            del empty.samples[:]
            await r.xadd(eq.stream, {PAYLOAD_FIELD: empty.SerializeToString()})
            got = await eq.read("trainer", count=10, block_ms=100)
            assert [e.job_id for _, e in got] == ["job-2"]
            st = await queue_stats(r, RUN)
            assert st.dead_letters == 6
            assert st.dead_by_stream == {k.prompts: 4, k.experience: 2}
            assert pq.counters.dead_lettered == 4 and eq.counters.dead_lettered == 2

    asyncio.run(body())


def test_poison_job_is_dead_lettered_after_max_deliveries(redis_server):
    async def body():
        async with session(redis_server) as (r, _, __):
            pq = PromptQueue(r, RUN, max_deliveries=2)
            await pq.publish(make_job(0))
            assert len(await pq.read("a", count=1, block_ms=100)) == 1  # delivery 1; "a" crashes on it
            await asyncio.sleep(0.02)
            assert len(await pq.reclaim("b", min_idle_ms=10)) == 1  # delivery 2; "b" crashes too
            await asyncio.sleep(0.02)
            assert await pq.reclaim("c", min_idle_ms=10) == []  # delivery 3 > 2: dead-lettered
            (letter,) = await dead_letters(r, RUN)
            assert "delivered 3 times" in letter["reason"]
            assert await pq.pending() == 0

    asyncio.run(body())


def test_policy_version_only_moves_forward(redis_server):
    async def body():
        async with session(redis_server) as (r, _, __):
            assert await get_policy_version(r, RUN) is None
            assert await publish_policy_version(r, RUN, 3) == 3
            assert await publish_policy_version(r, RUN, 3) == 3
            with pytest.raises(ValueError, match="older"):
                await publish_policy_version(r, RUN, 2)
            adm = Admission(r, RUN, 0, 1)
            assert await adm.publish_policy_version(5) == 5
            assert await adm.policy_version() == 5 == (await queue_stats(r, RUN)).policy_version

    asyncio.run(body())


def test_bad_client_and_run_id_are_refused(redis_server):
    with pytest.raises(ValueError, match="decode_responses"):
        PromptQueue(aioredis.Redis.from_url(redis_server.url, decode_responses=True), RUN)
    with pytest.raises(ValueError, match="run_id"):
        PromptQueue(connect(redis_server.url), "bad:run")


def test_read_whose_reply_was_lost_is_delivered_again(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, _):
            for i in range(3):
                await pq.publish(make_job(i))
            real = r.xreadgroup

            async def lossy(*args, **kwargs):  # the server delivers, the reply is lost on the way
                await real(*args, **kwargs)
                raise RedisConnectionError("connection reset")

            r.xreadgroup = lossy
            with pytest.raises(RedisConnectionError):
                await pq.read("r1", count=2, block_ms=100)
            r.xreadgroup = real
            got = await pq.read("r1", count=10, block_ms=100)
            got += await pq.read("r1", count=10, block_ms=100)
            assert [j.job_id for _, j in got] == ["job-0", "job-1", "job-2"]

    asyncio.run(body())


def test_backlog_is_counted_when_redis_cannot_tell_the_lag(redis_server):
    async def body():
        async with session(redis_server) as (r, pq, _):
            res = await pq.publish_many([make_job(i) for i in range(6)])
            await pq.read("r1", count=2, block_ms=100)
            assert await pq.backlog() == 4
            await r.xdel(pq.stream, res[4].entry_id)  # a hole: XINFO GROUPS reports lag nil
            assert (await r.xinfo_groups(pq.stream))[0]["lag"] is None
            assert await pq.backlog() == 3 == (await queue_stats(r, RUN)).prompts_backlog

    asyncio.run(body())
