"""rlhf.transport on the highly available shapes, with real redis-server processes on loopback: a 3-master Redis
Cluster (every script and multi-key command of a run in one slot, two runs on different nodes) and a Sentinel group
(master, replica, three sentinels: WAIT on the guarantee-bearing writes, a kill -9 failover that loses none of the
writes it acknowledged). The URL shapes themselves are unit-tested in tests/unit/rlhf/transport/test_redis_url.py.

About 22 s in all on 2 shared cores (cluster creation ~1 s, a Sentinel group ~2.5 s, a failover ~3 s).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from test_transport_streams import make_exp, make_job

from rlhf.local_redis import LocalCluster, LocalSentinelGroup, _cli
from rlhf.transport import (
    Admission,
    ExperienceQueue,
    PromptQueue,
    ReplicationLag,
    WaitPolicy,
    connect,
    delete_run,
    queue_stats,
)
from rlhf.transport.connection import DEAD_PEER_S
from rlhf.transport.keys import PAYLOAD_FIELD, RunKeys


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


async def _every_multikey_path(r, run: str) -> dict:
    """Drive every queue operation that touches several keys of a run (the Lua scripts, the pipelines, MGET, the
    consumer-group reads, XAUTOCLAIM, trimming, DEL of the run) and return the run's stats."""
    pq, eq = PromptQueue(r, run, max_deliveries=1), ExperienceQueue(r, run)
    adm = Admission(r, run, max_staleness=0, batch_size=2)
    res = await pq.publish_many([make_job(i, run) for i in range(3)], adm)  # capacity 2: the third is refused
    assert [x.status for x in res] == ["published", "published", "full"]
    assert (await pq.publish(make_job(0, run))).status == "duplicate"
    for entry_id, job in await pq.read("r1", 4, None):
        assert await eq.publish_and_ack(make_exp(job), entry_id) is not None
    got = await eq.read("trainer", 4, None)
    assert sorted(e.job_id for _, e in got) == ["job-0", "job-1"]
    assert await eq.ack([e for e, _ in got]) == 2
    await adm.set_trained(2)
    assert await adm.publish_policy_version(3) == 3
    await pq.publish_many([make_job(i, run) for i in range(3, 5)], adm)
    await pq.read("r1", 4, None)  # taken and never finished: a dead replica's
    await asyncio.sleep(0.05)
    assert await pq.reclaim("r2", 10, 4) == []  # delivered max_deliveries times: dead-lettered (script), not re-run
    await r.xadd(RunKeys(run).experience, {PAYLOAD_FIELD: b"not a protobuf"})
    assert await eq.read("trainer", 4, None) == []  # malformed: dead-lettered
    assert await eq.recover("trainer-1") == 0
    stats = await queue_stats(r, run)
    assert await pq.trim() == 4 and await eq.trim() == 3
    return stats.as_dict()


def test_a_run_uses_one_slot_and_two_runs_use_two_nodes_of_a_cluster(cluster):
    async def body():
        r = connect(cluster.url)
        try:
            slots = {run: await r.cluster_keyslot(RunKeys(run).prompts) for run in ("a", "b")}
            for run in slots:  # every key of the run hashes to the run's slot: no CROSSSLOT is possible
                assert {await r.cluster_keyslot(k) for k in RunKeys(run).all()} == {slots[run]}
            nodes = {run: r.get_node_from_key(RunKeys(run).prompts).name for run in slots}
            assert nodes["a"] != nodes["b"], (slots, nodes)  # runs "a" and "b" hash to different masters
            both = await asyncio.gather(*(_every_multikey_path(r, run) for run in slots))
            for stats in both:
                assert stats["issued"] == 4 and stats["trained"] == 2 and stats["released"] == 2
                assert stats["dead_letters"] == 3 and stats["in_flight"] == 0 and stats["policy_version"] == 3
            # Each run's keys live on its own node only.
            for run, node in nodes.items():
                port = int(node.rpartition(":")[2])
                assert int(_cli(port, "EXISTS", RunKeys(run).prompts)) == 1
                other = next(n.port for n in cluster.nodes if n.port != port)
                assert "MOVED" in _cli(other, "EXISTS", RunKeys(run).prompts)
            assert await delete_run(r, "a") == len(RunKeys("a").all()) - 1  # every key but the fence (no WAIT)
        finally:
            await r.aclose()

    asyncio.run(body())


@pytest.fixture
def sentinel_group(tmp_path):
    group = LocalSentinelGroup(tmp_path / "sentinel", query="wait_replicas=1&wait_timeout_ms=2000").start()
    yield group
    group.stop()


def test_wait_reaches_the_replica_and_a_missing_replica_is_a_retryable_error(sentinel_group):
    async def body():
        r = connect(sentinel_group.url)
        try:
            pq, eq = PromptQueue(r, "w"), ExperienceQueue(r, "w")
            assert pq.wait == WaitPolicy(1, 2000)
            assert (await pq.publish(make_job(0, "w"))).published
            replica = sentinel_group.servers[1]
            # Acknowledged means on the replica: it answers with the job at once.
            assert int(_cli(replica.port, "XLEN", RunKeys("w").prompts)) == 1
            replica.stop(kill=True)
            with pytest.raises(ReplicationLag, match="0 of 1 replica"):
                await pq.publish(make_job(1, "w"))
            # The write stands on the master (a retry is a no-op), and the trainer's read waits for the replica too.
            assert await r.hexists(RunKeys("w").jobs, "job-1")
            with pytest.raises(ReplicationLag):
                await eq.read("trainer", 4, None)
            sentinel_group.restart_as_replica(replica)
            assert (await pq.publish(make_job(1, "w"))).status == "duplicate"
            assert int(_cli(replica.port, "XLEN", RunKeys("w").prompts)) == 2
        finally:
            await r.aclose()

    asyncio.run(body())


def test_failover_keeps_every_acknowledged_write(sentinel_group):
    """Publish jobs one by one while the master is killed -9: every publish that returned is on the promoted
    replica (WAIT 1), and the client follows the sentinels to it by itself (a retry after the error)."""

    async def body():
        r = connect(sentinel_group.url)
        acked: list[str] = []
        errors = 0
        try:
            pq = PromptQueue(r, "f")
            old = sentinel_group.master_port()
            killed_at, restarted, i = None, False, 0
            while len(acked) < 60:
                if i == 20 and killed_at is None:
                    sentinel_group.server(old).stop(kill=True)
                    killed_at = time.monotonic()
                job = make_job(i, "f")
                try:
                    if (await pq.publish(job)).status in ("published", "duplicate"):
                        acked.append(job.job_id)
                        i += 1
                except (RedisConnectionError, RedisTimeoutError):  # down, no master yet, or no replica to WAIT for
                    errors += 1
                    await asyncio.sleep(0.1)
                    if not restarted and sentinel_group.master_port() not in (None, old):
                        # the old master's pod comes back, as a replica of the promoted one
                        sentinel_group.restart_as_replica(sentinel_group.server(old))
                        restarted = True
            assert restarted and sentinel_group.master_port() != old and errors > 0
            issued = {k.decode() for k in await r.hkeys(RunKeys("f").jobs)}
            assert set(acked) <= issued, sorted(set(acked) - issued)
            assert len(issued) == 60 and int(await r.get(RunKeys("f").issued)) == 60
        finally:
            await r.aclose()

    asyncio.run(body())


def test_a_write_lost_in_a_failover_is_reissued_after_the_idle_timeout_and_wait_refuses_to_count_it(tmp_path):
    """The replica is frozen (SIGSTOP) and its link cut while a rollout replica finishes two jobs: the write made
    without WAIT is acknowledged by the master, the one made with ``wait_replicas=1`` raises ``ReplicationLag``. The
    master is then killed -9 and the replica promoted: neither experience survived, both jobs are still pending, and
    reclaiming them after the idle timeout (the rollout worker's re-issue) yields exactly one record per job."""

    async def body(group: LocalSentinelGroup):
        plain, waiting = connect(group.url), connect(group.url + "?wait_replicas=1&wait_timeout_ms=2000")
        try:
            pq, eq, eq_wait = PromptQueue(plain, "l"), ExperienceQueue(plain, "l"), ExperienceQueue(waiting, "l")
            await pq.publish_many([make_job(0, "l"), make_job(1, "l")])
            jobs = await pq.read("r1", 2, None)
            assert (await PromptQueue(waiting, "l").publish(make_job(9, "l"))).published  # WAIT: all of it replicated
            replica, old = group.servers[1], group.master_port()
            replica.proc.send_signal(signal.SIGSTOP)
            try:
                # Cut the replication link (the frozen replica cannot come back): what follows stays on the master.
                assert _cli(old, "CLIENT", "KILL", "TYPE", "replica").strip() == "1"
                (e0, j0), (e1, j1) = jobs
                assert await eq.publish_and_ack(make_exp(j0), e0) is not None  # acknowledged by the master alone
                with pytest.raises(ReplicationLag):
                    await eq_wait.publish_and_ack(make_exp(j1), e1)  # not counted: no replica has it
                group.server(old).stop(kill=True)
            finally:
                replica.proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 30
            while group.master_port() in (None, old):
                assert time.monotonic() < deadline, "no failover"
                await asyncio.sleep(0.1)
            for _ in range(100):  # the client follows the sentinels to the promoted replica
                try:
                    assert await eq.length() == 0  # both experience records were lost with the old master
                    break
                except RedisConnectionError:
                    await asyncio.sleep(0.1)
            assert await pq.pending() == 2  # ... but not their jobs: still pending, so they come back
            reissued = await PromptQueue(plain, "l").reclaim("r2", min_idle_ms=0, count=10)
            assert sorted(j.job_id for _, j in reissued) == ["job-0", "job-1"]
            for entry_id, job in reissued:
                assert await eq.publish_and_ack(make_exp(job), entry_id) is not None
            got = await eq.read("trainer", 10, None)
            assert sorted(e.job_id for _, e in got) == ["job-0", "job-1"]  # one record per job
        finally:
            await plain.aclose()
            await waiting.aclose()

    group = LocalSentinelGroup(tmp_path / "sentinel").start()
    try:
        asyncio.run(body(group))
    finally:
        group.stop()


def test_connections_give_up_on_a_vanished_host_in_seconds_not_minutes(sentinel_group):
    """A host cut off (no FIN, no RST) must fail the client's connections in DEAD_PEER_S, so the retry finds the new
    master (make cluster-check's redis_master_cut): the sockets to the master and to the sentinels carry
    TCP_USER_TIMEOUT and short keepalive probes, read back from the kernel here."""

    async def main():
        client = connect(sentinel_group.url)
        await client.ping()
        conns = [*client.connection_pool._available_connections, *client.connection_pool._in_use_connections]
        sentinel_conns = [
            c
            for s in client.connection_pool.sentinel_manager.sentinels
            for c in s.connection_pool._available_connections
        ]
        socks = [c._writer.get_extra_info("socket") for c in conns + sentinel_conns]
        options = [
            (
                s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
                s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            )
            for s in socks
        ]
        await client.aclose()
        return options, len(conns), len(sentinel_conns)

    options, to_master, to_sentinels = asyncio.run(main())
    assert to_master >= 1 and to_sentinels >= 1
    for user_timeout_ms, keepalive, idle_s in options:
        assert user_timeout_ms == DEAD_PEER_S * 1000 and keepalive == 1 and idle_s <= 5
