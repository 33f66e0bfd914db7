"""A private ``redis-server`` process on a free loopback port: what tests, benchmarks and examples run against;
and the two highly available shapes built from such processes: :class:`LocalSentinelGroup` (a master, replicas,
sentinels) and :class:`LocalCluster` (a Redis Cluster of masters, made with ``redis-cli --cluster create``).

AOF is on (``appendfsync everysec``) as compose and the Helm chart run Redis, so a server restarted on the same
directory and port comes back with its data. ``rlhf up`` has its own variant with a log file (services.launcher).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_answers(port: int, timeout: float = 0.2) -> bool:
    """True when a Redis server on 127.0.0.1:port answers PING (a server still loading its AOF answers LOADING)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedis:
    """``LocalRedis(dir).start()`` ... ``.stop()``, or ``with LocalRedis(dir) as r:``. ``stop(kill=True)`` is kill -9;
    ``start()`` again on the same object reuses the directory and port."""

    def __init__(
        self, directory: str | Path, port: int | None = None, aof: bool = True, extra_args: list[str] | None = None
    ):
        self.directory = Path(directory)
        self.port = port or free_port()
        self.aof = aof
        self.extra_args = list(extra_args or [])  # e.g. ["--replicaof", "127.0.0.1", "6379"]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> LocalRedis:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH (apt-get install -y redis-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes" if self.aof else "no", "--appendfsync", "everysec", "--save", "",
             "--daemonize", "no", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if redis_answers(self.port):
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.stop(kill=True)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _cli(port: int, *args: str, timeout: float = 5.0) -> str:
    exe = shutil.which("redis-cli")
    if exe is None:
        raise RuntimeError("redis-cli is not on PATH (apt-get install -y redis-tools)")
    out = subprocess.run([exe, "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True, text=True,
                         timeout=timeout)  # fmt: skip
    return out.stdout


class LocalSentinelGroup:
    """A master, ``replicas`` replicas and ``sentinels`` sentinels (quorum: a majority) watching them as
    ``service``, every process on its own loopback port and directory. ``url`` is the ``redis+sentinel://`` URL of
    the group (``wait_replicas`` and other query keys appended from ``query``). Sentinels declare a master down
    after ``down_after_ms`` without an answer, then promote a replica.

    ``servers`` keeps the data processes in start order (index 0 starts as master); :meth:`master_port` asks a
    sentinel which one is master now."""

    def __init__(
        self,
        directory: str | Path,
        *,
        replicas: int = 1,
        sentinels: int = 3,
        service: str = "rlhf",
        down_after_ms: int = 1000,
        query: str = "",
    ):
        self.directory = Path(directory)
        self.service = service
        self.down_after_ms = down_after_ms
        self.query = query
        fast_sync = ["--repl-diskless-sync-delay", "0"]  # a replica syncs at once, not after Redis's 5 s default
        master = LocalRedis(self.directory / "redis-0", extra_args=fast_sync)
        self.servers = [master] + [
            LocalRedis(
                self.directory / f"redis-{i + 1}", extra_args=[*fast_sync, "--replicaof", "127.0.0.1", str(master.port)]
            )  # fmt: skip
            for i in range(replicas)
        ]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinel_procs: list[subprocess.Popen | None] = [None] * sentinels

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}/0" + (f"?{self.query}" if self.query else "")

    def _sentinel_conf(self, i: int) -> Path:
        d = self.directory / f"sentinel-{i}"
        d.mkdir(parents=True, exist_ok=True)
        conf = d / "sentinel.conf"
        if not conf.exists():  # sentinels rewrite their config (the current master, the peers): keep it on restart
            quorum = len(self.sentinel_ports) // 2 + 1
            conf.write_text(
                f"port {self.sentinel_ports[i]}\nbind 127.0.0.1\ndir {d}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {self.servers[0].port} {quorum}\n"
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service} {max(3 * self.down_after_ms, 3000)}\n"
                f"sentinel parallel-syncs {self.service} 1\n"
            )
        return conf

    def start(self, timeout: float = 30.0) -> LocalSentinelGroup:
        for s in self.servers:
            s.start()
        exe = shutil.which("redis-server")
        for i in range(len(self.sentinel_ports)):
            self.sentinel_procs[i] = subprocess.Popen([exe, str(self._sentinel_conf(i)), "--sentinel"],
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        # Ready when the replicas are in sync and every sentinel knows them and its peers: only then can a failover be
        # agreed on.
        deadline = time.monotonic() + timeout
        want_peers, want_replicas = len(self.sentinel_ports) - 1, len(self.servers) - 1
        while time.monotonic() < deadline:
            ok = _cli(self.servers[0].port, "INFO", "replication").count("state=online") >= want_replicas
            for port in self.sentinel_ports:
                peers = _cli(port, "SENTINEL", "SENTINELS", self.service).count("runid")
                replicas = _cli(port, "SENTINEL", "REPLICAS", self.service).count("master-link-status")
                ok = ok and peers >= want_peers and replicas >= want_replicas
            if ok:
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the sentinels did not discover the replicas and each other in time")

    def master_port(self) -> int | None:
        """The port of the current master, as the first sentinel that answers says."""
        for port in self.sentinel_ports:
            lines = _cli(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service).split()
            if len(lines) == 2 and lines[1].isdigit():
                return int(lines[1])
        return None

    def server(self, port: int) -> LocalRedis:
        return next(s for s in self.servers if s.port == port)

    def restart_as_replica(self, server: LocalRedis, timeout: float = 30.0) -> None:
        """Start a stopped server again as a replica of the current master, as a Sentinel-managed pod does when it
        comes back (its start script asks the sentinels for the master), and wait until it is in sync."""
        master = self.master_port()
        if master is None:
            raise RuntimeError("no sentinel names a master")
        args, skip = [], 0
        for a in server.extra_args:  # drop an earlier --replicaof host port
            if skip:
                skip -= 1
            elif a == "--replicaof":
                skip = 2
            else:
                args.append(a)
        server.extra_args = [*args, "--replicaof", "127.0.0.1", str(master)]
        server.start()
        deadline = time.monotonic() + timeout
        while "master_link_status:up" not in _cli(server.port, "INFO", "replication"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis on port {server.port} did not sync with the master on port {master}")
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.sentinel_procs:
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(timeout=10)
        for s in self.servers:
            s.stop()

    def __enter__(self) -> LocalSentinelGroup:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000, Redis's rule) is valid and free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class LocalCluster:
    """A Redis Cluster of ``masters`` masters (no replicas) on loopback, created with ``redis-cli --cluster
    create``; ``url`` is its ``redis+cluster://`` URL."""

    def __init__(self, directory: str | Path, masters: int = 3):
        self.directory = Path(directory)
        self.nodes = [
            LocalRedis(
                self.directory / f"node-{i}",
                _cluster_port(),
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ],
            )  # fmt: skip
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        for n in self.nodes:
            n.start()
        out = subprocess.run(
            [shutil.which("redis-cli") or "redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in _cli(n.port, "CLUSTER", "INFO") for n in self.nodes):
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
