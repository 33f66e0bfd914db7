"""RLHF_REDIS_URL's three shapes (rlhf.transport.connection): parsed into what redis-py's clients need, and bad
URLs refused with a message that names the setting and never the password. Under a second."""

from __future__ import annotations

import socket

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from rlhf import preflight
from rlhf.config import parse_config
from rlhf.procs import free_port
from rlhf.transport.connection import (
    WaitPolicy,
    addresses,
    connect,
    describe,
    parse_redis_url,
    redact,
    wait_policy,
)
from rlhf.transport.keys import RunKeys


def test_single_redis_url_passes_through_without_our_query_keys():
    t = parse_redis_url("rediss://:s3cret@redis.example:6380/2?wait_replicas=1&wait_timeout_ms=250&ssl_cert_reqs=none")
    assert t.kind == "single" and t.wait == WaitPolicy(1, 250)
    assert t.url == "rediss://:s3cret@redis.example:6380/2?ssl_cert_reqs=none"
    assert parse_redis_url("redis://127.0.0.1:6379/0").wait == WaitPolicy(0, 1000)


def test_sentinel_url():
    t = parse_redis_url("redis+sentinel://:pw@s1:26379,s2,[::1]:26380/mymaster/3?wait_replicas=2")
    assert t.kind == "sentinel" and t.service_name == "mymaster" and t.db == 3
    assert t.hosts == (("s1", 26379), ("s2", 26379), ("::1", 26380))
    assert t.password == "pw" and t.sentinel_password == "pw" and not t.tls and t.wait.replicas == 2
    own = parse_redis_url("rediss+sentinel://u:pw@s1/m?sentinel_password=other")
    assert own.tls and own.username == "u" and own.sentinel_password == "other" and own.db == 0
    assert parse_redis_url("redis+sentinel://:pw@s1/m?sentinel_password=").sentinel_password is None
    assert "pw" not in repr(t)


def test_cluster_url():
    t = parse_redis_url("rediss+cluster://:pw@n1:7000,n2:7001")
    assert t.kind == "cluster" and t.tls and t.hosts == (("n1", 7000), ("n2", 7001)) and t.password == "pw"
    assert describe("redis+cluster://:pw@n1:7000") == "cluster n1:7000"
    assert redact("redis+sentinel://u:pw@s1/m?sentinel_password=x&wait_replicas=1") == (
        "redis+sentinel://u:***@s1/m?sentinel_password=***&wait_replicas=1"
    )
    assert redact("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0"
    assert addresses("redis+sentinel://a:1,b:2/m") == [("a", 1), ("b", 2)]
    assert addresses("redis://:pw@h:7/0") == [("h", 7)]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:1", "scheme http:// is not one of"),
        ("redis+sentinel://:hunter2@s1:26379", "needs the service name"),
        ("redis+sentinel://s1:26379/m/x", "database 'x' is not a number"),
        ("redis+sentinel://s1:x/m", "is not host:port"),
        ("redis+cluster://:hunter2@n1:7000/3", "database 0 only"),
        ("redis+cluster://n1:7000?wait_replicas=1", "not available on a Redis Cluster"),
        ("redis+cluster://n1:7000?sentinel_password=x", "for redis+sentinel:// URLs only"),
        ("redis+sentinel://s1/m?wait=1", "unknown query key(s) ['wait']"),
        ("redis://h/0?wait_replicas=one", "wait_replicas='one' is not an integer"),
        ("redis://h/0?wait_replicas=-1", "wait_replicas must be >= 0"),
        ("redis://h/0?wait_timeout_ms=0", "WAIT 0 blocks forever"),
    ],
)
def test_bad_urls_are_refused_with_the_reason(url, message):
    with pytest.raises(ValueError, match="RLHF_REDIS_URL|wait_") as err:
        parse_redis_url(url)
    assert message in str(err.value) and "hunter2" not in str(err.value)


def test_connect_builds_the_client_of_each_shape_without_connecting():
    single = connect("redis://127.0.0.1:1/0?wait_replicas=1")
    assert isinstance(single, Redis) and wait_policy(single) == WaitPolicy(1, 1000)
    sentinel = connect("redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/svc/0")
    pool = sentinel.connection_pool
    assert isinstance(sentinel, Redis) and pool.service_name == "svc" and pool.connection_kwargs["password"] == "pw"
    assert pool.connection_kwargs["socket_timeout"] is None  # blocking reads are not cut short
    assert [s.connection_pool.connection_kwargs["password"] for s in pool.sentinel_manager.sentinels] == ["pw", "pw"]
    cluster = connect("redis+cluster://127.0.0.1:1")
    assert isinstance(cluster, RedisCluster) and wait_policy(cluster) == WaitPolicy()
    with pytest.raises(ValueError, match="decode_responses"):
        connect("redis://h/0", decode_responses=True)


def test_run_keys_share_one_hash_tag():
    keys = RunKeys("demo-1.a_b")
    assert keys.prompts == "rlhf:{demo-1.a_b}:prompts"
    assert all(k.startswith("rlhf:{demo-1.a_b}:") for k in keys.all()) and keys.hash_tag == "{demo-1.a_b}"
    with pytest.raises(ValueError, match="not usable in Redis key names"):
        RunKeys("a}b")


def test_preflight_reaches_any_address_of_each_shape_and_never_prints_the_password(tmp_path):
    cfg = parse_config(
        {
            "actor_rollout_ref": {"actor_rollout": {"load": str(tmp_path / "nope")}},
            "reward": {"scorers": [{"type": "rule", "name": "char_fraction"}]},
        }
    )

    def redis_problems(url: str) -> list[str]:
        return [p for p in preflight.check(cfg, url).problems if "RLHF_REDIS_URL" in p]

    down = free_port()
    (p,) = redis_problems(f"redis+sentinel://:hunter2@127.0.0.1:{down}/mymaster")
    assert f"RLHF_REDIS_URL redis+sentinel://:***@127.0.0.1:{down}/mymaster: cannot connect" in p and "hunter2" not in p
    with socket.socket() as listener:  # one of the cluster's seed nodes answers: enough
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        up = listener.getsockname()[1]
        assert redis_problems(f"redis+cluster://:hunter2@127.0.0.1:{down},127.0.0.1:{up}") == []
    (p,) = redis_problems("redis+cluster://:hunter2@127.0.0.1:1?wait_replicas=1")
    assert "not available on a Redis Cluster" in p and "hunter2" not in p
