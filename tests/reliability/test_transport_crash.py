"""Crash tests of the transport: redis-server killed (-9) and restarted on its directory, a rollout replica
process killed while holding jobs, a trainer killed between checkpoints, all in one ring.

Durability note. The test server runs with AOF ``appendfsync everysec`` (as compose and Helm do). A SIGKILL of
redis-server loses nothing Redis had already written to the AOF file (the kernel keeps it), but Redis 7.0 may
postpone that write while a background fsync is slow, and a power loss or kernel crash loses up to the last second.
Tests that kill the server right after writing therefore either switch to ``appendfsync always`` (CONFIG SET) or
sleep more than one second first (redis 7.0 has no WAITAOF; 7.2 would let a writer wait for the fsync).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlhf.transport import (
    Admission,
    ExperienceQueue,
    PromptQueue,
    connect,
    drop_trained,
    queue_stats,
)
from rlhf.transport.keys import PAYLOAD_FIELD
from rlhf.v1 import common_pb2, experience_pb2
from tests.support import make_experience, make_prompt_job, make_sample

REPO = Path(__file__).resolve().parents[2]
RUN = "crash"
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)

pytestmark = pytest.mark.slow


def make_job(i: int) -> experience_pb2.PromptJob:
    return make_prompt_job(f"job-{i}", [1, 2, i], run_id=RUN, data_index=i)


def make_exp(job: experience_pb2.PromptJob, replica: str) -> experience_pb2.Experience:
    s = make_sample([5, 6, 7], sampling_logprobs=[-0.1, -0.2, -0.3], score_status=common_pb2.ITEM_STATUS_UNSPECIFIED)
    return make_experience(job.job_id, run_id=RUN, samples=[s], replica_id=replica)


def restart(server, kill: bool = True) -> None:
    server.stop(kill=kill)
    server.start()


def test_queue_state_survives_redis_kill(redis_server):
    async def before() -> dict:
        r = connect(redis_server.url)
        await r.config_set("appendfsync", "always")  # every write is on disk before the reply
        pq, eq, adm = PromptQueue(r, RUN), ExperienceQueue(r, RUN), Admission(r, RUN, 1, 4)
        res = await pq.publish_many([make_job(i) for i in range(6)], admission=adm)
        assert sum(x.published for x in res) == 6
        held = await pq.read("replica-a", count=4, block_ms=100)
        for entry_id, job in held[:2]:
            await eq.publish_and_ack(make_exp(job, "replica-a"), entry_id)
        poisoned = make_exp(make_job(5), "replica-b")  # an issued job's record that is dead-lettered: releases
        poisoned.samples[0].sampling_logprobs[0] = float("nan")
        await r.xadd(eq.stream, {PAYLOAD_FIELD: poisoned.SerializeToString()})
        assert len(await eq.read("trainer", count=10, block_ms=100)) == 2  # read, not acked
        await adm.mark_trained(2)
        await adm.publish_policy_version(7)
        stats = (await queue_stats(r, RUN)).as_dict()
        await r.aclose()
        return {"stats": stats, "held": [e for e, _ in held[2:]]}

    seen = asyncio.run(before())
    restart(redis_server, kill=True)

    async def after() -> None:
        r = connect(redis_server.url)
        pq, eq, adm = PromptQueue(r, RUN), ExperienceQueue(r, RUN), Admission(r, RUN, 1, 4)
        assert (await queue_stats(r, RUN)).as_dict() == seen["stats"]
        st = seen["stats"]
        assert (st["prompts_pending"], st["prompts_backlog"], st["experience_pending"], st["dead_letters"]) == (
            2,
            2,
            2,
            1,
        )
        assert (st["issued"], st["trained"], st["released"], st["policy_version"]) == (6, 2, 1, 7)
        # the replica and the trainer pick up where they were (scripts are reloaded transparently)
        again = await pq.read("replica-a", count=10, block_ms=100)
        assert [e for e, _ in again] == seen["held"]
        assert (await pq.publish(make_job(0))).status == "duplicate"
        for entry_id, job in again:
            assert await eq.publish_and_ack(make_exp(job, "replica-a"), entry_id) is not None
        exps = await eq.read("trainer", count=10, block_ms=100)
        assert [e.job_id for _, e in exps] == ["job-0", "job-1"]  # its unacked records, redelivered
        assert await adm.free() == 8 - (6 - 2 - 1)
        await r.aclose()

    asyncio.run(after())


def test_everysec_aof_keeps_writes_older_than_a_second(redis_server):
    async def write() -> None:
        r = connect(redis_server.url)
        pq = PromptQueue(r, RUN)
        await pq.publish_many([make_job(i) for i in range(50)])
        await r.aclose()

    asyncio.run(write())
    time.sleep(1.2)  # > appendfsync everysec
    restart(redis_server, kill=True)

    async def check() -> None:
        r = connect(redis_server.url)
        assert await PromptQueue(r, RUN).length() == 50
        await r.aclose()

    asyncio.run(check())


REPLICA_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, time
    from rlhf.transport import PromptQueue, connect

    async def main():
        q = PromptQueue(connect(sys.argv[1]), sys.argv[2])
        got = []
        while len(got) < 3:
            got += await q.read("doomed-replica", count=3 - len(got), block_ms=1000)
        print("holding", ",".join(e for e, _ in got), flush=True)
        await asyncio.sleep(3600)  # generating... until SIGKILL

    asyncio.run(main())
    """
)


def test_killed_replica_process_jobs_are_taken_over(redis_server):
    async def publish() -> None:
        r = connect(redis_server.url)
        await PromptQueue(r, RUN).publish_many([make_job(i) for i in range(5)])
        await r.aclose()

    asyncio.run(publish())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", REPLICA_SCRIPT, redis_server.url, RUN], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("holding"), line
        held = line.split()[1].split(",")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()

    async def survivor() -> None:
        r = connect(redis_server.url)
        pq, eq = PromptQueue(r, RUN), ExperienceQueue(r, RUN)
        done = set()
        for entry_id, job in await pq.read("survivor", count=10, block_ms=100):  # the two nobody took
            await eq.publish_and_ack(make_exp(job, "survivor"), entry_id)
            done.add(job.job_id)
        deadline = time.monotonic() + 5
        taken: list = []
        while len(taken) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            taken += await pq.reclaim("survivor", min_idle_ms=300, count=10)
        assert sorted(e for e, _ in taken) == sorted(held)
        for entry_id, job in taken:
            assert await eq.publish_and_ack(make_exp(job, "survivor"), entry_id) is not None
            done.add(job.job_id)
        assert done == {f"job-{i}" for i in range(5)}
        assert await pq.pending() == 0 and await eq.length() == 5
        await r.aclose()

    asyncio.run(survivor())


# ------------------------------------------------------------------------------------------------- the ring


class Checkpoint:
    """What a trainer checkpoint holds of the queue state: trained job ids, the admission counter, data position."""

    def __init__(self) -> None:
        self.trained_ids: set[str] = set()
        self.trained_count = 0
        self.next_index = 0
        self.lineage: list[str] = []  # job ids trained, in order, as far as the checkpoints cover


async def _retrying(fn, *args, **kwargs):
    while True:
        try:
            return await fn(*args, **kwargs)
        except TRANSIENT:
            await asyncio.sleep(0.05)


async def replica(url: str, name: str, stop: asyncio.Event, watch: dict, die_after: int | None = None) -> None:
    r = connect(url)
    pq, eq = PromptQueue(r, RUN), ExperienceQueue(r, RUN)
    rng = random.Random(name)
    held = 0
    try:
        while not stop.is_set():
            try:
                jobs = await pq.reclaim(name, min_idle_ms=300, count=2)
                watch["reclaimed"] += len(jobs)
                jobs += await pq.read(name, count=2, block_ms=100)
                for entry_id, job in jobs:
                    held += 1
                    if die_after is not None and held > die_after:
                        return  # crash while holding jobs: never acknowledged
                    await asyncio.sleep(rng.uniform(0, 0.01))  # "generate"
                    await _retrying(eq.publish_and_ack, make_exp(job, name), entry_id)
            except TRANSIENT:
                await asyncio.sleep(0.05)
    finally:
        await r.aclose()


async def trainer(url: str, name: str, ckpt: Checkpoint, n_jobs: int, batch: int, adm_kw: dict, watch: dict) -> None:
    """Publishes under admission, trains, checkpoints every ``batch`` trained jobs, acks after checkpoints."""
    r = connect(url)
    pq, eq = PromptQueue(r, RUN), ExperienceQueue(r, RUN)
    adm = Admission(r, RUN, **adm_kw)
    jobs = [make_job(i) for i in range(n_jobs)]
    # resume from the checkpoint: counters back to it, take over the old incarnation's unacked records
    await _retrying(adm.restore, ckpt.trained_count)
    watch["recovered"] += await _retrying(eq.recover, name)
    trained_ids = set(ckpt.trained_ids)
    trained_count = ckpt.trained_count
    next_index = ckpt.next_index
    since_ckpt: list[str] = []
    unacked: list[str] = []
    try:
        while len(trained_ids) < n_jobs:
            try:
                state = await adm.state()
                watch["max_in_flight"] = max(watch["max_in_flight"], state.in_flight)
                if next_index < n_jobs and state.free:
                    res = await pq.publish_many(jobs[next_index : next_index + state.free], admission=adm)
                    next_index += sum(x.status != "full" for x in res)
                    # only this trainer issues or trains, so nothing can have freed slots since ``state``
                    watch["over_admitted"] += max(0, sum(x.published for x in res) - state.free)
                records = await eq.read(name, count=batch, block_ms=50)
                d = drop_trained(records, trained_ids)
                watch["duplicates"] += d.duplicates
                for _, exp in d.fresh:  # "train"
                    trained_ids.add(exp.job_id)
                    since_ckpt.append(exp.job_id)
                trained_count += len(d.fresh)
                await _retrying(adm.set_trained, trained_count)
                unacked += [e for e, _ in records]
                if len(since_ckpt) >= batch or len(trained_ids) == n_jobs:
                    # checkpoint (atomic, durable), then ack what it covers, then trim
                    ckpt.trained_ids = set(trained_ids)
                    ckpt.trained_count = trained_count
                    ckpt.next_index = next_index
                    ckpt.lineage += since_ckpt
                    since_ckpt = []
                    await _retrying(eq.ack, unacked)
                    unacked = []
                    await pq.trim()
                    await eq.trim()
            except TRANSIENT:
                await asyncio.sleep(0.05)
    finally:
        await r.aclose()


def test_ring_survives_replica_trainer_and_redis_crashes(redis_server):
    n_jobs, batch = 48, 4
    adm_kw = {"max_staleness": 1, "batch_size": batch}

    async def body() -> None:
        r = connect(redis_server.url)
        await r.config_set("appendfsync", "always")
        url = redis_server.url
        stop = asyncio.Event()
        ckpt = Checkpoint()
        watch = {"max_in_flight": 0, "duplicates": 0, "over_admitted": 0, "recovered": 0, "reclaimed": 0}
        replicas = [
            asyncio.create_task(replica(url, "replica-0", stop, watch)),
            asyncio.create_task(replica(url, "replica-1", stop, watch)),
            asyncio.create_task(replica(url, "replica-doomed", stop, watch, die_after=2)),
        ]
        t1 = asyncio.create_task(trainer(url, "trainer-a", ckpt, n_jobs, batch, adm_kw, watch))

        async def progress(at_least: int) -> None:
            while len(ckpt.lineage) < at_least:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(progress(n_jobs // 3), 20)
        # redis-server dies and comes back on its directory
        await asyncio.to_thread(restart, redis_server, True)
        await r.aclose()
        r = connect(url)
        await r.config_set("appendfsync", "always")
        await asyncio.wait_for(progress(2 * n_jobs // 3), 20)
        # the trainer dies between checkpoints; a new one resumes from the last checkpoint under a new name
        t1.cancel()
        await asyncio.gather(t1, return_exceptions=True)
        await asyncio.wait_for(trainer(url, "trainer-b", ckpt, n_jobs, batch, adm_kw, watch), 30)
        stop.set()
        await asyncio.gather(*replicas)

        assert watch["reclaimed"] >= 1  # the doomed replica's jobs were taken over
        # every job trained exactly once along the checkpoint lineage
        assert sorted(ckpt.lineage) == sorted(f"job-{i}" for i in range(n_jobs))
        # staleness stayed bounded: no job was issued past the capacity. In flight may exceed it by the jobs trained
        # after the last checkpoint when the trainer restarts (restore() rewinds 'trained'; they are redelivered).
        assert watch["over_admitted"] == 0
        assert watch["max_in_flight"] <= (adm_kw["max_staleness"] + 1) * batch + batch - 1
        st = await queue_stats(r, RUN)
        assert (st.issued, st.trained, st.released, st.in_flight) == (n_jobs, n_jobs, 0, 0)
        assert st.prompts_pending == st.prompts_backlog == st.experience_pending == st.experience_backlog == 0
        assert st.dead_letters == 0
        assert st.prompts_length == 0 and st.experience_length <= 2 * batch  # trimmed behind the acks
        await r.aclose()

    asyncio.run(body())
