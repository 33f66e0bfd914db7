"""One training ring of real processes on loopback: redis-server, reward, reference, rollout replica(s), trainer.

::

    def test_ppo(rings):                # the ``rings`` fixture of conftest.py (a Rings)
        ring = rings("e2e-ppo", stage="ray_ppo", engine="vllm").start()
        ring.wait_trained()             # the trainer exited 0 after training.train_iters steps
        ring.metrics(); ring.state(); ring.stats(); ring.served_version()

Each ring has its own run id (so its Redis keys, prompt jobs and experience are its own) and its own rollout
replicas and trainer; the reward and reference services are stateless and shared by the rings of a session
(:class:`SharedScorers`), except where a test stops one (then it starts its own). :class:`Rings` makes the rings
of a test (or a module) and stops them, and the redis-servers and services it was given, at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

from rlhf.transport import connect, queue_stats
from rlhf.transport.keys import RunKeys
from rlhf.v1 import experience_pb2
from tests.integration._procs import ServiceProc, write_config
from tests.support.redis import RedisServer as Redis

TOKEN = "e2e-token"
# Every child gets one thread: five torch processes share two cores (the launcher does the same).
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RLHF_API_TOKEN": TOKEN}


def base_config(run_id: str, **over: Any) -> dict:
    """A tiny experiment: batch 4, 6 new tokens, the digit-fraction rule reward (as configs/demo.yaml)."""
    stage = over.get("stage", "ray_ppo")
    n = over.get("n", 2 if stage == "ray_online_dpo" else (4 if stage == "ray_grpo" else 1))
    return {
        "run_id": run_id,
        "training": {
            "stage": stage,
            "global_batch_size": over.get("batch", 4),
            "seq_length": 64,
            "train_iters": over.get("train_iters", 3),
            "lr": over.get("lr", 1e-3),
            "save_interval": over.get("save_interval", 1),
            "save": "unused-checkpoints",  # RLHF_RUN_DIR wins
            "device": "cpu",
            "max_staleness": over.get("max_staleness", 0),
            "seed": 1234,
        },
        "actor_rollout_ref": {
            "actor_rollout": {
                "load": "tiny:policy",
                "engine": over.get("engine", "hf"),
                "do_sample": True,
                "temperature": 1.0,
                "max_prompt_length": 48,
                "max_new_tokens": over.get("max_new_tokens", 6),
                "n_samples_per_prompt": n,
                "ppo_mini_batch_size": 8,
                "ppo_epochs": 1,
                **over.get("actor", {}),
            },
            "ref": {"micro_batch_size": 32},
        },
        "critic": {"load": "tiny:reward", "critic_mini_batch_size": 8, "critic_update_epochs": 1},
        "reward": {"scorers": [{"type": "rule", "name": "char_fraction"}]},
        "algorithm": {
            "adv_estimator": "grpo" if stage == "ray_grpo" else "gae",
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.01},
            "dpo_beta": 0.1,
        },
        "data": {"path": "builtin:arithmetic"},
        **({"eval": over["eval"]} if "eval" in over else {}),
    }


class SharedScorers:
    """The reward and reference services for every ring of a session (started together on first use)."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.config = write_config(self.log_dir / "scorers.yaml", base_config("e2e-scorers"))
        self.reward: ServiceProc | None = None
        self.reference: ServiceProc | None = None

    def get(self) -> tuple[ServiceProc, ServiceProc]:
        if self.reward is None:
            self.reward = start_reward(self.config, self.log_dir, wait=False)
            self.reference = ServiceProc("reference", self.config, self.log_dir, env=dict(CHILD_ENV))
            self.reference.start(wait_ready=False)
        self.reward = respawn_on_port_clash(self.reward, 180)
        self.reference = respawn_on_port_clash(self.reference, 180)
        return self.reward, self.reference

    def stop(self) -> None:
        for p in (self.reward, self.reference):
            if p is not None:
                p.stop()


def respawn_on_port_clash(proc: ServiceProc, timeout: float) -> ServiceProc:
    """Wait for ``proc``; if it lost a race for its free port (another test process took it), start a copy on new
    ports and return that one."""
    for _ in range(3):
        try:
            proc.wait_ready(timeout)
            return proc
        except RuntimeError:
            if "Address already in use" not in proc.log_text():
                raise
            proc.stop()
            proc = ServiceProc(proc.name, proc.config, proc.log_path.parent, env=proc.env, extra_args=proc.extra_args)
            proc.start(wait_ready=False)
    proc.wait_ready(timeout)
    return proc


def start_reward(config: Path, log_dir: Path, *, wait: bool = True, grpc_port=None, http_port=None) -> ServiceProc:
    proc = ServiceProc("reward", config, log_dir, env=dict(CHILD_ENV), grpc_port=grpc_port, http_port=http_port)
    proc.start(wait_ready=False)
    return respawn_on_port_clash(proc, 180) if wait else proc


def http_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Ring:
    """Rollout replica(s) + trainer of one run, on a given Redis, reward and reference."""

    def __init__(
        self,
        run_id: str,
        directory: Path,
        redis: Redis,
        reward_addr: str,
        reference_addr: str,
        *,
        replicas: int = 1,
        rollout_env: dict[str, str] | None = None,
        rollout_proc: type[ServiceProc] = ServiceProc,
        **config: Any,
    ):
        self.run_id = run_id
        self.dir = Path(directory)
        self.redis = redis
        self.cfg = base_config(run_id, **config)
        self.config_path = write_config(self.dir / f"{run_id}.yaml", self.cfg)
        self.run_dir = self.dir / "run"
        self.logs = self.dir / "logs"
        common = {**CHILD_ENV, "RLHF_REDIS_URL": redis.url, "RLHF_RUN_ID": run_id}
        self.rollouts = [
            rollout_proc(
                "rollout",
                self.config_path,
                self.logs,
                env={
                    **common,
                    "RLHF_REWARD_ADDR": reward_addr,
                    "RLHF_REFERENCE_ADDR": reference_addr,
                    "RLHF_REPLICA_ID": f"{run_id}-rollout-{i}",
                    "RLHF_ROLLOUT_RECLAIM_IDLE_S": "2",
                    "RLHF_RUN_DIR": str(self.dir / "run"),
                    **(rollout_env or {}),
                },
            )
            for i in range(replicas)
        ]
        self.trainer_env = {
            **common,
            "RLHF_ROLLOUT_ADDRS": ",".join(r.grpc_addr for r in self.rollouts),
            "RLHF_REWARD_ADDR": reward_addr,  # the eval section's scores
            "RLHF_RUN_DIR": str(self.run_dir),
        }
        self.trainers: list[ServiceProc] = []
        self.killed: list[ServiceProc] = []

    @property
    def trainer(self) -> ServiceProc:
        return self.trainers[-1]

    @property
    def batch(self) -> int:
        return self.cfg["training"]["global_batch_size"]

    @property
    def train_iters(self) -> int:
        return self.cfg["training"]["train_iters"]

    def start(self, *, trainer: bool = True, replicas: int | None = None) -> Ring:
        """Start the first ``replicas`` rollout replicas (default all; the others are in the trainer's address list,
        as a scaled-up Deployment's pods are, and start later with :meth:`start_replica`), then the trainer."""
        started = self.rollouts[:replicas]
        for r in started:
            if r.proc is None:
                r.start(wait_ready=False)
        self.rollouts[: len(started)] = [respawn_on_port_clash(r, 240) for r in started]
        self.trainer_env["RLHF_ROLLOUT_ADDRS"] = ",".join(r.grpc_addr for r in self.rollouts)
        if trainer:
            self.start_trainer()
        return self

    def start_trainer(self) -> ServiceProc:
        for _ in range(3):
            t = ServiceProc("trainer", self.config_path, self.logs, env=self.trainer_env)
            self.trainers.append(t)
            t.start(wait_ready=False)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                if t.proc.poll() is not None:  # a short run may finish before /readyz is polled: exit 0 is fine
                    break
                try:
                    t.wait_ready(1)
                    return t
                except (TimeoutError, RuntimeError):
                    continue
            else:
                raise TimeoutError(f"trainer not ready:\n{t.log_tail()}")
            if t.proc.returncode == 0:
                return t
            if "Address already in use" not in t.log_text():
                raise AssertionError(f"trainer exited with {t.proc.returncode}:\n{t.log_tail()}")
            self.trainers.remove(t)  # lost a race for its free port: again on new ports
        raise AssertionError("trainer: no free ports")

    def start_replica(self, i: int, timeout: float = 240) -> None:
        """Start replica ``i`` on the address the trainer already has (no respawn: the trainer knows only that one)."""
        self.rollouts[i].start(wait_ready=False)
        self.rollouts[i].wait_ready(timeout)

    def stop(self) -> None:
        for p in [*self.trainers, *self.rollouts]:
            p.stop(timeout=15)

    # ------------------------------------------------------------------ observing
    def metrics(self, *, eval_rows: bool = False) -> list[dict]:
        """The training steps' rows of metrics.jsonl; ``eval_rows``: the eval section's rows instead."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                rec = json.loads(line)
                if any(k.startswith("eval/") for k in rec) == eval_rows:
                    out.append(rec)
        return out

    def wait_for(self, cond, timeout: float, what: str, interval: float = 0.1) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.run_id}: no {what} after {timeout:.0f}s\n{self.log_tails()}")
            procs = [p for p in [self.trainer, *self.rollouts] if p not in self.killed and p.proc is not None]
            dead = [p for p in procs if p.proc.poll() not in (None, 0)]
            assert not dead, f"{dead[0].name} exited with {dead[0].proc.returncode}:\n{dead[0].log_tail()}"
            time.sleep(interval)

    def wait_steps(self, n: int, timeout: float = 120) -> None:
        self.wait_for(lambda: len(self.metrics()) >= n, timeout, f"step {n}")

    def wait_trained(self, timeout: float = 240) -> None:
        """Until the trainer exits; it must exit 0 (train_iters steps done)."""
        self.wait_for(lambda: self.trainer.proc.poll() is not None, timeout, "end of training")
        assert self.trainer.proc.returncode == 0, self.trainer.log_tail()

    def log_tails(self) -> str:
        procs = [p for p in [*self.trainers, *self.rollouts] if p.proc is not None]
        return "\n".join(f"--- {p.name} {p.log_path}\n{p.log_tail(15)}" for p in procs)

    def checkpoint_dir(self, step: int | None = None) -> Path:
        root = self.run_dir / "checkpoints"
        name = f"step_{step}" if step is not None else (root / "latest").read_text().strip()
        return root / name

    def ledger(self) -> list[str]:
        """Every job id the run trained, from its ledger (trained_jobs.jsonl: per checkpoint, the jobs trained since
        the one before; cut back with the checkpoints on a resume). A job in it twice was trained twice."""
        return trained_ledger(self.run_dir)

    def dropped_stale(self) -> list[str]:
        return trained_ledger(self.run_dir, "dropped_stale")

    def state(self, step: int | None = None) -> dict:
        return json.loads((self.checkpoint_dir(step) / "state.json").read_text())

    def served_version(self, replica: int = 0) -> int:
        return int(http_json(self.rollouts[replica].http_url + "/v1/weights/version")["version"])

    def redis_call(self, fn):
        """``await fn(redis)`` on a fresh client (closed afterwards)."""

        async def main():
            r = connect(self.redis.url)
            try:
                return await fn(r)
            finally:
                await r.aclose()

        return asyncio.run(main())

    def stats(self):
        return self.redis_call(lambda r: queue_stats(r, self.run_id))

    def stream_job_ids(self, which: str) -> list[str]:
        """The job ids of every entry still in the ``prompts`` or ``experience`` stream."""
        keys = RunKeys(self.run_id)
        stream = keys.prompts if which == "prompts" else keys.experience
        cls = experience_pb2.PromptJob if which == "prompts" else experience_pb2.Experience

        async def read(r):
            return await r.xrange(stream)

        out = []
        for _, fields in self.redis_call(read):
            msg = cls()
            msg.ParseFromString(fields[b"pb"])
            out.append(msg.job_id)
        return out

    def issued_job_ids(self) -> set[str]:
        async def read(r):
            return await r.hkeys(RunKeys(self.run_id).jobs)

        return {k.decode() for k in self.redis_call(read)}

    def kill(self, proc: ServiceProc) -> None:
        """kill -9 (the process only: a vLLM engine's helpers would go with it when its parent dies)."""
        self.killed.append(proc)
        proc.signal(signal.SIGKILL)
        proc.proc.wait(timeout=10)


class Rings:
    """The rings of a test or a module, each in its own folder under ``directory``, on the session's reward and
    reference (:class:`SharedScorers`) and one redis-server of its own unless told otherwise; :meth:`close` stops the
    rings, then whatever :meth:`own` was given (the redis-servers included), last first.

    ``rings(run_id, **options)`` is a :class:`Ring` not yet started (a test may change its config first);
    ``redis=``, ``reward=`` and ``reference=`` put it on another Redis or another reward or reference service."""

    def __init__(self, directory: Path, scorers: SharedScorers):
        self.dir = Path(directory)
        self.scorers = scorers
        self.made: list[Ring] = []
        self.owned: list[Any] = []
        self._redis: Redis | None = None

    def own(self, thing: Any) -> Any:
        """Stop ``thing`` (a redis-server, a service: anything with ``stop()``) at :meth:`close`; returns it."""
        self.owned.append(thing)
        return thing

    def redis(self, name: str = "redis") -> Redis:
        """A redis-server of its own, started, in ``directory/name``."""
        return self.own(Redis(self.dir / name).start())

    def __call__(
        self,
        run_id: str,
        *,
        redis: Any = None,
        reward: ServiceProc | None = None,
        reference: ServiceProc | None = None,
        **options: Any,
    ) -> Ring:
        shared_reward, shared_reference = self.scorers.get()
        if redis is None:
            if self._redis is None:
                self._redis = self.redis()
            redis = self._redis
        ring = Ring(
            run_id,
            self.dir / run_id,
            redis,
            (reward or shared_reward).grpc_addr,
            (reference or shared_reference).grpc_addr,
            **options,
        )
        self.made.append(ring)
        return ring

    def close(self) -> None:
        for ring in self.made:
            ring.stop()
        for thing in reversed(self.owned):
            thing.stop()


def trained_ledger(run_dir: Path, key: str = "job_ids") -> list[str]:
    """The run's ledger: ``job_ids`` (trained) or ``dropped_stale`` (consumed without training: too stale)."""
    path = Path(run_dir) / "trained_jobs.jsonl"
    if not path.exists():
        return []
    return [job for line in path.read_text().splitlines() if line.strip() for job in json.loads(line).get(key, [])]


def assert_ledger(ring: Ring, steps: int) -> dict:
    """The final checkpoint accounts for every job: ``steps x batch`` distinct job ids trained, nothing lost or
    dead-lettered, every job issued but not trained still in a stream (in flight), nothing pending that was trained.
    Returns the final state."""
    state = ring.state()
    assert state["step"] == steps
    ids = ring.ledger()
    assert len(ids) == len(set(ids)) == steps * ring.batch, (len(ids), len(set(ids)))
    stats = ring.stats()
    assert stats.dead_letters == 0, stats
    assert stats.released == 0, stats
    assert stats.experience_pending == 0, stats  # everything trained is acknowledged (covered by the checkpoint)
    issued = ring.issued_job_ids()  # trained jobs older than the last checkpoints are forgotten here
    assert stats.issued >= len(ids)
    in_streams = set(ring.stream_job_ids("prompts")) | set(ring.stream_job_ids("experience"))
    dropped = ring.dropped_stale()
    lost = issued - set(ids) - set(dropped) - in_streams
    assert not lost, f"issued, never trained and in no stream: {sorted(lost)}"
    assert stats.trained == len(ids) + len(dropped)
    return state
