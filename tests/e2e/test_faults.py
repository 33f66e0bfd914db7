"""Faults during a real training run: the trainer killed -9 and restarted, one of two rollout replicas killed -9
mid-generation, redis-server killed -9 and restarted on its AOF, the reward service down for a while. In each the
run must finish with every job trained exactly once and nothing lost (see _ring.assert_ledger).

Each test runs its own ring (its own run id: Redis keys, rollout replicas, trainer) on the hf engine; the reward and
reference services are the session's, except where a test stops one.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import redis as sync_redis

from rlhf.transport.keys import ROLLOUT_GROUP, RunKeys
from tests.e2e._ring import assert_ledger, respawn_on_port_clash, start_reward
from tests.integration._procs import ServiceProc

pytestmark = pytest.mark.slow


# name -> ring options. Every ring's rollout replicas are started together when the module starts (their start-up
# overlaps); each test then starts its trainer and applies its fault.
RINGS = {
    "kill-trainer": {"stage": "ray_grpo", "n": 2, "train_iters": 5, "save_interval": 2},
    # Longer responses and two jobs at a time keep replica 0 busy generating when it is killed.
    "kill-rollout": {
        "stage": "ray_ppo",
        "replicas": 2,
        "train_iters": 4,
        "max_new_tokens": 48,
        "rollout_env": {"RLHF_ROLLOUT_MAX_INFLIGHT_JOBS": "2"},
    },
    "redis-restart": {"stage": "ray_grpo", "n": 2, "train_iters": 12},
    "reward-down": {"stage": "ray_grpo", "n": 2, "train_iters": 6},
}


@pytest.fixture(scope="module")
def rings(module_rings):
    base = module_rings.dir
    own_redis = module_rings.redis("own-redis")  # the one redis-restart kills
    out: dict = {"redis": own_redis}
    for name, opts in RINGS.items():
        out[name] = module_rings(f"e2e-{name}", redis=own_redis if name == "redis-restart" else None, **opts)
    own_reward_cfg = base / "reward-down-reward.yaml"
    own_reward_cfg.write_text(out["reward-down"].config_path.read_text())
    out["reward"] = start_reward(own_reward_cfg, base / "logs", wait=False)  # the one reward-down stops
    try:
        out["reward"] = respawn_on_port_clash(out["reward"], 180)
        out["reward-down"].rollouts[0].env["RLHF_REWARD_ADDR"] = out["reward"].grpc_addr
        for name in RINGS:
            for r in out[name].rollouts:
                r.start(wait_ready=False)
        yield out
    finally:
        out["reward"].stop()  # the one running now: test_reward_down... restarts it


def test_trainer_killed_and_restarted_loses_nothing_and_trains_nothing_twice(rings):
    ring = rings["kill-trainer"].start()
    ring.wait_steps(3)
    ring.kill(ring.trainer)  # after step 3, before (or while) step 4: the step-2 checkpoint is the newest
    killed_at = len(ring.metrics())
    assert killed_at < ring.train_iters

    restarted = ring.start_trainer()
    ring.wait_trained()
    assert "resumed from" in restarted.log_text()
    state = assert_ledger(ring, ring.train_iters)
    steps = [int(m["step"]) for m in ring.metrics()]
    assert steps[:killed_at] == list(range(1, killed_at + 1)) and steps[-1] == ring.train_iters
    # Versions never go backwards: the restored weights went out under a new version, which the replica serves.
    assert state["policy_version"] > ring.train_iters
    assert ring.served_version() == state["policy_version"]


def test_rollout_replica_killed_mid_generation_its_jobs_are_finished_by_the_other(rings):
    ring = rings["kill-rollout"].start(trainer=False)
    victim = ring.rollouts[0]
    consumer = f"{ring.run_id}-rollout-0"
    r = sync_redis.Redis.from_url(ring.redis.url)
    stream = RunKeys(ring.run_id).prompts
    ring.start_trainer()
    held: list = []
    deadline = time.monotonic() + 60
    while not held and time.monotonic() < deadline:  # the moment replica 0 holds jobs it has not finished
        with contextlib.suppress(sync_redis.ResponseError):  # the group does not exist yet
            held = r.xpending_range(stream, ROLLOUT_GROUP, min="-", max="+", count=100, consumername=consumer)
        if not held:
            time.sleep(0.005)
    assert held, "replica 0 never took a job"
    ring.kill(victim)
    held_entries = {h["message_id"].decode() for h in held}
    # job id -> prompt entry, read now: the trainer forgets the ids of jobs trained a few checkpoints ago
    jobs = _issued_entries(r, ring.run_id)

    ring.wait_trained(timeout=180)
    state = assert_ledger(ring, ring.train_iters)
    # The jobs replica 0 held were taken over by replica 1 (the sync ring cannot finish a step without them).
    held_jobs = {job_id for job_id, entry in jobs.items() if entry in held_entries}
    assert held_jobs and held_jobs <= set(ring.ledger()), (held_jobs, held_entries)
    still_held = r.xpending_range(stream, ROLLOUT_GROUP, min="-", max="+", count=100, consumername=consumer)
    assert not still_held
    assert "reclaimed" in ring.rollouts[1].log_text()
    assert ring.served_version(1) == state["policy_version"]
    r.close()


def _issued_entries(r, run_id: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(RunKeys(run_id).jobs).items()}


def test_redis_restart_mid_run_every_service_reconnects_and_nothing_is_lost(rings):
    redis = rings["redis"]
    ring = rings["redis-restart"].start()
    ring.wait_steps(2)
    # kill -9 while the ring is writing. With appendfsync everysec nothing Redis had written to its AOF is lost
    # by a process kill (the kernel has it; only a machine crash loses the last second), so a sleep first would
    # not change anything here: the ring never stops writing. A redone write is harmless (job ids dedupe).
    redis.stop(kill=True)
    killed_at = len(ring.metrics())
    time.sleep(2.0)  # every service sees the connection refused for a while
    redis.start()
    ring.wait_trained(timeout=180)
    assert killed_at < ring.train_iters, "training finished before Redis went down"
    assert_ledger(ring, ring.train_iters)
    assert ring.served_version() == ring.state()["policy_version"]
    # Both sides met the outage and got over it.
    assert "redis unavailable" in ring.trainer.log_text()
    assert "queue error" in ring.rollouts[0].log_text()


def test_reward_down_for_a_while_samples_wait_and_no_score_is_invented(rings):
    ring = rings["reward-down"]
    reward = rings["reward"]
    ring.start()
    ring.wait_steps(1)
    reward.stop()  # SIGTERM: gone until restarted
    time.sleep(4.0)
    reward = ServiceProc(
        "reward",
        reward.config,
        reward.log_path.parent,
        env=reward.env,
        grpc_port=reward.grpc_port,
        http_port=reward.http_port,
    ).start(timeout=120)
    rings["reward"] = reward
    back_at = len(ring.metrics())
    ring.wait_trained(timeout=180)
    # Without scores no experience is written: training stalls (at most the batch already queued is trained).
    assert back_at < ring.train_iters, "training finished while the reward service was down"
    assert_ledger(ring, ring.train_iters)
    # Jobs did meet the outage (they failed and stayed pending) ...
    log = ring.rollouts[0].log_text()
    assert "reward_unavailable" in log or "reward call failed" in log, ring.rollouts[0].log_tail()
    # ... and no score was made up: every trained sample was scored OK by the reward service (a sample without
    # an OK score is never trained, so a step with one would count fewer samples).
    n = ring.cfg["actor_rollout_ref"]["actor_rollout"]["n_samples_per_prompt"]
    assert all(m["samples"] == ring.batch * n for m in ring.metrics())
    assert len(ring.ledger()) == ring.train_iters * ring.batch
