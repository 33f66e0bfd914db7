"""The one place a Redis client is built (:func:`connect`), for the three shapes ``RLHF_REDIS_URL`` names: a single
Redis (``redis://``), a Sentinel group (``redis+sentinel://``) or a Redis Cluster (``redis+cluster://``), with
``rediss`` variants for TLS. Failover is redis-py's own; the query may carry ``wait_replicas`` and
``wait_timeout_ms`` (:class:`WaitPolicy`, refused on a Cluster: :func:`parse_redis_url`).

Design (the URL shapes, failover semantics, WAIT): docs/redis-ha.md.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import TimeoutError as RedisTimeoutError

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SENTINEL_PORT = 26379
_OURS = ("wait_replicas", "wait_timeout_ms", "sentinel_password")  # query keys read here, not passed to redis-py


@dataclass(frozen=True)
class WaitPolicy:
    """``WAIT replicas timeout_ms`` after each write the guarantees depend on. ``replicas == 0``: no WAIT."""

    replicas: int = 0
    timeout_ms: int = 1000

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"wait_replicas must be >= 0, got {self.replicas}")
        if self.timeout_ms <= 0:
            raise ValueError(f"wait_timeout_ms must be > 0 (WAIT 0 blocks forever), got {self.timeout_ms}")


NO_WAIT = WaitPolicy()


class ReplicationLag(RedisTimeoutError):
    """Fewer replicas than ``wait_replicas`` acknowledged a write within ``wait_timeout_ms``. The write stands on the
    master; callers treat it as a transient error and retry (every write the ring waits for is idempotent)."""


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``RLHF_REDIS_URL``."""

    kind: str  # "single" | "sentinel" | "cluster"
    url: str = field(repr=False)  # single: the URL for redis-py, without this module's query keys (holds the password)
    hosts: tuple[tuple[str, int], ...] = ()  # sentinel / cluster: the addresses
    service_name: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)
    tls: bool = False
    wait: WaitPolicy = NO_WAIT


def _err(msg: str) -> ValueError:
    return ValueError(f"RLHF_REDIS_URL: {msg}")


def _int(query: dict[str, str], key: str, default: int) -> int:
    raw = query.get(key)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise _err(f"{key}={raw!r} is not an integer") from None


def _hosts(netloc: str, default_port: int) -> tuple[tuple[str, int], ...]:
    hostpart = netloc.rpartition("@")[2]
    out = []
    for item in filter(None, (h.strip() for h in hostpart.split(","))):
        if item.startswith("["):  # [ipv6]:port
            host, _, rest = item[1:].partition("]")
            port = rest.lstrip(":") or str(default_port)
        else:
            host, _, port = item.partition(":")
            port = port or str(default_port)
        if not host or not port.isdigit():
            raise _err(f"address {item!r} is not host:port")
        out.append((host, int(port)))
    if not out:
        raise _err("no host:port given")
    return tuple(out)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse one of the three shapes (module docstring). ``ValueError`` (naming RLHF_REDIS_URL, never the password)
    for anything else."""
    scheme, netloc, path, query_s, frag = urlsplit(url)
    scheme = scheme.lower()
    query = dict(parse_qsl(query_s, keep_blank_values=True))
    wait = WaitPolicy(_int(query, "wait_replicas", 0), _int(query, "wait_timeout_ms", 1000))
    userinfo = netloc.rpartition("@")[0] if "@" in netloc else ""
    user, _, pw = userinfo.partition(":")
    username, password = unquote(user) or None, unquote(pw) or None
    if scheme in ("redis", "rediss", "unix"):
        if "sentinel_password" in query:
            raise _err("sentinel_password is for redis+sentinel:// URLs only")
        rest = urlencode([(k, v) for k, v in parse_qsl(query_s, keep_blank_values=True) if k not in _OURS])
        return RedisTarget("single", urlunsplit((scheme, netloc, path, rest, frag)), wait=wait)
    kind = {"redis+sentinel": "sentinel", "rediss+sentinel": "sentinel"}.get(scheme) or {
        "redis+cluster": "cluster",
        "rediss+cluster": "cluster",
    }.get(scheme)
    if kind is None:
        raise _err(
            f"scheme {scheme + '://' if scheme else '(none)'} is not one of redis://, rediss://, redis+sentinel://, "
            "rediss+sentinel://, redis+cluster://, rediss+cluster://"
        )
    unknown = sorted(set(query) - set(_OURS))
    if unknown:
        raise _err(f"unknown query key(s) {unknown} for {scheme}:// (known: {list(_OURS)})")
    tls = scheme.startswith("rediss")
    if kind == "cluster":
        if path.strip("/") not in ("", "0"):
            raise _err("a Redis Cluster has database 0 only: drop the /db part")
        if "sentinel_password" in query:
            raise _err("sentinel_password is for redis+sentinel:// URLs only")
        if wait.replicas:
            raise _err(
                "wait_replicas is not available on a Redis Cluster: WAIT counts the writes of the connection it is "
                "sent on, and redis-py's cluster client cannot send it on the connection that made the write; use "
                "a Sentinel group for acknowledged replication"
            )
        return RedisTarget(
            "cluster", url, _hosts(netloc, 6379), username=username, password=password, tls=tls, wait=wait
        )
    parts = [unquote(p) for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise _err("a Sentinel URL needs the service name as its path: redis+sentinel://host:26379/mymaster[/db]")
    service, db = parts[0], 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise _err(f"database {parts[1]!r} is not a number")
        db = int(parts[1])
    sentinel_password = query.get("sentinel_password", password)
    return RedisTarget(
        "sentinel",
        url,
        _hosts(netloc, DEFAULT_SENTINEL_PORT),
        service_name=service,
        db=db,
        username=username,
        password=password,
        sentinel_password=sentinel_password or None,
        tls=tls,
        wait=wait,
    )


# A Redis host that vanishes (node lost, link cut: no FIN, no RST) must fail its connections within seconds, as a
# restart does, so the caller's retry reaches Sentinel's new master: left to Linux, a write to it is retransmitted
# for ~15 minutes (tcp_retries2) and an idle connection is probed after redis-py's 30 s. make cluster-check's
# redis_master_cut hung on exactly that. TCP_USER_TIMEOUT bounds unacknowledged data and unanswered probes alike.
DEAD_PEER_S = 10


def dead_peer_socket_options() -> dict[int, int]:
    """redis-py's ``socket_keepalive_options`` (set at IPPROTO_TCP): keepalive probes after 3 s idle, every 2 s, and
    ``TCP_USER_TIMEOUT`` of :data:`DEAD_PEER_S`; options the platform lacks are left out."""
    wanted = (("TCP_KEEPIDLE", 3), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", DEAD_PEER_S * 1000))
    return {getattr(socket, name): value for name, value in wanted if hasattr(socket, name)}


def connect(url: str | None = None, **kwargs: Any) -> Any:
    """An asyncio Redis client fit for the queues: bytes responses (payloads are protobuf), no read timeout (blocking
    reads), a dead peer detected in seconds (:func:`dead_peer_socket_options`), periodic health checks. ``url``
    defaults to ``$RLHF_REDIS_URL``, then the local server.

    Returns a :class:`redis.asyncio.Redis` (single, Sentinel: its master) or :class:`redis.asyncio.RedisCluster`,
    with the URL's :class:`WaitPolicy` attached (:func:`wait_policy`).
    """
    url = url or os.environ.get("RLHF_REDIS_URL") or DEFAULT_URL
    if kwargs.get("decode_responses"):
        raise ValueError("the transport needs decode_responses=False: stream payloads are binary protobuf")
    target = parse_redis_url(url)
    opts: dict[str, Any] = {
        "decode_responses": False,
        "socket_timeout": None,
        "socket_connect_timeout": 5.0,
        "socket_keepalive": True,
        "socket_keepalive_options": dead_peer_socket_options(),
        "health_check_interval": 30,
    }
    opts.update(kwargs)
    if target.kind == "single":
        client: Any = aioredis.Redis.from_url(target.url, **opts)
    elif target.kind == "sentinel":
        auth = {"username": target.username, "password": target.password}
        sentinel_kwargs = {
            "password": target.sentinel_password,
            "socket_connect_timeout": opts["socket_connect_timeout"],
            "socket_timeout": 5.0,  # sentinels answer at once; a dead one must not hang master discovery
            "socket_keepalive": True,
            "socket_keepalive_options": opts["socket_keepalive_options"],
            "ssl": target.tls,
        }
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs, ssl=target.tls, db=target.db, **auth)
        client = sentinel.master_for(target.service_name, redis_class=aioredis.Redis, **opts)
    else:
        client = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.hosts],
            username=target.username,
            password=target.password,
            ssl=target.tls,
            **opts,
        )
    client._rlhf_wait = target.wait
    return client


def wait_policy(redis: Any) -> WaitPolicy:
    """The :class:`WaitPolicy` a client was built with (:func:`connect`); none for other clients."""
    return getattr(redis, "_rlhf_wait", NO_WAIT)


def is_cluster(redis: Any) -> bool:
    return isinstance(redis, (RedisCluster, ClusterPipeline))


def describe(url: str) -> str:
    """The URL's shape and addresses, without credentials (for logs and preflight)."""
    t = parse_redis_url(url)
    if t.kind == "single":
        u = urlsplit(t.url)
        return f"redis {u.hostname or '127.0.0.1'}:{u.port or 6379}"
    hosts = ",".join(f"{h}:{p}" for h, p in t.hosts)
    return f"sentinel {hosts} service {t.service_name}" if t.kind == "sentinel" else f"cluster {hosts}"


def redact(url: str) -> str:
    """The URL with its password (if any) shown as ``***``, for messages."""
    scheme, netloc, path, query, frag = urlsplit(url)
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}{sep and ':***'}@{hosts}"
    query = "&".join(
        f"{k}=***" if k == "sentinel_password" else f"{k}={v}" for k, v in parse_qsl(query, keep_blank_values=True)
    )
    return urlunsplit((scheme, netloc, path, query, frag))


def addresses(url: str) -> list[tuple[str, int]]:
    """The TCP addresses a URL names (the server, the sentinels or the cluster's seed nodes); [] for a unix socket."""
    t = parse_redis_url(url)
    if t.kind != "single":
        return list(t.hosts)
    u = urlsplit(t.url)
    return [] if u.scheme == "unix" else [(u.hostname or "127.0.0.1", u.port or 6379)]


async def waited(
    redis: Any, wait: WaitPolicy, fence: str, queue: Callable[[Any], Awaitable[Any]], *, batch: bool = False
) -> list:
    """Run the commands ``queue(client)`` issues (awaiting each, returning their replies: on a pipeline they are
    queued, on a cluster client made at once), then, with ``wait.replicas``, ``INCR fence`` and ``WAIT`` on the same
    connection (WAIT covers the writes of the connection it is sent on); returns the commands' replies. Raises
    :class:`ReplicationLag` when fewer replicas acknowledged within the timeout: what was written stands on the
    master, and every caller's write is idempotent, so the caller retries the whole call. Without a wait policy the
    commands go in one pipeline when ``batch`` (one round trip), else straight to the client.

    On a Redis Cluster (where :func:`connect` refuses a wait policy) the commands run one by one, in order: redis-py's
    cluster pipeline does not load Lua scripts, and all keys of a run live in one slot anyway.
    """
    if is_cluster(redis) or not (wait.replicas or batch):
        return list(await queue(redis))
    async with redis.pipeline(transaction=False) as pipe:
        await queue(pipe)
        if wait.replicas:
            pipe.incr(fence)
            pipe.wait(wait.replicas, wait.timeout_ms)
        out = await pipe.execute()
    if wait.replicas:
        acked = int(out[-1])
        if acked < wait.replicas:
            raise ReplicationLag(
                f"WAIT: {acked} of {wait.replicas} replica(s) acknowledged within {wait.timeout_ms} ms "
                "(wait_replicas in RLHF_REDIS_URL); the write stands on the master and is retried"
            )
        out = out[:-2]
    return out


async def one(call: Awaitable[Any]) -> list:
    return [await call]
