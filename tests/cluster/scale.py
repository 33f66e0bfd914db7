"""An elastic fleet on one machine: rollout 1 -> 3 -> 1 and reward 1 -> 2 -> 1 mid-run as demand falls; one JSON line.

::

    make scale-check                                     # as root: the scaling run, then the ledger
    python -m tests.cluster.scale --scale-s 600          # a longer scaling phase (420 s by default)
    python -m tests.cluster.scale --cleanup              # remove what a killed run left

No Kubernetes runs here, so a small driver does what KEDA and the HPA would with the chart's ScaledObjects
(tests/cluster/triggers.py: the same metric expressions and targets, checked against the rendered chart by
tests/deploy/test_chart.py): every ``TICK_S`` it reads rollout's ``held + waiting`` (the prompts stream's pending
entries and lag for the rollout group) and reward's ``sum(avg_over_time(rlhf_requests_in_flight[5s]))`` (scraped
from the replicas in the Service), computes ``desired = ceil(current x (metric / current) / target)`` clamped to
``[min, max]`` (the HPA's AverageValue arithmetic, with its 10% tolerance), and scales down only to the highest
recommendation of the last ``SCALE_DOWN_WINDOW_S`` (the HPA's scale-down stabilization; up is immediate).

The harness plays the demand (Fleet.next_phase): heavy (a reward item is slow: jobs back up, rollout to 3, reward to
2), light (reward is free: the trainer is the limit, one step's jobs at a time, about two replicas' slots), idle (the
trainer paused through its admin API: no job is published, held + waiting and calls in flight fall to 0, both
services to 1), then training resumes and the cycle starts again.

Kubernetes' share is played by the driver too: a replica is in its Service's endpoints (here a per-host
``/etc/netns/<ns>/hosts`` file that ``ip netns exec`` mounts over /etc/hosts: the trainer resolves ``rollout`` to
every ready replica, as with a headless Service, and each rollout resolves ``reward`` to the ready reward replicas)
once ``/readyz`` answers, and leaves them before it gets SIGTERM (a scale-in). One rollout scale-in is a kill: the
driver waits until the leaving replica holds jobs (pending under its name in Redis), sends SIGTERM, and kills it with
-9 as soon as it logs its drain (jobs in flight, reads stopped); the jobs left pending under its name must be
reclaimed by the others and each trained once (if none is left, the next scale-in while the trainer trains tries
again).
Hosts (tests/cluster/netns.py, prefix ``rlhfs``, 10.213.8.0/24):

redis                       redis-server (AOF)
reference                   ``rlhf serve reference``
reward-0, reward-1          ``rlhf serve reward``: a rule scorer that takes ``REWARD_DELAY_S`` per item (a judge's
                            cost), so that rollouts wait on reward and its requests in flight carry the load
rollout-0 .. rollout-2      ``rlhf serve rollout`` (hf engine), up to ``INFLIGHT_JOBS`` jobs each
trainer                     ``rlhf serve trainer`` (one process, the tiny PPO of make cluster-check)

The ledger (jobs issued / trained / lost / trained twice, staleness) is make cluster-check's. Exit status 0 only when
nothing was lost, trained twice or dead-lettered, staleness stayed within the bound, each service scaled out and
in at least twice and went from its maximum (rollout 3, reward 2) back to 1, with one replica killed mid-drain whose
jobs were reclaimed and trained once each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from rlhf.procs import http_ready
from rlhf.tiny import build_tiny
from rlhf.transport import queue_stats
from rlhf.transport.keys import ROLLOUT_GROUP, RunKeys
from rlhf.v1 import experience_pb2
from tests.cluster import netns
from tests.cluster.run import (
    DATA,
    GRPC,
    HTTP,
    REDIS,
    REPO,
    RUN_ID,
    TOKEN,
    Cluster,
    _teardown,
    experiment,
    take_over,
)
from tests.cluster.triggers import (
    INFLIGHT_JOBS,
    REWARD_METRIC,
    REWARD_TARGET,
    REWARD_WINDOW,
    REWARD_WINDOW_S,
    ROLLOUT_FORMULA,
    ROLLOUT_TARGET,
    SCALE_DOWN_WINDOW_S,
    Trigger,
    reward_metric,
    rollout_metric,
)

PREFIX = "rlhfs"
SUBNET = "10.213.8.0/24"
ROLLOUTS = ["rollout-0", "rollout-1", "rollout-2"]
REWARDS = ["reward-0", "reward-1"]
HOSTS = ["redis", "reference", *REWARDS, *ROLLOUTS, "trainer"]
REWARD_DELAY_S = 0.25  # a reward item's cost in the heavy phase (none in the light one)
HOLD_S = 10.0  # a phase ends once the fleet has been at its goal this long
PHASE_MAX_S = 75.0
TICK_S = 1.0  # the driver's period (KEDA polls every 30 s, the HPA syncs every 15 s by default: shortened to fit)
CONNECTION_AGE_S = 10  # RLHF_GRPC_MAX_CONNECTION_AGE_S: rollouts move to a reward replica added within ~10 s
GRACE_S = 20  # RLHF_SHUTDOWN_GRACE_S of the replicas (the pods' termination grace covers it)
KILL_WAIT_S = 30.0  # how long the kill waits for the leaving replica to hold a job before it sends SIGTERM
DRAIN_MARK = "job(s) in flight"  # the worker's "waiting up to Ns for N job(s) in flight": its drain has begun
RECLAIM_WAIT_S = 60.0  # after the scaling, how long the driver waits for the killed replica's jobs to be reclaimed
NEXT_PHASE = {"heavy": "light", "light": "idle", "idle": "heavy"}  # the load's cycle (Fleet.next_phase)


def say(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------ the fleet


def text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def scrape(url: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The sum of a metric's samples on ``url``/metrics whose labels include ``labels``; None when unreachable."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if labels and not all(f'{k}="{v}"' in line for k, v in labels.items()):
            continue
        total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Replica:
    host: str
    state: str = "off"  # off -> starting -> serving -> (doomed: to be killed, still in its Service) draining -> off
    started: float = 0.0
    log_offset: int = 0  # where this life's log begins
    swaps: float = 0.0  # its counter (note_counters) as last read in this life


def round_trip(sizes: list[int], top: int) -> bool:
    """Whether ``sizes`` (a service's size at each tick) reach ``top`` and, after that, 1."""
    return top in sizes and 1 in sizes[sizes.index(top) :]


class Fleet(Cluster):
    """The ring of tests/cluster/run.py with scalable rollout and reward workloads and a single trainer."""

    def __init__(self, directory: Path):
        super().__init__(directory)
        self.net = netns.Network(HOSTS, subnet=SUBNET, prefix=PREFIX)
        self.replicas = {h: Replica(h) for h in [*ROLLOUTS, *REWARDS]}
        self.lock = threading.Lock()
        self.events: list[dict] = []  # each replica started or stopped
        self.decisions: list[dict] = []  # each change of a service's desired size
        self.phases: list[dict] = []  # the load's changes (set_load)
        self.phase = "heavy"
        self.joins: list[dict] = []
        self.drains: list[dict] = []
        self.pushes: dict[str, float] = {h: 0.0 for h in [*ROLLOUTS, *REWARDS]}  # see note_counters
        self.killed_mid_drain: dict | None = None  # the kill that left jobs under the replica's name
        self.killed_jobs: dict[str, str] = {}  # those jobs: entry id -> job id
        self.kill_armed = True
        self.timeline: list[tuple[float, int, int, int, str]] = []  # (t, steps, rollouts, rewards serving, load)
        self.threads: list[threading.Thread] = []
        self.t0 = time.monotonic()

    @property
    def redis_url(self) -> str:
        return f"redis://{self.ip('redis')}:{REDIS}/0"

    # ------------------------------------------------------------ endpoints
    def hosts_file(self, host: str) -> Path:
        return Path("/etc/netns") / self.net.host(host).ns / "hosts"

    def write_endpoints(self) -> None:
        """Each host's /etc/hosts: ``rollout`` -> the serving rollouts (the trainer's headless Service), ``reward``
        -> the serving reward replicas, first the one this host prefers (a Service spreads connections; a gRPC
        channel keeps the first address it reaches)."""
        with self.lock:
            rollouts = [h for h in ROLLOUTS if self.replicas[h].state in ("serving", "doomed")]
            rewards = [h for h in REWARDS if self.replicas[h].state == "serving"]
        for i, host in enumerate(HOSTS):
            order = rewards[i % len(rewards) :] + rewards[: i % len(rewards)] if rewards else []
            lines = ["127.0.0.1 localhost"]
            lines += [f"{self.ip(h)} rollout" for h in rollouts]
            lines += [f"{self.ip(h)} reward" for h in order]
            path = self.hosts_file(host)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:  # in place: the file is bind-mounted into the running hosts
                f.write("\n".join(lines) + "\n")

    # ------------------------------------------------------------ start
    def env(self, component: str, host: str) -> dict:
        """make cluster-check's environment (the chart's), with the peers' Service names and the knobs above."""
        env = super().env("reference", host)  # the shared part (no peer addresses)
        env.setdefault("PYTHONPATH", str(REPO))  # this tree's code (the venv's `rlhf` may be another checkout's)
        env["RLHF_SHUTDOWN_GRACE_S"] = str(GRACE_S)
        env["RLHF_GRPC_MAX_CONNECTION_AGE_S"] = str(CONNECTION_AGE_S)
        if component in ("rollout", "trainer"):
            env.update(
                RLHF_REDIS_URL=self.redis_url,
                RLHF_REWARD_ADDR=f"reward:{GRPC}",
                RLHF_REFERENCE_ADDR=f"{self.ip('reference')}:{GRPC}",
                GLOO_SOCKET_IFNAME="eth0",
            )
        if component == "rollout":
            env.update(
                RLHF_WEIGHTS_DATA_PORT=str(DATA),
                RLHF_ROLLOUT_ENGINE="hf",
                RLHF_ROLLOUT_RECLAIM_IDLE_S="8",  # a killed replica's jobs are taken over after 8 s (default 60)
                RLHF_ROLLOUT_RPC_TIMEOUT_S="8",
                RLHF_ROLLOUT_MAX_INFLIGHT_JOBS=str(INFLIGHT_JOBS),
            )
        if component == "reward":
            env["PYTHONPATH"] = os.pathsep.join([str(self.dir / "rules"), env["PYTHONPATH"]])
        if component == "trainer":
            env.update(RLHF_ROLLOUT_ADDRS=f"rollout:{GRPC}", RLHF_RUN_DIR=str(self.run_dir))
        return env

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = experiment()
        # The fleet is under test, not learning: at make cluster-check's 1e-3 the tiny policy drifted, over 1,300
        # steps, to a batch of empty responses, which the trainer's PPO cannot whiten (it exits: docs/status.md)
        cfg["training"]["lr"] = 1e-5
        self.load = self.dir / "reward-delay"  # the load's knob: seconds a reward item costs, read at every item
        self.set_load("heavy")
        cfg["reward"] = {"scorers": [{"type": "rule", "name": "_scale_rule:slow", "kwargs": {"path": str(self.load)}}]}
        self.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        rules = self.dir / "rules"
        rules.mkdir(parents=True, exist_ok=True)
        (rules / "_scale_rule.py").write_text(
            "import time\n\n\ndef slow(prompt, response, label, path):\n"
            "    with open(path) as f:\n        time.sleep(float(f.read() or 0))\n"
            "    return sum(c.isalpha() for c in response) / max(len(response), 1)\n"
        )
        build_tiny(self.dir / "cache" / "tiny")
        self.net.create()
        self.write_endpoints()
        self.net.wait_reachable()
        say(f"{len(HOSTS)} hosts on {self.net.bridge} ({self.net.subnet})")
        self.add(
            "redis",
            "redis",
            ["redis-server", "--port", str(REDIS), "--bind", "0.0.0.0", "--protected-mode", "no", "--dir",
             str(self.dir), "--appendonly", "yes", "--save", "", "--daemonize", "no"],
            {"PATH": os.environ.get("PATH", "")},
        )  # fmt: skip
        self.serve("reference", "reference")
        self.scale_out("reward", 1, wait=True)
        self.scale_out("rollout", 1, wait=True)
        self.add("trainer", "trainer", self.trainer_argv(), self.env("trainer", "trainer"))
        self.sup.start()
        self.wait_ready(["reference", "trainer"])
        say("ring ready: rollout x1, reward x1, reference, trainer")

    def trainer_argv(self) -> list[str]:
        return ["rlhf", "serve", "trainer", "--config", str(self.config), "--grpc-port", str(GRPC), "--http-port",
                str(HTTP)]  # fmt: skip

    # ------------------------------------------------------------ scaling
    def current(self, kind: str) -> int:
        hosts = ROLLOUTS if kind == "rollout" else REWARDS
        with self.lock:
            return sum(self.replicas[h].state in ("starting", "serving") for h in hosts)

    def scale_out(self, kind: str, n: int, wait: bool = False) -> None:
        hosts = ROLLOUTS if kind == "rollout" else REWARDS
        for _ in range(n):
            with self.lock:
                host = next((h for h in hosts if self.replicas[h].state == "off"), None)
                if host is None:
                    return
                rep = self.replicas[host]
                rep.state, rep.started = "starting", time.monotonic()
            rep.swaps = 0.0
            existing = next((p for p in self.procs if p.name == host), None)
            if existing is None:
                proc = self.serve(kind, host)
                proc.restart = False  # a Deployment's pod is replaced, not restarted in place: the driver decides
            else:
                rep.log_offset = existing.log_path.stat().st_size if existing.log_path.exists() else 0
                existing.close_log()
                existing.start()
            self.events.append({"t": self.t(), "service": kind, "event": "scale_out", "host": host})
            say(f"{kind}: scale out -> {host}")
            th = threading.Thread(target=self.join, args=(kind, host), daemon=True)
            th.start()
            self.threads.append(th)
            while wait and th.is_alive() and rep.state == "starting":  # ready, not yet serving: no trainer yet
                time.sleep(0.2)

    def join(self, kind: str, host: str) -> None:
        """Until /readyz answers: then into the endpoints; a rollout replica serves once it logs its first job."""
        rep = self.replicas[host]
        proc = self.proc(host)
        while not http_ready(self.url(host), timeout=2):
            if rep.state != "starting":  # scaled in before it was ready: leave() has it
                return
            if proc.poll() is not None:
                say(f"{host} exited with {proc.poll()} while starting:\n{proc.log_tail()}")
                with self.lock:
                    rep.state = "off"
                return
            time.sleep(0.3)
        ready = time.monotonic()
        with self.lock:
            if rep.state != "starting":  # scaled in before it was ready: it never joins
                return
            rep.state = "serving"
        self.write_endpoints()
        record = {"service": kind, "host": host, "ready_s": round(ready - rep.started, 2)}
        if kind == "rollout":
            while time.monotonic() - ready < 120 and rep.state == "serving":
                text = self.log_since(host, rep.log_offset)
                m = re.search(r"first job with weights version (\d+)", text)
                if m:
                    record["serving_s"] = round(time.monotonic() - rep.started, 2)
                    record["catch_up_s"] = round(time.monotonic() - ready, 2)
                    record["version_at_first_job"] = int(m.group(1))
                    break
                time.sleep(0.2)
        self.joins.append(record)
        say(f"{kind}: {host} joined: {record}")

    def log_since(self, host: str, offset: int) -> str:
        with contextlib.suppress(OSError), open(self.proc(host).log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
        return ""

    def scale_in(self, kind: str, n: int) -> None:
        hosts = ROLLOUTS if kind == "rollout" else REWARDS
        for _ in range(n):
            with self.lock:
                host = next((h for h in reversed(hosts) if self.replicas[h].state in ("serving", "starting")), None)
                if host is None:
                    return
                # not while the trainer is paused: no replica can hold a job then, the kill would prove no reclaim
                kill = (
                    kind == "rollout"
                    and self.kill_armed
                    and self.replicas[host].state == "serving"
                    and self.phase != "idle"
                )
                # a replica to be killed stays in its Service until it holds jobs (leave): out of it, it would get
                # no weight push and, a version behind, take no job
                self.replicas[host].state = "doomed" if kill else "draining"
                if kill:
                    self.kill_armed = False
            self.write_endpoints()  # out of the Service first (Kubernetes does it as the pod terminates)
            self.events.append({"t": self.t(), "service": kind, "event": "scale_in", "host": host})
            say(f"{kind}: scale in <- {host}{' (to be killed mid-drain)' if kill else ''}")
            th = threading.Thread(target=self.leave, args=(kind, host, kill), daemon=True)
            th.start()
            self.threads.append(th)

    def leave(self, kind: str, host: str, kill: bool) -> None:
        rep, proc = self.replicas[host], self.proc(host)
        self.note_counters(host)
        if kill:  # the fault's moment: it must hold jobs when it gets SIGTERM, or the kill proves no reclaim
            wait_until = time.monotonic() + KILL_WAIT_S
            while not self.pending_of(host) and time.monotonic() < wait_until and proc.poll() is None:
                time.sleep(0.05)
            with self.lock:
                rep.state = "draining"
            self.write_endpoints()
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        record: dict = {"service": kind, "host": host}
        while proc.poll() is None and time.monotonic() - t0 < GRACE_S + 30:
            # mid-drain: SIGTERM taken, reads stopped, and its drain waiting for the jobs it holds
            if kill and DRAIN_MARK in self.log_since(host, rep.log_offset):
                proc.kill9()
                self.note_kill(host, record, time.monotonic() - t0)
                kill = False
                break
            time.sleep(0.005)
        if proc.poll() is None:
            proc.kill9()
            record["killed_after_grace"] = True
        record["exit_s"] = round(time.monotonic() - t0, 2)
        record["returncode"] = proc.poll()
        m = re.search(
            r"drained in ([0-9.]+)s: (\d+) job\(s\) finished, (\d+) not", self.log_since(host, rep.log_offset)
        )
        if m:
            record.update(drain_s=float(m.group(1)), jobs_finished=int(m.group(2)), jobs_handed_back=int(m.group(3)))
        if kill:
            record["no_job_at_sigterm"] = True
        if self.killed_mid_drain is None:
            self.kill_armed = True  # no job was left under its name: kill at the next scale-in
        self.drains.append(record)
        say(f"{kind}: {host} left: {record}")
        proc.close_log()
        with self.lock:
            rep.state = "off"

    def note_kill(self, host: str, record: dict, after_s: float) -> None:
        """After the -9: the jobs pending under its name are what the others must reclaim (none: try again)."""
        left = self.pending_jobs(host)
        record["killed_mid_drain"] = True
        record["jobs_left_pending"] = len(left)
        if left:
            self.killed_mid_drain = {"host": host, "after_sigterm_s": round(after_s, 2), "jobs_pending": len(left)}
            self.killed_jobs = left
        say(f"rollout: {host} killed -9 mid-drain, {after_s:.2f}s after SIGTERM, {len(left)} job(s) under its name")

    def pending_of(self, consumer: str) -> int:
        """Prompt jobs delivered to ``consumer`` and not acknowledged (its jobs in flight)."""

        async def count(r) -> int:
            rows = await r.xpending_range(RunKeys(RUN_ID).prompts, ROLLOUT_GROUP, "-", "+", 100, consumer)
            return len(rows)

        try:
            return self.redis_call(count)
        except Exception:  # noqa: BLE001 - unknown: not killed this time
            return 0

    def pending_jobs(self, consumer: str) -> dict[str, str]:
        """entry id -> job id of the prompt jobs pending under ``consumer``."""
        stream = RunKeys(RUN_ID).prompts

        async def read(r) -> dict[str, str]:
            out = {}
            for row in await r.xpending_range(stream, ROLLOUT_GROUP, "-", "+", 100, consumer):
                entry = text(row["message_id"])
                for _, fields in await r.xrange(stream, entry, entry):
                    job = experience_pb2.PromptJob()
                    job.ParseFromString(fields[b"pb"])
                    out[entry] = job.job_id
            return out

        return self.redis_call(read)

    def killed_jobs_reclaimed(self) -> bool:
        """Whether no job the killed replica left is still pending under its name (another replica took it, or a
        later life of the same host took and finished it)."""
        if self.killed_mid_drain is None:
            return False
        host, stream = self.killed_mid_drain["host"], RunKeys(RUN_ID).prompts

        async def still(r) -> int:
            n = 0
            for entry in self.killed_jobs:
                rows = await r.xpending_range(stream, ROLLOUT_GROUP, entry, entry, 1)
                n += sum(1 for row in rows if text(row["consumer"]) == host and row["times_delivered"] == 1)
            return n

        try:
            return self.redis_call(still) == 0
        except Exception:  # noqa: BLE001 - not known yet
            return False

    def note_counters(self, host: str) -> None:
        """Add what ``host`` counted in this life (its counters start at 0 each start): a rollout replica's pushes
        installed (rlhf_rollout_swap_seconds_count), a reward replica's Score calls (rlhf_requests_total)."""
        rep = self.replicas[host]
        if host in ROLLOUTS:
            n = scrape(self.url(host), "rlhf_rollout_swap_seconds_count")
        else:
            n = scrape(self.url(host), "rlhf_requests_total", {"method": "Score", "protocol": "grpc"})
        if n is not None and n > rep.swaps:
            self.pushes[host] += n - rep.swaps
            rep.swaps = n

    def log_sum(self, pattern: str, count: bool = False) -> int:
        """The sum of ``pattern``'s first group (``count``: how many matches) over every rollout replica's log (all
        its lives)."""
        n = 0
        for h in ROLLOUTS:
            with contextlib.suppress(OSError, StopIteration):
                found = re.findall(pattern, self.proc(h).log_path.read_text(errors="replace"))
                n += len(found) if count else sum(int(m) for m in found)
        return n

    def t(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def set_load(self, phase: str) -> None:
        """``heavy``: a reward item costs ``REWARD_DELAY_S`` (rollouts wait on reward, jobs back up); ``light``: none
        (the trainer is the bottleneck: each step admits a global batch, about two replicas' slots); ``idle``: none,
        and the trainer paused through its admin API (it publishes no job and trains no step: demand falls to 0)."""
        if phase == "idle":
            self.admin("pause")
        elif self.phase == "idle":
            self.admin("resume")
        self.phase = phase
        self.load.write_text(str(REWARD_DELAY_S if phase == "heavy" else 0.0))
        self.phases.append({"t": self.t(), "load": phase})
        say(f"load: {phase}")

    def admin(self, action: str) -> None:
        """The trainer's ``POST /v1/pause`` or ``/v1/resume`` (token required)."""
        headers = {"Authorization": f"Bearer {TOKEN}"}
        httpx.post(f"{self.url('trainer')}/v1/{action}", headers=headers, timeout=60).raise_for_status()

    def next_phase(self, now: float) -> None:
        """The demand the harness plays, falling in two steps: heavy until both services have served at their
        maximum for ``HOLD_S``; light until rollout has scaled in (the kill's chance: its replicas still hold jobs)
        and no replica is starting or leaving; idle until both are back at 1 for ``HOLD_S``; then heavy again. Each
        phase ``PHASE_MAX_S`` at most."""
        with self.lock:
            serving = [sum(self.replicas[h].state == "serving" for h in hosts) for hosts in (ROLLOUTS, REWARDS)]
            busy = any(r.state in ("starting", "doomed", "draining") for r in self.replicas.values())
        since = self.phase_started
        if self.phase == "light":
            mine = [d for d in self.decisions if d["service"] == "rollout" and d["t"] >= self.phase_t]
            done = any(d["to"] < d["from"] for d in mine) and not busy
        else:
            goal = [len(ROLLOUTS), len(REWARDS)] if self.phase == "heavy" else [1, 1]
            if serving != goal or busy:
                self.held_since = None
            elif self.held_since is None:
                self.held_since = now
            done = self.held_since is not None and now - self.held_since >= HOLD_S
        if done or now - since >= PHASE_MAX_S:
            self.set_load(NEXT_PHASE[self.phase])
            self.phase_started, self.phase_t, self.held_since = now, self.t(), None

    def drive(self, seconds: float, need: int = 2) -> dict:
        """The autoscaler's loop for ``seconds`` at most, or until both services scaled out and in ``need`` times,
        each went from its maximum back to 1, and a replica was killed mid-drain leaving jobs, with no replica starting
        or draining. The trainer is training when it returns."""
        rollout = Trigger("rollout", ROLLOUT_TARGET, 1, len(ROLLOUTS))
        reward = Trigger("reward", REWARD_TARGET, 1, len(REWARDS))
        self.metric_log: list[tuple[float, float, float]] = []  # (t, rollout metric, reward metric)
        end = time.monotonic() + seconds
        self.phase_started, self.phase_t, self.held_since = time.monotonic(), self.t(), None
        try:
            self.scale_loop(end, need, rollout, reward)
        finally:
            if self.phase == "idle":  # the ledger's last steps need a training trainer
                self.set_load("light")
        return self.counts()

    def scale_loop(self, end: float, need: int, rollout: Trigger, reward: Trigger) -> None:
        """:meth:`drive`'s ticks."""
        samples: dict[str, list[tuple[float, float]]] = {}  # reward replica in its Service -> its scrapes
        while time.monotonic() < end:
            now = time.monotonic()
            self.next_phase(now)
            stats = self.redis_call(lambda r: queue_stats(r, RUN_ID))
            jobs = rollout_metric(held=stats.prompts_pending, waiting=stats.prompts_backlog)
            with self.lock:
                serving_rewards = [h for h in REWARDS if self.replicas[h].state == "serving"]
                serving_rollouts = [h for h in ROLLOUTS if self.replicas[h].state in ("serving", "doomed")]
            # what the ServiceMonitor scrapes: the replicas in the Service; a replica that left takes its series
            samples = {h: [(t, v) for t, v in samples.get(h, []) if now - t < REWARD_WINDOW_S] for h in serving_rewards}
            for h in serving_rewards:
                v = scrape(self.url(h), REWARD_METRIC)  # every series: each method and protocol, summed
                if v is not None:
                    samples[h].append((now, v))
            inflight = reward_metric(samples, now)
            for h in [*serving_rollouts, *serving_rewards]:
                self.note_counters(h)
            for trig, kind, metric in ((rollout, "rollout", jobs), (reward, "reward", inflight)):
                cur = self.current(kind)
                want = trig.desired(metric, cur, now)
                if want != cur:
                    self.decisions.append({"t": self.t(), "service": kind, "from": cur, "to": want, "metric": metric})
                if want > cur:
                    self.scale_out(kind, want - cur)
                elif want < cur:
                    self.scale_in(kind, cur - want)
            self.timeline.append((now, self.steps(), len(serving_rollouts), len(serving_rewards), self.phase))
            self.metric_log.append((self.t(), jobs, round(inflight, 2)))
            counts = self.counts()
            settled = all(r.state in ("off", "serving") for r in self.replicas.values())
            trips = self.round_trips()
            if min(counts.values()) >= need and all(trips.values()) and self.killed_mid_drain is not None and settled:
                break
            time.sleep(max(0.0, TICK_S - (time.monotonic() - now)))

    def round_trips(self) -> dict[str, bool]:
        """Whether each service served at its maximum and, later, at 1 (replicas in its Service, each tick)."""
        return {
            "rollout": round_trip([row[2] for row in self.timeline], len(ROLLOUTS)),
            "reward": round_trip([row[3] for row in self.timeline], len(REWARDS)),
        }

    def counts(self) -> dict[str, int]:
        """Scaling decisions per service and direction (1 -> 3 is one scale-out of two replicas)."""
        out = {}
        for kind in ("rollout", "reward"):
            mine = [d for d in self.decisions if d["service"] == kind]
            out[f"{kind}_scale_out"] = sum(1 for d in mine if d["to"] > d["from"])
            out[f"{kind}_scale_in"] = sum(1 for d in mine if d["to"] < d["from"])
        return out

    def steps_per_minute(self) -> dict[str, dict[str, float]]:
        """Steps per minute over the time each service spent at each size (replicas serving: in the endpoints), the
        trainer's pauses (the idle phases) left out."""
        out: dict[str, dict[str, float]] = {"rollout": {}, "reward": {}}
        for col, kind in ((2, "rollout"), (3, "reward")):
            spans: dict[int, list[float]] = {}
            for a, b in zip(self.timeline, self.timeline[1:], strict=False):
                if a[4] == "idle":
                    continue
                s = spans.setdefault(a[col], [0.0, 0.0])
                s[0] += b[0] - a[0]
                s[1] += b[1] - a[1]
            out[kind] = {
                str(size): round(60 * steps / secs, 2) for size, (secs, steps) in sorted(spans.items()) if secs > 5
            }
            out[kind + "_seconds"] = {str(size): round(secs, 1) for size, (secs, _) in sorted(spans.items())}
        return out

    # ------------------------------------------------------------ end
    def finish(self) -> None:
        self.wait_step_after(self.steps() + 2)  # a job reclaimed just now: written, then read by the next step
        url, headers = self.url("trainer"), {"Authorization": f"Bearer {TOKEN}"}
        self.admin("pause")
        httpx.post(url + "/v1/checkpoint", headers=headers, timeout=180).raise_for_status()
        self.proc("trainer").restart = False
        self.proc("trainer").stop(60)

    def killed_jobs_outcome(self) -> dict:
        """How often the trainer trained each job the killed replica left (its ledger, written at checkpoints)."""
        path = self.run_dir / "trained_jobs.jsonl"
        lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
        trained = [j for line in lines for j in line.get("job_ids", [])]
        counts = [trained.count(j) for j in self.killed_jobs.values()]
        return {
            "left": len(counts),
            "reclaimed": self.killed_jobs_reclaimed(),
            "trained_once": sum(1 for c in counts if c == 1),
            "trained_twice": sum(1 for c in counts if c > 1),
            "not_trained": sum(1 for c in counts if c == 0),
            "job_ids": sorted(self.killed_jobs.values()),
        }

    def trainer_events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]

    def stop(self) -> None:
        super().stop()
        for h in HOSTS:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.hosts_file(h).parent)


# ------------------------------------------------------------ entry point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--scale-s", type=float, default=420.0, help="the scaling phase's limit in seconds")
    ap.add_argument("--dir", default=str(REPO / ".cache" / "scale"), help="working folder (emptied first)")
    ap.add_argument("--out", default=None, help="also write the JSON line to this file")
    ap.add_argument("--cleanup", action="store_true", help="remove what a killed run left (namespaces, links)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        say("needs root (network namespaces)")
        return 2
    if args.cleanup:
        removed = netns.cleanup(PREFIX, say=say)
        for ns in Path("/etc/netns").glob(f"{PREFIX}-*"):
            shutil.rmtree(ns, ignore_errors=True)
        say(f"nothing of {PREFIX}-* left" + (f" (removed {len(removed)})" if removed else ""))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    directory = Path(args.dir)
    fleet = Fleet(directory)
    if not take_over(fleet, directory):
        return 3
    t0 = fleet.t0 = time.monotonic()
    result: dict = {}
    try:
        fleet.start()
        fleet.wait_step_after(0, timeout=300)
        say("first step trained: scaling")
        counts = fleet.drive(args.scale_s)
        for th in fleet.threads:
            th.join(GRACE_S + 40)
        until = time.monotonic() + RECLAIM_WAIT_S
        while fleet.killed_mid_drain is not None and not fleet.killed_jobs_reclaimed() and time.monotonic() < until:
            time.sleep(0.5)
        fleet.finish()
        events = fleet.trainer_events()
        result = {
            **counts,
            **fleet.ledger(),
            "round_trips": fleet.round_trips(),
            "killed_mid_drain": fleet.killed_mid_drain,
            "killed_jobs": fleet.killed_jobs_outcome(),
            "pushes_installed": {h: int(fleet.pushes[h]) for h in ROLLOUTS},
            "reward_calls": {h: int(fleet.pushes[h]) for h in REWARDS},
            # a request failed by a leaving reward replica would fail a reward call (retried) or its job (re-issued)
            "reward_calls_failed": fleet.log_sum(r"(?m)(: )reward call failed", count=True),
            "rollout_jobs_failed": fleet.log_sum(r"(?m)job \S+ failed( )", count=True),
            "jobs_reclaimed": fleet.log_sum(r"reclaimed (\d+) idle job"),
            "jobs_handed_back": fleet.log_sum(r"(\d+) job\(s\) handed back"),
            "trainer_waiting_events": sum(1 for e in events if e.get("event") == "waiting"),
            "joins": fleet.joins,
            "drains": fleet.drains,
            "steps_per_minute": fleet.steps_per_minute(),
            "metrics": {"rollout": ROLLOUT_FORMULA, "reward": f"sum(avg_over_time({REWARD_METRIC}[{REWARD_WINDOW}]))"},
            "metric_max": {
                "rollout": max((m[1] for m in fleet.metric_log), default=None),
                "reward": max((m[2] for m in fleet.metric_log), default=None),
            },
            "targets": {"rollout": ROLLOUT_TARGET, "reward": REWARD_TARGET, "scale_down_window_s": SCALE_DOWN_WINDOW_S},
            "load_phases": fleet.phases,
            "decisions": fleet.decisions,
            "scaling": fleet.events,
        }
    finally:
        result["wall_s"] = round(time.monotonic() - t0, 1)
        _teardown()
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    need = ["rollout_scale_out", "rollout_scale_in", "reward_scale_out", "reward_scale_in"]
    ok = (
        result.get("jobs_lost") == 0
        and result.get("jobs_trained_twice") == 0
        and result.get("dead_letters") == 0
        and result.get("max_staleness") is not None
        and result["max_staleness"] <= result["staleness_bound"]
        and all(result.get(k, 0) >= 2 for k in need)
        and result["round_trips"] == {"rollout": True, "reward": True}
        and result.get("killed_mid_drain") is not None
        and result.get("jobs_reclaimed", 0) > 0
        and result["killed_jobs"]["trained_once"] == result["killed_jobs"]["left"] > 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
