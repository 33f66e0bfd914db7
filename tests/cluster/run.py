"""A cluster on one machine: the ring on nine hosts (network namespaces), under network faults; one JSON line.

::

    make cluster-check                                   # as root: every fault, then the ledger
    python -m tests.cluster.run --faults none            # the ring to its end, no fault
    python -m tests.cluster.run --faults reward_cut,redis_master_cut
    python -m tests.cluster.run --cleanup                # remove what a killed run left (by name prefix)

The hosts (tests/cluster/netns.py), each a namespace on one bridge, subnet 10.213.7.0/24:

redis-a, redis-b, redis-c   redis-server (AOF) + redis-sentinel each; a starts as master, b and c replicate it;
                            quorum 2; RLHF_REDIS_URL names the three sentinels with ``wait_replicas=1``
reward, reference           ``rlhf serve reward`` / ``rlhf serve reference``
rollout-0, rollout-1        ``rlhf serve rollout`` (hf engine), weight data plane on 50052
trainer-0, trainer-1        ``torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=static --master-addr=<trainer-0>
                            -m services.cli serve trainer``, PET_NODE_RANK = the node (the Helm chart's indexed Job):
                            an FSDP2 group of 4 processes over gloo; its checkpoints on one shared folder (the PVC)

Every process gets the environment the Helm chart renders (RLHF_HOST, RLHF_GRPC_PORT, RLHF_REDIS_URL, ...), plus
what the chart leaves to the cluster: RLHF_RUN_DIR (the checkpoint volume), GLOO_SOCKET_IFNAME (a pod's one
interface) and shorter reclaim / RPC timeouts so that a fault's recovery fits a short run. A supervisor restarts a
process that exits with an error, as Kubernetes restarts a pod (the trainer's Job: OnFailure, both nodes).

Faults (each injected once the ring has trained a step since the previous one's recovery):

reward_cut        the reward host's link down for 10 s (--outage-s): samples fail as errors and are retried, never
                  scored 0
rollout_cut       rollout-1's link down right after a step (while its weights are pushed) for 10 s, then back
redis_master_cut  the Redis master's host cut off from everything until the ring trained a step on the new master
                  (45 s at most): the sentinels fail over, the ring must follow the new master while the old host
                  is still cut; the old one comes back as a replica
trainer_kill      kill -9 of trainer node 1 (its torchrun and both processes) mid-run: the group restarts on both
                  nodes from its checkpoint
partition         the Redis master's host and both trainer hosts on one side, the other two Redis hosts (the
                  sentinel majority) with every other host on the other, for 20 s: the trainer's writes on the old
                  master are fenced by WAIT (no replica there), the majority fails over, the ring heals
partition_ring_with_master  the same, but only the two other Redis hosts on the majority side: the whole ring
                  (rollouts, reward, reference, trainer) writes to the old master, every guarded write is fenced

After the last fault and two more steps the trainer is paused, checkpointed and stopped; the ledger (jobs issued /
trained / lost / trained twice) comes from its checkpoint, trained_jobs.jsonl and Redis. Then the weight pushes
across hosts are measured (tcp and gloo collective) with the bytes each link carried (tests/cluster/pushbench.py).
Exit status 0 only when every fault passed, nothing was lost, trained twice or dead-lettered.

--pod-sysctls gives every host short TCP retransmission / keepalive limits (POD_SYSCTLS); CLUSTER_PYTHONPATH, when
set, is every service's PYTHONPATH (to try a patch on every host, e.g. a sitecustomize). Neither is on by default.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import yaml

from rlhf.procs import Child, http_ready, log_tail
from rlhf.tiny import build_tiny
from rlhf.transport import connect, queue_stats
from rlhf.transport.keys import RunKeys
from rlhf.v1 import experience_pb2
from tests.cluster import netns
from tests.cluster.pushbench import measure

REPO = Path(__file__).resolve().parents[2]

TOKEN = "cluster-token"
RUN_ID = "cluster"
SERVICE = "rlhf"  # the sentinels' master name
GRPC, HTTP, DATA, REDIS, SENTINEL, RDZV = 50051, 8000, 50052, 6379, 26379, 29500
REDIS_HOSTS = ["redis-a", "redis-b", "redis-c"]
HOSTS = [*REDIS_HOSTS, "reward", "reference", "rollout-0", "rollout-1", "trainer-0", "trainer-1"]
FAULTS = ["reward_cut", "rollout_cut", "redis_master_cut", "trainer_kill", "partition", "partition_ring_with_master"]
MAX_STALENESS = 1
VENV_BIN = Path(sys.executable).parent
# --pod-sysctls: namespaced sysctls a pod's securityContext could set (the keepalive ones are in Kubernetes' safe set,
# tcp_retries2 must be allowed on the kubelet). tcp_retries2=5: data sent to a peer that vanished without a FIN/RST (a
# cut host) is given up after ~12 s, not ~15 min; the keepalive ones apply to sockets that set none of their own.
POD_SYSCTLS = {
    "net.ipv4.tcp_keepalive_time": "5",
    "net.ipv4.tcp_keepalive_intvl": "2",
    "net.ipv4.tcp_keepalive_probes": "3",
    "net.ipv4.tcp_retries2": "5",
}


def say(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def experiment(batch: int = 8) -> dict:
    """Tiny PPO (GAE + critic), asynchronous by one step: the ring keeps moving while a fault holds a part."""
    return {
        "run_id": RUN_ID,
        "training": {
            "stage": "ray_ppo",
            "global_batch_size": batch,
            "seq_length": 64,
            "train_iters": 1_000_000,  # the harness ends the run (pause, checkpoint, stop) after the faults
            "lr": 1e-3,
            "save_interval": 2,
            "save": "unused-checkpoints",  # RLHF_RUN_DIR wins
            "device": "cpu",
            "max_staleness": MAX_STALENESS,
            "seed": 1234,
        },
        "actor_rollout_ref": {
            "actor_rollout": {
                "load": "tiny:policy",
                "engine": "hf",
                "do_sample": True,
                "temperature": 1.0,
                "max_prompt_length": 48,
                "max_new_tokens": 6,
                "n_samples_per_prompt": 1,
                "ppo_mini_batch_size": batch,
                "ppo_epochs": 1,
            },
            "ref": {"micro_batch_size": 32},
        },
        "critic": {"load": "tiny:reward", "critic_mini_batch_size": batch, "critic_update_epochs": 1},
        "reward": {"scorers": [{"type": "rule", "name": "char_fraction"}]},
        "algorithm": {"adv_estimator": "gae", "kl_ctrl": {"type": "fixed", "kl_coef": 0.01}},
        "data": {"path": "builtin:arithmetic"},
    }


# ------------------------------------------------------------ processes on hosts


class HostProc(Child):
    """A process on one host, restarted by the supervisor when it exits with an error (``restart``)."""

    def __init__(self, name: str, host: netns.Host, argv: list[str], log_dir: Path, env: dict, restart: bool = True):
        super().__init__(name, host.wrap(argv), log_dir / f"{name}.log", env=env, cwd=REPO)
        self.host = host
        self.restart = restart
        self.restarts = 0
        self.lock = threading.Lock()

    def start(self) -> HostProc:
        with self.lock:
            super().start()
        return self

    def kill9(self) -> None:
        """kill -9 of the whole "pod": every process on its host. torchrun starts its workers in sessions of their own,
        so the process group alone would leave them running (Kubernetes kills the pod's cgroup)."""
        netns.kill_namespace_processes(self.host.ns, grace_s=0.0, first=signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)


class Supervisor(threading.Thread):
    """Restarts processes that exit non-zero (Kubernetes' restartPolicy), after a second."""

    def __init__(self, procs: list[HostProc]):
        super().__init__(daemon=True)
        self.procs = procs
        self.stopping = threading.Event()
        self.events: list[tuple[float, str, int]] = []

    def run(self) -> None:
        while not self.stopping.wait(0.5):
            for p in self.procs:
                rc = p.poll()
                if rc is None or rc == 0 or not p.restart or self.stopping.is_set():
                    continue
                self.events.append((time.monotonic(), p.name, rc))
                say(f"{p.name} exited with {rc}: restarting it")
                p.close_log()
                time.sleep(1.0)
                if not self.stopping.is_set():
                    p.restarts += 1
                    p.start()


class Cluster:
    def __init__(
        self,
        directory: Path,
        *,
        transport: str = "auto",
        sysctls: dict[str, str] | None = None,
        outage_s: float = 10.0,
    ):
        self.outage_s = outage_s
        self.dir = directory
        self.logs = directory / "logs"
        self.run_dir = directory / "run"  # the trainer's checkpoint volume, shared by its two nodes
        self.net = netns.Network(HOSTS, sysctls=sysctls)
        self.procs: list[HostProc] = []
        self.sup = Supervisor(self.procs)
        self.transport = transport
        self.config = directory / "config.yaml"  # the chart's ConfigMap, /etc/rlhf/config.yaml
        self.faults: list[dict] = []

    def ip(self, host: str) -> str:
        return self.net.host(host).ip

    @property
    def redis_url(self) -> str:
        sentinels = ",".join(f"{self.ip(h)}:{SENTINEL}" for h in REDIS_HOSTS)
        return f"redis+sentinel://{sentinels}/{SERVICE}/0?wait_replicas=1&wait_timeout_ms=1000"

    # ------------------------------------------------------------ start
    def env(self, component: str, host: str) -> dict:
        """What the chart's rlhf.env renders for ``component``, and the cluster's share."""
        env = {
            "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "RLHF_HOST": "0.0.0.0",
            "RLHF_GRPC_PORT": str(GRPC),
            "RLHF_HTTP_PORT": str(HTTP),
            "RLHF_CONFIG": str(self.config),
            "RLHF_RUN_ID": RUN_ID,
            "RLHF_DEVICE": "cpu",
            "RLHF_LOG_LEVEL": "info",
            "RLHF_CACHE_DIR": str(self.dir / "cache"),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "RLHF_REPLICA_ID": host,
            "RLHF_API_TOKEN": TOKEN,
        }
        if os.environ.get("CLUSTER_PYTHONPATH"):  # to try a patch on every host (a sitecustomize), never by default
            env["PYTHONPATH"] = os.environ["CLUSTER_PYTHONPATH"]
        if component in ("rollout", "trainer"):
            env.update(
                RLHF_REDIS_URL=self.redis_url,
                RLHF_REWARD_ADDR=f"{self.ip('reward')}:{GRPC}",
                RLHF_REFERENCE_ADDR=f"{self.ip('reference')}:{GRPC}",
                GLOO_SOCKET_IFNAME="eth0",  # a pod has one interface; here the host name resolves to the machine
            )
        if component == "rollout":
            env.update(
                RLHF_WEIGHTS_DATA_PORT=str(DATA),
                RLHF_ROLLOUT_ENGINE="hf",
                RLHF_ROLLOUT_RECLAIM_IDLE_S="8",  # a cut replica's jobs are taken over after 8 s (default 60)
                RLHF_ROLLOUT_RPC_TIMEOUT_S="8",  # a reward call into a cut link fails after 8 s (default 60)
            )
        if component == "trainer":
            env.update(
                RLHF_ROLLOUT_ADDRS=",".join(f"{self.ip(h)}:{GRPC}" for h in ("rollout-0", "rollout-1")),
                RLHF_RUN_DIR=str(self.run_dir),
            )
            if self.transport != "auto":
                env["RLHF_WEIGHTS_TRANSPORT"] = self.transport
        return env

    def add(self, name: str, host: str, argv: list[str], env: dict, restart: bool = True) -> HostProc:
        p = HostProc(name, self.net.host(host), argv, self.logs, env, restart)
        self.procs.append(p)
        return p.start()

    def start_redis(self) -> None:
        master = self.ip("redis-a")
        for h in REDIS_HOSTS:
            d = self.dir / h
            d.mkdir(parents=True, exist_ok=True)
            args = [
                "redis-server",
                "--port",
                str(REDIS),
                "--bind",
                "0.0.0.0",
                "--protected-mode",
                "no",  # no password on the test subnet; protected mode would refuse every peer
                "--dir",
                str(d),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--daemonize",
                "no",
                "--repl-diskless-sync-delay",
                "0",
            ]
            if h != "redis-a":
                args += ["--replicaof", master, str(REDIS)]
            self.add(f"redis-{h[-1]}", h, args, {"PATH": os.environ.get("PATH", "")})
        for h in REDIS_HOSTS:
            conf = self.dir / h / "sentinel.conf"
            conf.write_text(
                f"port {SENTINEL}\nbind 0.0.0.0\nprotected-mode no\ndir {self.dir / h}\n"
                f"sentinel monitor {SERVICE} {master} {REDIS} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 2000\n"
                f"sentinel failover-timeout {SERVICE} 6000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.add(f"sentinel-{h[-1]}", h, ["redis-server", str(conf), "--sentinel"], {"PATH": os.environ["PATH"]})
        deadline = time.monotonic() + 60
        while True:
            info = self.cli("redis-a", REDIS, "INFO", "replication")
            known = [
                self.cli(h, SENTINEL, "SENTINEL", "REPLICAS", SERVICE).count("master-link-status") for h in REDIS_HOSTS
            ]
            peers = [self.cli(h, SENTINEL, "SENTINEL", "SENTINELS", SERVICE).count("runid") for h in REDIS_HOSTS]
            if info.count("state=online") >= 2 and min(known) >= 2 and min(peers) >= 2:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Sentinel group did not form: {info!r} replicas {known} peers {peers}")
            time.sleep(0.3)
        say(f"Redis Sentinel group up: master {master}, replicas on redis-b, redis-c, 3 sentinels (quorum 2)")

    def cli(self, host: str, port: int, *args: str, timeout: float = 3.0) -> str:
        try:
            res = subprocess.run(
                ["redis-cli", "-h", self.ip(host), "-p", str(port), *args],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return ""
        return res.stdout

    def master(self) -> str | None:
        """The master's address as the first sentinel that answers says (from the harness's side)."""
        for h in REDIS_HOSTS:
            out = self.cli(h, SENTINEL, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE, timeout=1.5).split()
            if len(out) == 2:
                return out[0]
        return None

    def host_of(self, address: str) -> str:
        return next(h for h in HOSTS if self.ip(h) == address)

    def serve(self, component: str, host: str) -> HostProc:
        argv = ["rlhf", "serve", component, "--config", str(self.config), "--grpc-port", str(GRPC)]
        return self.add(
            component if host == component else host, host, [*argv, "--http-port", str(HTTP)], self.env(component, host)
        )

    def start_trainer_node(self, node: int) -> HostProc:
        host = f"trainer-{node}"
        argv = [
            "torchrun",
            "--nnodes=2",
            "--nproc-per-node=2",
            "--rdzv-backend=static",
            f"--master-addr={self.ip('trainer-0')}",
            f"--master-port={RDZV}",
            "-m",
            "services.cli",
            "serve",
            "trainer",
            "--config",
            str(self.config),
            "--grpc-port",
            str(GRPC),
            "--http-port",
            str(HTTP),
        ]
        return self.add(host, host, argv, {**self.env("trainer", host), "PET_NODE_RANK": str(node)})

    def proc(self, name: str) -> HostProc:
        return next(p for p in self.procs if p.name == name)

    def url(self, host: str) -> str:
        return f"http://{self.ip(host)}:{HTTP}"

    def wait_ready(self, hosts: list[str], timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        for h in hosts:
            while not http_ready(self.url(h), timeout=2):
                if not self.sup.is_alive() and self.proc(h).poll() is not None:  # nobody restarts it yet
                    raise RuntimeError(f"{h} exited with {self.proc(h).poll()}:\n{self.proc(h).log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{h} not ready after {timeout:.0f}s:\n{self.proc(h).log_tail()}")
                time.sleep(0.5)

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(yaml.safe_dump(experiment(), sort_keys=False))
        build_tiny(self.dir / "cache" / "tiny")  # every host reads it from the shared folder (an image's models)
        self.net.create()
        self.net.wait_reachable()
        say(
            f"{len(HOSTS)} hosts on {self.net.bridge} ({self.net.subnet}): "
            + ", ".join(f"{h}={self.ip(h)}" for h in HOSTS)
        )
        self.start_redis()
        t0 = time.monotonic()
        for c in ("reward", "reference"):
            self.serve(c, c)
        self.wait_ready(["reward", "reference"])
        for h in ("rollout-0", "rollout-1"):
            self.serve("rollout", h)
        self.wait_ready(["rollout-0", "rollout-1"])
        for node in (0, 1):
            self.start_trainer_node(node)
        self.sup.start()
        self.wait_ready(["trainer-0"])
        say(f"services and the 2 x 2 trainer group ready in {time.monotonic() - t0:.0f}s")

    # ------------------------------------------------------------ observing
    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        out = []
        if path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if not any(k.startswith("eval/") for k in rec):
                        out.append(rec)
        return out

    def steps(self) -> int:
        return len(self.metrics())

    def wait_step_after(self, count: int, timeout: float = 300) -> float:
        deadline = time.monotonic() + timeout
        while self.steps() <= count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no step after {count} within {timeout:.0f}s\n{self.tails()}")
            time.sleep(0.2)
        return time.monotonic()

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{log_tail(p.log_path, 12)}" for p in self.procs if p.log_path)

    def redis_call(self, fn):
        async def main():
            r = connect(self.redis_url)
            try:
                return await fn(r)
            finally:
                await r.aclose()

        return asyncio.run(main())

    def reclaimed(self) -> int:
        """Jobs the replicas took over after the idle timeout so far ("reclaimed N idle job(s)"): re-issued work."""
        n = 0
        for name in ("rollout-0", "rollout-1"):
            with contextlib.suppress(OSError):
                for line in self.proc(name).log_path.read_text(errors="replace").splitlines():
                    if "reclaimed " in line:
                        n += int(line.split("reclaimed ", 1)[1].split()[0])
        return n

    def log_count(self, names: list[str], needle: str) -> int:
        n = 0
        for name in names:
            with contextlib.suppress(OSError):
                n += self.proc(name).log_path.read_text(errors="replace").count(needle)
        return n

    # ------------------------------------------------------------ faults
    def run_fault(self, name: str) -> bool:
        before, reclaimed = self.steps(), self.reclaimed()
        say(f"fault {name} (at step {before})")
        t0 = time.monotonic()
        try:
            detail = getattr(self, f"fault_{name}")()
        except Exception as err:  # noqa: BLE001 - reported as the fault's failure; the network is put back
            say(f"fault {name} failed: {type(err).__name__}: {err}")
            detail = {"error": f"{type(err).__name__}: {err}", "passed": False}
            self.net.heal()
            for h in HOSTS:
                self.net.restore(h)
        back = self.steps()
        t_back = time.monotonic()
        # steps from the injection to the fault's end (the part back); a trainer that resumed cut metrics.jsonl back to
        # its checkpoint: the steps after it are trained again
        detail["steps_during"] = max(0, back - before)
        if back < before:
            detail["steps_redone_after_resume"] = before - back
        detail.setdefault("passed", True)
        try:
            done = self.wait_step_after(back)
            recover = round(done - t0, 2)
            after_back = round(done - t_back, 2)
        except TimeoutError as err:
            say(f"fault {name} did not recover: {err}")
            recover = after_back = None
        detail["jobs_reclaimed"] = self.reclaimed() - reclaimed  # counted up to the step after recovery
        if recover is None:
            detail["passed"] = False
        self.faults.append(
            {"fault": name, "step": before, "recover_s": recover, "step_after_back_s": after_back, **detail}
        )
        say(f"fault {name}: {json.dumps(self.faults[-1])}")
        return recover is not None

    def outage(self, hosts: list[str], seconds: float) -> None:
        for h in hosts:
            self.net.cut(h)
        time.sleep(seconds)
        for h in hosts:
            self.net.restore(h)

    def rollout_errors(self) -> dict[str, float]:
        """``rlhf_errors_total`` of both replicas by kind (their /metrics)."""
        out: dict[str, float] = {}
        for h in ("rollout-0", "rollout-1"):
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url(h) + "/metrics", timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("rlhf_errors_total{"):
                        kind = line.split('kind="', 1)[1].split('"', 1)[0]
                        out[kind] = out.get(kind, 0) + float(line.rsplit(" ", 1)[1])
        return out

    def fault_reward_cut(self) -> dict:
        rollouts = ["rollout-0", "rollout-1"]
        failed, errors = self.log_count(rollouts, "reward call failed"), self.rollout_errors()
        self.outage(["reward"], self.outage_s)
        self.wait_step_after(self.steps())
        after = self.rollout_errors()
        return {
            "outage_s": self.outage_s,
            "reward_calls_failed": self.log_count(rollouts, "reward call failed") - failed,
            # a sample the reward could not score would be an item error (kept as such, never a score): none here,
            # the failed calls failed their jobs, which were retried
            "rollout_errors": {k: after[k] - errors.get(k, 0) for k in after if after[k] != errors.get(k, 0)},
            "passed": self.log_count(rollouts, "reward call failed") > failed
            and after.get("rollout_score_item_not_ok", 0) == errors.get("rollout_score_item_not_ok", 0),
        }

    def fault_rollout_cut(self) -> dict:
        # the trainer pushes right after each step: cut the link as a step is written
        n = self.steps()
        self.wait_step_after(n)
        self.net.cut("rollout-1")
        cut_step = self.steps()
        time.sleep(self.outage_s)
        during = self.steps() - cut_step
        self.net.restore("rollout-1")
        return {"outage_s": self.outage_s, "cut_after_step": cut_step, "steps_while_cut": during}

    def fault_redis_master_cut(self, hold_s: float = 45.0) -> dict:
        """The master's host cut off; it stays cut until the ring has trained a step on the new master (it follows
        the failover without the old host), or ``hold_s`` at most."""
        old = self.master()
        host = self.host_of(old)
        steps = self.steps()
        self.net.cut(host)
        t0 = time.monotonic()
        new = step_while_cut = None
        while time.monotonic() - t0 < hold_s and step_while_cut is None:
            m = self.master()
            if m not in (None, old) and new is None:
                new = (m, round(time.monotonic() - t0, 2))
            if new is not None and self.steps() > steps:
                step_while_cut = round(time.monotonic() - t0, 2)
            time.sleep(0.2)
        cut_s = round(time.monotonic() - t0, 2)
        self.net.restore(host)
        demoted = self.wait_role(host, "slave", 30)
        return {
            "old_master": host,
            "new_master": self.host_of(new[0]) if new else None,
            "failover_s": new[1] if new else None,
            "first_step_on_new_master_s": step_while_cut,  # None: no step while the old master's host was cut
            "cut_s": cut_s,
            "old_master_replica_again": demoted,
            "passed": bool(new and step_while_cut is not None and demoted),
        }

    def wait_role(self, host: str, role: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f"role:{role}" in self.cli(host, REDIS, "INFO", "replication"):
                return True
            time.sleep(0.3)
        return False

    def fault_trainer_kill(self) -> dict:
        node = self.proc("trainer-1")
        restarts = self.proc("trainer-0").restarts
        resumed = self.log_count(["trainer-0"], "resumed from")
        node.kill9()
        t0 = time.monotonic()
        while self.proc("trainer-0").restarts == restarts and time.monotonic() - t0 < 120:
            time.sleep(0.2)  # node 0 loses its peers, exits with an error and is restarted
        self.wait_ready(["trainer-0"])
        return {
            "node0_restarted": self.proc("trainer-0").restarts > restarts,
            "resumed_from_checkpoint": self.log_count(["trainer-0"], "resumed from") > resumed,
            "passed": self.proc("trainer-0").restarts > restarts
            and self.log_count(["trainer-0"], "resumed from") > resumed,
        }

    def fault_partition(self, majority_only: bool = False) -> dict:
        """The master's host and the trainer's on one side, the two other Redis hosts (the sentinel majority) on the
        other, with every other host (``majority_only``: with the master's side instead), for 20 s."""
        master = self.host_of(self.master())
        others = [h for h in REDIS_HOSTS if h != master]
        side_b = others if majority_only else [h for h in HOSTS if h not in (master, "trainer-0", "trainer-1")]
        side_a = sorted(h for h in HOSTS if h not in side_b)
        ring = ["trainer-0", "rollout-0", "rollout-1"]
        lag_before = {n: self.log_count([n], "ReplicationLag") for n in ring}
        steps = self.steps()
        self.net.partition(side_b)
        time.sleep(20.0)
        during = self.steps() - steps
        self.net.heal()
        demoted = self.wait_role(master, "slave", 30)
        new = self.master()
        return {
            "side_a": side_a,
            "old_master": master,
            "master_after": self.host_of(new) if new else None,
            "old_master_replica_again": demoted,
            # writes the old master took that WAIT found on no replica: refused to the caller and retried
            "writes_fenced": {n: self.log_count([n], "ReplicationLag") - lag_before[n] for n in ring},
            "steps_while_partitioned": during,
            "passed": demoted,
        }

    def fault_partition_ring_with_master(self) -> dict:
        return self.fault_partition(majority_only=True)

    # ------------------------------------------------------------ end
    def finish(self) -> None:
        self.wait_step_after(self.steps() + 1)
        url, headers = self.url("trainer-0"), {"Authorization": f"Bearer {TOKEN}"}
        httpx.post(url + "/v1/pause", headers=headers, timeout=60).raise_for_status()
        httpx.post(url + "/v1/checkpoint", headers=headers, timeout=180).raise_for_status()
        for node in ("trainer-0", "trainer-1"):
            self.proc(node).restart = False
        for node in ("trainer-0", "trainer-1"):
            self.proc(node).stop(60)

    def ledger(self) -> dict:
        keys = RunKeys(RUN_ID)

        def read(key: str) -> list[str]:
            path = self.run_dir / "trained_jobs.jsonl"
            if not path.exists():
                return []
            return [j for ln in path.read_text().splitlines() if ln.strip() for j in json.loads(ln).get(key, [])]

        trained, dropped = read("job_ids"), set(read("dropped_stale"))

        async def collect(r):
            stats = await queue_stats(r, RUN_ID)
            issued = {k.decode() for k in await r.hkeys(keys.jobs)}
            released = {k.decode() for k in await r.hkeys(keys.released_jobs)}
            in_streams = set()
            for stream, cls in ((keys.prompts, experience_pb2.PromptJob), (keys.experience, experience_pb2.Experience)):
                for _, fields in await r.xrange(stream):
                    msg = cls()
                    msg.ParseFromString(fields[b"pb"])
                    in_streams.add(msg.job_id)
            return stats, issued, released, in_streams

        stats, issued, released, in_streams = self.redis_call(collect)
        state = json.loads(
            (
                self.run_dir
                / "checkpoints"
                / (self.run_dir / "checkpoints" / "latest").read_text().strip()
                / "state.json"
            ).read_text()
        )
        staleness = [m["staleness/max"] for m in self.metrics() if "staleness/max" in m]
        return {
            "jobs_issued": stats.issued,
            "jobs_trained": len(set(trained)),
            "jobs_trained_twice": len(trained) - len(set(trained)),
            "jobs_lost": len(issued - set(trained) - dropped - in_streams - released),
            "jobs_dropped_stale": len(dropped),
            "dead_letters": stats.dead_letters,
            "max_staleness": max(staleness) if staleness else None,
            "staleness_bound": MAX_STALENESS,
            "steps": state["step"],
            "final_policy_version": state["policy_version"],
        }

    def stop(self) -> None:
        self.sup.stopping.set()
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop(10)
        self.net.destroy()


# ------------------------------------------------------------ entry point


_ACTIVE: list[Cluster] = []


def _teardown() -> None:
    while _ACTIVE:
        c = _ACTIVE.pop()
        say("stopping every process and removing the namespaces")
        c.stop()


def _on_signal(signum, frame) -> None:
    say(f"signal {signum}: cleaning up")
    _teardown()
    sys.exit(128 + signum)


def take_over(cluster: Cluster, directory: Path) -> bool:
    """Start owning the hosts: False (said why) when another run holds the namespaces, else ``directory`` emptied and
    the cluster stopped at exit or on SIGINT / SIGTERM."""
    try:
        cluster.net.refuse_if_taken()  # before anything is touched
    except RuntimeError as err:
        say(str(err))
        return False
    if directory.exists():
        shutil.rmtree(directory)
    _ACTIVE.append(cluster)
    atexit.register(_teardown)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma list of faults, or none")
    ap.add_argument("--steps", type=int, default=4, help="with --faults none: steps before the end")
    ap.add_argument("--dir", default=str(REPO / ".cache" / "cluster"), help="working folder (emptied first)")
    ap.add_argument("--out", default=None, help="also write the JSON line to this file")
    ap.add_argument("--no-push-bench", action="store_true", help="skip the weight-push measurement")
    ap.add_argument(
        "--pod-sysctls",
        action="store_true",
        help="give every host short TCP keepalive and retransmission limits ("
        + ", ".join(f"{k}={v}" for k, v in POD_SYSCTLS.items())
        + ")",
    )
    ap.add_argument(
        "--transport",
        choices=["auto", "tcp", "grpc", "collective"],
        default="auto",
        help="the trainer's RLHF_WEIGHTS_TRANSPORT in the ring (the chart's weightSync.transport; auto: tcp here)",
    )
    ap.add_argument("--outage-s", type=float, default=10.0, help="how long reward_cut and rollout_cut hold")
    ap.add_argument("--cleanup", action="store_true", help="remove what a killed run left (namespaces, links)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        say("needs root (network namespaces)")
        return 2
    if args.cleanup:
        removed = netns.cleanup(say=say)
        say(f"nothing of {netns.PREFIX}-* left" + (f" (removed {len(removed)})" if removed else ""))
        return 0
    faults = [] if args.faults == "none" else [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"unknown faults {unknown}; known: {FAULTS}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    directory = Path(args.dir)
    cluster = Cluster(
        directory,
        transport=args.transport,
        sysctls=POD_SYSCTLS if args.pod_sysctls else None,
        outage_s=args.outage_s,
    )
    if not take_over(cluster, directory):
        return 3
    t0 = time.monotonic()
    result: dict = {}
    try:
        cluster.start()
        cluster.wait_step_after(0, timeout=300)
        if not faults:
            cluster.wait_step_after(args.steps - 1)
        for name in faults:
            if not cluster.run_fault(name):
                say("the ring did not recover: no more faults")
                break
        cluster.finish()
        result = {
            "weights_transport": args.transport,
            "pod_sysctls": args.pod_sysctls,
            "faults_injected": len(cluster.faults),
            "recovered": sum(1 for f in cluster.faults if f["recover_s"] is not None),
            "passed": sum(1 for f in cluster.faults if f["passed"]),
            **cluster.ledger(),
            "restarts": {p.name: p.restarts for p in cluster.procs if p.restarts},
            "faults": cluster.faults,
        }
        if not args.no_push_bench:
            try:
                result["weight_push"] = measure(cluster)
            except Exception as err:  # noqa: BLE001 - a figure, not the check: reported, the ledger stands
                say(f"weight-push measurement failed: {type(err).__name__}: {err}")
                result["weight_push"] = {"error": f"{type(err).__name__}: {err}"}
    finally:
        result["wall_s"] = round(time.monotonic() - t0, 1)
        _teardown()
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    ok = (
        result["jobs_lost"] == 0
        and result["jobs_trained_twice"] == 0
        and result["recovered"] == result["faults_injected"]
        and result["passed"] == result["faults_injected"]
        and result["dead_letters"] == 0
        # the pushes cut mid-transfer (weight_push.cut_*): each replica on the old version or the new one, whole
        and all(v.get("passed", False) for k, v in result.get("weight_push", {}).items() if k.startswith("cut_"))
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
