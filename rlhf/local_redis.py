"""The two highly available Redis shapes built from private ``redis-server`` processes (:class:`rlhf.procs.LocalRedis`,
what tests, benchmarks and examples run against): :class:`LocalSentinelGroup` (a master, replicas, sentinels) and
:class:`LocalCluster` (a Redis Cluster of masters, made with ``redis-cli --cluster create``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from rlhf.procs import Child, LocalRedis, free_port, free_ports


def _cli(port: int, *args: str, timeout: float = 5.0) -> str:
    exe = shutil.which("redis-cli")
    if exe is None:
        raise RuntimeError("redis-cli is not on PATH (apt-get install -y redis-tools)")
    out = subprocess.run(
        [exe, "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True, text=True, timeout=timeout
    )
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
        # One draw for every port: ports drawn one at a time can repeat, and a sentinel on a data server's port dies.
        ports = free_ports(1 + replicas + sentinels)
        master = LocalRedis(self.directory / "redis-0", ports[0], extra_args=fast_sync)
        self.servers = [master] + [
            LocalRedis(
                self.directory / f"redis-{i + 1}",
                ports[1 + i],
                extra_args=[*fast_sync, "--replicaof", "127.0.0.1", str(master.port)],
            )
            for i in range(replicas)
        ]
        self.sentinel_ports = ports[1 + replicas :]
        self.sentinel_procs: list[Child | None] = [None] * sentinels

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

    def _start_sentinel(self, i: int) -> None:
        exe = shutil.which("redis-server")
        log = self.directory / f"sentinel-{i}" / "sentinel.log"
        self.sentinel_procs[i] = Child(f"sentinel-{i}", [exe, str(self._sentinel_conf(i)), "--sentinel"], log).start()

    def start(self, timeout: float = 60.0) -> LocalSentinelGroup:
        for s in self.servers:
            s.start()
        for i in range(len(self.sentinel_ports)):
            self._start_sentinel(i)
        # Ready when the replicas are in sync and every sentinel knows them and its peers: only then can a failover be
        # agreed on. Sentinels learn replicas from the master's INFO (every 10 s) and peers from hello messages (2 s).
        deadline = time.monotonic() + timeout
        want_peers, want_replicas = len(self.sentinel_ports) - 1, len(self.servers) - 1
        seen: dict[str, object] = {}
        while time.monotonic() < deadline:
            for i, proc in enumerate(self.sentinel_procs):
                if proc is not None and not proc.running:  # lost its port to another process between draw and bind
                    self.sentinel_ports[i] = free_port()
                    (self.directory / f"sentinel-{i}" / "sentinel.conf").unlink(missing_ok=True)
                    self._start_sentinel(i)
            online = _cli(self.servers[0].port, "INFO", "replication").count("state=online")
            seen = {"replicas online at the master": f"{online}/{want_replicas}"}
            ok = online >= want_replicas
            for port in self.sentinel_ports:
                peers = _cli(port, "SENTINEL", "SENTINELS", self.service).count("runid")
                replicas = _cli(port, "SENTINEL", "REPLICAS", self.service).count("master-link-status")
                seen[f"sentinel :{port} peers, replicas"] = f"{peers}/{want_peers}, {replicas}/{want_replicas}"
                ok = ok and peers >= want_peers and replicas >= want_replicas
            if ok:
                return self
            time.sleep(0.2)
        logs = "\n".join(p.log_tail(15) for p in self.sentinel_procs if p is not None)
        self.stop()
        raise RuntimeError(
            f"the sentinels did not discover the replicas and each other in {timeout:.0f} s: {seen}\n"
            f"sentinel logs:\n{logs}"
        )

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
            if p is not None:
                p.stop(10)
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
            )
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        for n in self.nodes:
            n.start()
        out = subprocess.run(
            [
                shutil.which("redis-cli") or "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
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
