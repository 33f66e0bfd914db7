"""Chaos: one training ring of real processes under a scripted sequence of faults; prints one JSON line.

::

    python -m tests.e2e.chaos                 # one round of every fault (what `make test` runs, via test_chaos.py)
    make chaos                                # the long run: CHAOS_ROUNDS rounds (default 3), more steps

The ring: redis-server (AOF), reward, reference, two rollout replicas (hf engine) and the trainer, GRPO on the tiny
model, asynchronous (``max_staleness: 1``). Each round injects, one after the other and each once the ring has
trained a step since the previous one:

poison          experience records the ring never issued: token ids outside the vocabulary, a NaN score, an
                infinite log-prob (dead-lettered; they release no admission slot)
kill_rollout    kill -9 of rollout replica 0, restarted on its ports (as compose or Kubernetes would)
kill_trainer    kill -9 of the trainer, restarted (resumes from its checkpoint)
redis_restart   kill -9 of redis-server, restarted on its AOF
reward_outage   kill -9 of the reward service, back after 3 s
kill_reference  kill -9 of the reference service, restarted
admin_storm     16 concurrent POST /v1/checkpoint and GET /v1/status calls to the trainer
slow_clients    100 connections to rollout's HTTP port that send their headers one byte a second

The supervisor here only restarts what was killed; nobody touches the queue. ``recover_s`` of a fault is the time
from its injection to the first step trained after the faulted part was back. The trainer has no step limit that
the faults could outrun (a tiny step takes a fraction of a second, a restart several seconds): after the last fault
and two more steps it is paused, checkpointed and stopped. The ledger comes from that checkpoint and Redis: jobs
issued, trained (distinct), trained twice (in the ledger), lost (issued, never trained, in no stream, not
dead-lettered, not dropped as too stale). ``max_staleness`` is the largest staleness, in training steps, of a sample
that was trained; records that arrived staler than the bound were dropped (``jobs_dropped_stale``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from rlhf.tiny import build_tiny
from rlhf.transport.keys import PAYLOAD_FIELD, RunKeys
from tests.e2e._ring import CHILD_ENV, TOKEN, Redis, Ring, base_config
from tests.integration._procs import ServiceProc, write_config
from tests.support import make_experience, make_sample

FAULTS = [
    "poison",
    "kill_rollout",
    "kill_trainer",
    "redis_restart",
    "reward_outage",
    "kill_reference",
    "admin_storm",
    "slow_clients",
]
MAX_STALENESS = 1


class Chaos:
    def __init__(self, directory: Path, rounds: int = 1):
        self.dir = Path(directory)
        self.rounds = rounds
        self.redis = Redis(self.dir / "redis").start()
        scorer_cfg = write_config(self.dir / "scorers.yaml", base_config("chaos-scorers"))
        self.reward = ServiceProc("reward", scorer_cfg, self.dir / "logs", env=dict(CHILD_ENV))
        self.reference = ServiceProc("reference", scorer_cfg, self.dir / "logs", env=dict(CHILD_ENV))
        for p in (self.reward, self.reference):
            p.start(wait_ready=False)
        self.ring = Ring(
            "chaos",
            self.dir / "ring",
            self.redis,
            self.reward.grpc_addr,
            self.reference.grpc_addr,
            replicas=2,
            stage="ray_grpo",
            n=2,
            train_iters=1_000_000,
            save_interval=2,
            max_staleness=MAX_STALENESS,
        )
        self.faults: list[dict] = []
        self.injected_poison = 0

    # ------------------------------------------------------------------ helpers
    def steps(self) -> int:
        return len(self.ring.metrics())

    def wait_step_after(self, count: int, timeout: float = 240) -> None:
        self.ring.wait_for(lambda: self.steps() > count, timeout, f"a step after fault (had {count})")

    def restart(self, proc: ServiceProc, wait: bool = True) -> ServiceProc:
        new = ServiceProc(
            proc.name,
            proc.config,
            proc.log_path.parent,
            env=proc.env,
            grpc_port=proc.grpc_port,
            http_port=proc.http_port,
        )
        new.start(timeout=180, wait_ready=wait)
        return new

    def kill(self, proc: ServiceProc) -> None:
        self.ring.kill(proc)

    def run_fault(self, name: str) -> None:
        before = self.steps()
        t0 = time.monotonic()
        detail = getattr(self, f"fault_{name}")()
        back = self.steps()
        self.wait_step_after(back)
        self.faults.append({"fault": name, "step": before, "recover_s": round(time.monotonic() - t0, 2), **detail})

    # ------------------------------------------------------------------ faults
    def fault_poison(self) -> dict:
        records = []
        for i, (ids, score, lp) in enumerate(
            [([600, 70000, 2**31 - 1], 1.0, -1.0), ([5, 6], float("nan"), -1.0), ([5, 6], 1.0, float("-inf"))]
        ):
            sample = make_sample(ids, sampling_logprobs=[lp] * len(ids), ref_logprobs=[-1.0] * len(ids), score=score)
            exp = make_experience(f"chaos-poison-{self.injected_poison + i}", [3, 4], [sample], run_id="chaos")
            records.append(exp.SerializeToString())

        async def inject(r):
            for payload in records:
                await r.xadd(RunKeys("chaos").experience, {PAYLOAD_FIELD: payload})

        self.ring.redis_call(inject)
        self.injected_poison += len(records)
        return {"records": len(records)}

    def fault_kill_rollout(self) -> dict:
        victim = self.ring.rollouts[0]
        self.kill(victim)
        self.ring.rollouts[0] = new = self.restart(victim)
        # It comes back serving the initial weights and takes no job before a push brings it up to date (the next
        # regular push, or the trainer's catch-up when none is due); max_staleness shows it.
        return {"waited_for_weights": "waiting for the trainer's push" in new.log_text()}

    def fault_kill_trainer(self) -> dict:
        self.kill(self.ring.trainer)
        self.ring.start_trainer()
        return {}

    def fault_redis_restart(self) -> dict:
        self.redis.stop(kill=True)
        time.sleep(1.0)
        self.redis.start()
        return {}

    def fault_reward_outage(self) -> dict:
        self.reward.signal(9)
        self.reward.wait(10)
        time.sleep(3.0)
        self.reward = self.restart(self.reward)
        return {}

    def fault_kill_reference(self) -> dict:
        self.reference.signal(9)
        self.reference.wait(10)
        self.reference = self.restart(self.reference)
        return {}

    def fault_admin_storm(self) -> dict:
        async def storm():
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(timeout=120) as c:
                calls = [c.post(self.ring.trainer.http_url + "/v1/checkpoint", headers=headers) for _ in range(16)]
                calls += [c.get(self.ring.trainer.http_url + "/v1/status") for _ in range(16)]
                return [r.status_code for r in await asyncio.gather(*calls)]

        codes = asyncio.run(storm())
        return {"calls": len(codes), "ok": sum(c == 200 for c in codes)}

    def fault_slow_clients(self, n: int = 100, hold_s: float = 20.0) -> dict:
        port = self.ring.rollouts[0].http_port
        socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            s.setblocking(False)
            socks.append(s)
        closed_at: list[float] = []
        t0 = time.monotonic()

        def trickle():
            alive = set(range(n))
            while alive and time.monotonic() - t0 < hold_s:
                for i in list(alive):
                    try:
                        socks[i].send(b"X")
                        if socks[i].recv(1024) == b"":
                            raise ConnectionResetError
                    except BlockingIOError:
                        continue
                    except OSError:
                        alive.discard(i)
                        closed_at.append(time.monotonic() - t0)
                time.sleep(1.0)
            for s in socks:
                s.close()

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        thread.join()
        return {
            "connections": n,
            "closed_by_server": len(closed_at),
            "all_closed_s": round(max(closed_at), 1) if len(closed_at) == n else None,
        }

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        for p in (self.reward, self.reference):
            p.wait_ready(180)
        self.ring.start()
        self.ring.wait_steps(1, timeout=240)
        for _ in range(self.rounds):
            for name in FAULTS:
                self.run_fault(name)
        self.finish()
        return self.summary()

    def finish(self) -> None:
        """Two more steps, then pause the trainer, checkpoint (it waits for a step in progress, so the ledger covers
        every step trained) and stop it (SIGTERM, exit 0); the replicas then serve the last pushed version."""
        self.wait_step_after(self.steps() + 1)
        url, headers = self.ring.trainer.http_url, {"Authorization": f"Bearer {TOKEN}"}
        httpx.post(url + "/v1/pause", headers=headers, timeout=30).raise_for_status()
        httpx.post(url + "/v1/checkpoint", headers=headers, timeout=120).raise_for_status()
        code = self.ring.trainer.stop(timeout=60)
        if code != 0:
            raise AssertionError(f"trainer exited with {code} on SIGTERM:\n{self.ring.trainer.log_tail()}")
        version = self.ring.state()["policy_version"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(
            self.ring.served_version(i) != version for i in range(len(self.ring.rollouts))
        ):
            time.sleep(0.2)

    def summary(self) -> dict:
        ring = self.ring
        state = ring.state()
        trained = ring.ledger()
        dropped = set(ring.dropped_stale())
        issued = ring.issued_job_ids()  # without the trained jobs the trainer has forgotten (bounded ledger)

        async def released(r):
            return {k.decode() for k in await r.hkeys(RunKeys("chaos").released_jobs)}

        dead_issued = ring.redis_call(released)
        in_streams = set(ring.stream_job_ids("prompts")) | set(ring.stream_job_ids("experience"))
        metrics = ring.metrics()
        stats = ring.stats()
        staleness = [m["staleness/max"] for m in metrics]
        return {
            "faults_injected": len(self.faults),
            "recovered": sum(1 for f in self.faults if f["recover_s"] is not None),
            "jobs_issued": stats.issued,
            "jobs_trained": len(set(trained)),
            "jobs_trained_twice": len(trained) - len(set(trained)),
            "jobs_lost": len(issued - set(trained) - dropped - in_streams - dead_issued),
            "jobs_dropped_stale": len(dropped),
            "jobs_dead_lettered": len(dead_issued),
            "poison_injected": self.injected_poison,
            "dead_letters": stats.dead_letters,
            "released": stats.released,
            "nonfinite_steps_skipped": int(sum(m.get("nonfinite/skipped_updates", 0) for m in metrics)),
            "max_staleness": max(staleness) if staleness else None,
            "staleness_bound": MAX_STALENESS,
            "steps": state["step"],
            "final_policy_version": state["policy_version"],
            "served_versions": [ring.served_version(i) for i in range(len(ring.rollouts))],
            "faults": self.faults,
        }

    def stop(self) -> None:
        self.ring.stop()
        for p in (self.reward, self.reference):
            p.stop()
        self.redis.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("CHAOS_ROUNDS", 1)), help="fault sequences")
    ap.add_argument("--dir", default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--out", default=None, help="also write the JSON line to this file")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    directory = Path(args.dir or tempfile.mkdtemp(prefix="rlhf-chaos-"))

    cache = Path(os.environ.setdefault("RLHF_CACHE_DIR", str(directory / "cache")))
    build_tiny(cache / "tiny")
    chaos = Chaos(directory, args.rounds)
    try:
        result = chaos.run()
    finally:
        chaos.stop()
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    ok = (
        result["jobs_lost"] == 0
        and result["jobs_trained_twice"] == 0
        and result["recovered"] == result["faults_injected"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
