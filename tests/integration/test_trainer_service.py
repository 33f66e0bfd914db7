"""The trainer service against a real redis-server, with the test acting as the rollout replicas.

The test reads the prompt jobs the trainer publishes and answers each with an experience record (real tiny-model
token ids, a rule-like score), exactly as a rollout replica does through rlhf.transport. It checks the trainer's
durability contract: experience is acknowledged only once a checkpoint covers it, a trainer killed mid-run resumes
from its last checkpoint, skips the job ids it had already trained, and publishes its weights under a new version;
so does a 2-process trainer group (torchrun) that loses a rank.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis as sync_redis
import torch
from safetensors.torch import load_file

from rlhf import runlog
from rlhf.checkpoints import latest_checkpoint
from rlhf.transport import ExperienceQueue, PromptQueue, connect, dead_letters, queue_stats
from rlhf.transport.keys import PAYLOAD_FIELD, RunKeys
from rlhf.v1 import common_pb2, experience_pb2
from services.plan import ServiceSpec
from services.trainer.checkpoint import incomplete_reason
from tests.integration._procs import ServiceProc, write_config
from tests.support import make_experience, make_sample

TOKEN = "test-token"


def _config(tmp_path, train_iters: int, save_interval: int) -> dict:
    return {
        "run_id": "ring",
        "training": {
            "stage": "ray_grpo",
            "global_batch_size": 4,
            "train_iters": train_iters,
            "lr": 1e-3,
            "save_interval": save_interval,
            "device": "cpu",
            "max_staleness": 0,
            "save": str(tmp_path / "unused"),
            "max_mismatch_kl": None,  # the fake replicas' sampling log-probs are constants, not the policy's
        },
        "actor_rollout_ref": {
            "actor_rollout": {
                "load": "tiny:policy",
                "n_samples_per_prompt": 2,
                "ppo_mini_batch_size": 8,
                "max_new_tokens": 4,
            }
        },
        "algorithm": {"adv_estimator": "grpo"},
        "reward": {"scorers": [{"type": "rule", "name": "length"}]},
    }


async def _answer_jobs(
    redis_url: str, stop: asyncio.Event, answered: list[str], limit: int | None, mutate=None
) -> None:
    """Play the rollout replicas: each prompt job gets one experience record with n samples (up to ``limit``);
    ``mutate(index, record)`` may change the index-th record before it is written."""
    redis = connect(redis_url)
    prompts, experience = PromptQueue(redis, "ring"), ExperienceQueue(redis, "ring")
    rng = random.Random(0)
    try:
        while not stop.is_set():
            if limit is not None and len(answered) >= limit:
                await asyncio.sleep(0.05)
                continue
            count = 8 if limit is None else limit - len(answered)
            for entry_id, job in await prompts.read("fake-replica", count=count, block_ms=100):
                exp = make_experience(job=job, run_id="ring", replica_id="fake")
                for _ in range(job.params.n):
                    ids = [rng.randint(3, 500) for _ in range(rng.randint(1, job.params.max_tokens))]
                    sample = make_sample(
                        ids,
                        sampling_logprobs=[-6.0] * len(ids),
                        ref_logprobs=[-6.2] * len(ids),
                        score=len(ids) / 4.0,
                        score_components={"length": len(ids) / 4.0},
                        policy_version=job.issued_policy_version,  # what a replica up to date serves
                    )
                    exp.samples.append(sample)
                if mutate is not None:
                    mutate(len(answered), exp)
                written = await experience._publish_ack_script(
                    keys=[experience.keys.prompts, experience.keys.experience],
                    args=["rollout", entry_id, exp.SerializeToString()],
                )  # as publish_and_ack, minus its producer-side checks: a poisoned record must reach the stream
                if written:
                    answered.append(job.job_id)
    finally:
        await redis.aclose()


def _run_with_replicas(
    redis_url: str, until, timeout: float = 120.0, limit: int | None = None, mutate=None, during=None
) -> list[str]:
    """Answer jobs until ``until()``; ``during()`` (a coroutine function) runs alongside once."""
    answered: list[str] = []

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(_answer_jobs(redis_url, stop, answered, limit, mutate))
        side = asyncio.create_task(during()) if during is not None else None
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        stop.set()
        await task
        if side is not None:
            await side

    asyncio.run(main())
    return answered


def _ledger(run_dir) -> list[str]:
    """Every job id trained, from the run's ledger (trained_jobs.jsonl)."""
    path = run_dir / "trained_jobs.jsonl"
    return [j for line in path.read_text().splitlines() for j in json.loads(line)["job_ids"]]


def _metrics(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_trainer_trains_checkpoints_and_acks(redis_server, start_service, tmp_path):
    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    cfg = _config(tmp_path, train_iters=3, save_interval=2)
    cfg["training"]["log_completions_interval"] = 2
    trainer = start_service("trainer", cfg, env=env)
    status = httpx.get(trainer.http_url + "/v1/status").json()
    assert status["stage"] == "ray_grpo" and status["run_id"] == "ring"
    assert httpx.post(trainer.http_url + "/v1/checkpoint").status_code == 401  # admin call without the token

    _run_with_replicas(redis_server.url, lambda: trainer.proc.poll() is not None)
    assert trainer.wait(timeout=30) == 0, trainer.log_tail()
    steps = _metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all("reward/mean" in m and m["samples"] == 8 for m in steps)
    state = json.loads((run_dir / "checkpoints" / "step_3" / "state.json").read_text())
    assert len(_ledger(run_dir)) == 12 and state["policy_version"] == 3
    # Every experience record the steps consumed is acknowledged once the final checkpoint covers it.
    stats = asyncio.run(_stats(redis_server.url))
    assert stats.experience_pending == 0
    # Tracking: TensorBoard scalars of every step, and the completions table of step 2 (log_completions_interval 2).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415 - tensorboard: the plots extra

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("loss/policy")] == pytest.approx([m["loss/policy"] for m in steps])
    rows = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 4 and all(r["reward"] is not None for r in rows)
    (table,) = events.Tensors("completions/text_summary")
    assert table.step == 2 and b"| prompt | response | reward | policy_version |" in table.tensor_proto.string_val[0]


def _trainer_sample(trainer, name: str) -> float:
    text = httpx.get(trainer.http_url + "/metrics").text
    m = re.search(rf'^{name}\{{service="trainer"\}} (\S+)$', text, re.M)
    assert m, f"{name} not on the trainer's /metrics"
    return float(m.group(1))


def _until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert check()


def test_ring_scaling_signals_follow_the_queues(redis_server, start_service, tmp_path):
    """The trainer's /metrics carries the ring's depths (docs/deploy.md#scaling-signals): jobs waiting for a replica,
    jobs a replica holds, jobs admitted against the capacity, and per step its wait for experience."""
    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    trainer = start_service("trainer", _config(tmp_path, train_iters=50, save_interval=50), env=env)
    # max_staleness 0 x global_batch_size 4: four jobs issued, none taken yet
    assert _trainer_sample(trainer, "rlhf_ring_admission_capacity") == 4
    _until(lambda: _trainer_sample(trainer, "rlhf_ring_jobs_waiting") == 4)
    assert _trainer_sample(trainer, "rlhf_ring_jobs_admitted") == 4
    assert _trainer_sample(trainer, "rlhf_ring_jobs_running") == 0
    assert _trainer_sample(trainer, "rlhf_trainer_experience_wait_seconds_count") == 0

    async def take(n: int) -> None:  # the fake replica takes n jobs and holds them (it answers them later)
        redis = connect(redis_server.url)
        try:
            assert len(await PromptQueue(redis, "ring").read("fake-replica", count=n, block_ms=1000)) == n
        finally:
            await redis.aclose()

    asyncio.run(take(3))
    _until(lambda: _trainer_sample(trainer, "rlhf_ring_jobs_running") == 3)
    assert _trainer_sample(trainer, "rlhf_ring_jobs_waiting") == 1
    # the replica answers: steps run, each after a wait for its batch
    _run_with_replicas(redis_server.url, lambda: len(_metrics(run_dir)) >= 2)
    assert _trainer_sample(trainer, "rlhf_trainer_experience_wait_seconds_count") >= 2
    assert _trainer_sample(trainer, "rlhf_trainer_experience_wait_seconds_sum") > 0


async def _stats(url):
    redis = connect(url)
    try:
        return await queue_stats(redis, "ring")
    finally:
        await redis.aclose()


def _two_versions(index: int, exp: experience_pb2.Experience) -> None:
    """Partial rollouts: each sample of two tokens or more was interrupted by a push half-way and went on under the
    next version (version spans; policy_version stays the oldest)."""
    for smp in exp.samples:
        if len(smp.response_ids) >= 2:
            smp.span_starts[:] = [0, len(smp.response_ids) // 2]
            smp.span_versions[:] = [smp.policy_version, smp.policy_version + 1]


def test_killed_trainer_resumes_and_trains_nothing_twice(redis_server, start_service, tmp_path):
    """Also with records whose tokens span two versions (partial rollouts): each is trained exactly once."""
    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    cfg = _config(tmp_path, train_iters=5, save_interval=2)
    trainer = start_service("trainer", cfg, env=env)
    # Answer exactly three batches of jobs, so the trainer stops after step 3 waiting for more.
    _run_with_replicas(redis_server.url, lambda: len(_metrics(run_dir)) >= 3, limit=12, mutate=_two_versions)
    trainer.signal(signal.SIGKILL)  # step 3 trained but not checkpointed: its experience is still unacked
    trainer.wait(timeout=10)
    assert len(_metrics(run_dir)) == 3

    restarted = start_service("trainer", cfg, env=env)
    assert "resumed from" in restarted.log_text()
    _run_with_replicas(redis_server.url, lambda: restarted.proc.poll() is not None, mutate=_two_versions)
    assert restarted.wait(timeout=30) == 0, restarted.log_tail()
    steps = _metrics(run_dir)
    # Step 3 is redone from the step-2 checkpoint, not lost; metrics.jsonl was cut back to step 2 first.
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
    assert "metrics.jsonl cut back to step 2 (1 later line(s) removed)" in restarted.log_text()
    state = json.loads((run_dir / "checkpoints" / "step_5" / "state.json").read_text())
    assert len(_ledger(run_dir)) == len(set(_ledger(run_dir))) == 20
    # The restored weights were published under a new version: 2 (checkpoint) -> 3, then steps 3-5 -> 6.
    assert state["policy_version"] == 6


def _poison(index: int, exp: experience_pb2.Experience) -> None:
    """Records 0-3 are well-formed but poisonous: token ids outside the tiny vocabulary (512), or a NaN score."""
    if index == 0:
        exp.samples[0].response_ids[:3] = [600, 70000, 2**31 - 1]
    elif index == 1:
        exp.prompt_ids.append(512)
    elif index == 2:
        exp.samples[1].score = float("nan")
    elif index == 3:
        exp.samples[0].score = float("inf")


def test_poison_records_are_dead_lettered_and_the_run_goes_on(redis_server, start_service, tmp_path):
    """Each of these records used to end the step (IndexError) or turn every weight into NaN, on every restart."""
    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    trainer = start_service("trainer", _config(tmp_path, train_iters=3, save_interval=1), env=env)

    async def inject_foreign():  # records of jobs this run never issued: dead-lettered, no admission slot released
        redis = connect(redis_server.url)
        try:
            for i in range(5):
                sample = make_sample([9999], sampling_logprobs=[-1.0], ref_logprobs=[-1.0], score=1.0)
                foreign = make_experience(f"foreign-{i}", [1, 2], [sample], run_id="ring")
                await redis.xadd(RunKeys("ring").experience, {PAYLOAD_FIELD: foreign.SerializeToString()})
        finally:
            await redis.aclose()

    answered = _run_with_replicas(
        redis_server.url, lambda: trainer.proc.poll() is not None, mutate=_poison, during=inject_foreign
    )
    assert trainer.wait(timeout=30) == 0, trainer.log_tail()
    steps = _metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["nonfinite/skipped_updates"] == 0 for m in steps)
    poisoned = set(answered[:4])
    assert not poisoned & set(_ledger(run_dir)) and len(_ledger(run_dir)) == 12
    stats = asyncio.run(_stats(redis_server.url))
    assert stats.dead_letters == 9 and stats.experience_pending == 0
    assert stats.released == 4  # the four poisoned jobs this run issued; the five foreign records release nothing

    async def letters():
        redis = connect(redis_server.url)
        try:
            return await dead_letters(redis, "ring")
        finally:
            await redis.aclose()

    reasons = " | ".join(d["reason"] for d in asyncio.run(letters()))
    assert "outside the vocabulary [0, 512)" in reasons and "non-finite score" in reasons
    # The weights stayed finite, and the final policy loads.

    for f in (run_dir / "checkpoints" / "step_3" / "policy").glob("*.safetensors"):
        for name, t in load_file(f).items():
            assert torch.isfinite(t).all(), name


def _absurd(index: int, exp: experience_pb2.Experience) -> None:
    """Records 0-3 hold finite but absurd numbers (issue 46.5): each used to pass the queue's checks, and the first
    two made the step's losses and gradient norm non-finite (the update skipped, the step lost, no record named)."""
    if index == 0:
        exp.samples[0].score = 3e38
    elif index == 1:
        exp.samples[1].ref_logprobs[0] = -3e38
    elif index == 2:
        exp.samples[0].sampling_logprobs[-1] = -3e38
    elif index == 3:
        exp.samples[1].ref_logprobs[-1] = 5.0  # a log-prob above 0: a probability of 148


def test_absurd_scores_and_logprobs_are_dead_lettered_by_field(redis_server, start_service, tmp_path):
    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    cfg = _config(tmp_path, train_iters=3, save_interval=3)
    # PPO: the score is the last token's reward and the KL penalty (k1) every token's, so both reach GAE, the
    # whitened advantages and the critic's loss, where one 3e38 overflows
    cfg["training"]["stage"], cfg["algorithm"] = "ray_ppo", {}
    trainer = start_service("trainer", cfg, env=env)
    answered = _run_with_replicas(redis_server.url, lambda: trainer.proc.poll() is not None, mutate=_absurd)
    assert trainer.wait(timeout=30) == 0, trainer.log_tail()
    steps = _metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["samples"] == 8 for m in steps)
    # every step trained on good records only: no update skipped, losses and gradient norms finite
    assert all(m["nonfinite/skipped_updates"] == 0 for m in steps)
    for m in steps:
        numbers = {k: v for k, v in m.items() if isinstance(v, float)}
        assert all(math.isfinite(v) for v in numbers.values()), numbers
        assert "loss/policy" in numbers and "policy/grad_norm" in numbers
    assert not set(answered[:4]) & set(_ledger(run_dir)) and len(_ledger(run_dir)) == 12

    async def letters():
        redis = connect(redis_server.url)
        try:
            return await dead_letters(redis, "ring")
        finally:
            await redis.aclose()

    reasons = [d["reason"] for d in reversed(asyncio.run(letters()))]
    fields = ["samples[0].score", "samples[1].ref_logprobs[0]", "samples[0].sampling_logprobs[", "ref_logprobs["]
    assert len(reasons) == 4, reasons
    for job_id, field, reason in zip(answered[:4], fields, reasons, strict=True):
        assert f"Experience {job_id!r}" in reason and field in reason, reason
    assert "outside [-1e+06, 1e+06]" in reasons[0] and "outside [-10000, 0.01]" in reasons[1], reasons


def test_trainer_killed_before_its_first_checkpoint_starts_over(redis_server, start_service, tmp_path):
    run_dir = tmp_path / "run"
    # A replica address that refuses connections: each push fails at once, and the version is published anyway.
    env = {
        "RLHF_REDIS_URL": redis_server.url,
        "RLHF_RUN_DIR": str(run_dir),
        "RLHF_API_TOKEN": TOKEN,
        "RLHF_ROLLOUT_ADDRS": "127.0.0.1:1",
    }
    cfg = _config(tmp_path, train_iters=4, save_interval=100)
    trainer = start_service("trainer", cfg, env=env)
    _run_with_replicas(redis_server.url, lambda: len(_metrics(run_dir)) >= 2, limit=8)
    trainer.signal(signal.SIGKILL)  # two versions published, no checkpoint written
    trainer.wait(timeout=10)
    assert not (run_dir / "checkpoints").exists()

    restarted = start_service("trainer", cfg, env=env)  # used to fail: "version 1 is older than the published 2"
    assert "starting over from the initial weights as version 3" in restarted.log_text()
    _run_with_replicas(redis_server.url, lambda: restarted.proc.poll() is not None)
    assert restarted.wait(timeout=30) == 0, restarted.log_tail()
    state = json.loads((run_dir / "checkpoints" / "step_4" / "state.json").read_text())
    # Nothing from the lost life counts: four steps of four distinct jobs, the trained counter set back with them.
    assert len(_ledger(run_dir)) == len(set(_ledger(run_dir))) == 16
    assert state["admission_trained"] == 16 and state["policy_version"] == 7
    assert asyncio.run(_stats(redis_server.url)).experience_pending == 0


def test_concurrent_checkpoint_calls_write_whole_checkpoints(redis_server, start_service, tmp_path):
    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    trainer = start_service("trainer", _config(tmp_path, train_iters=3, save_interval=100), env=env)
    codes: list[int] = []

    async def hammer():
        async with httpx.AsyncClient(timeout=60) as client:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            while len(_metrics(run_dir)) < 2:  # concurrent calls while steps run
                rs = await asyncio.gather(
                    *[client.post(trainer.http_url + "/v1/checkpoint", headers=headers) for _ in range(8)]
                )
                codes.extend(r.status_code for r in rs)
                await asyncio.sleep(0.05)

    _run_with_replicas(redis_server.url, lambda: trainer.proc.poll() is not None, during=hammer)
    assert trainer.wait(timeout=30) == 0, trainer.log_tail()
    assert codes and set(codes) == {200}, codes
    root = run_dir / "checkpoints"
    for step in sorted(root.glob("step_*")):
        assert incomplete_reason(step) is None, step
        state = json.loads((step / "state.json").read_text())
        assert state["step"] == int(step.name.split("_")[1])
    assert not list(root.glob("*.tmp*")) and not list(root.glob("*.old-*"))


def test_a_scorer_failing_on_most_samples_stops_the_run_naming_it(redis_server, start_service, tmp_path):
    """Training on the few samples that still score would be training on another reward, silently: the trainer
    stops (exit 3, not restarted by supervisors) after reward.failed_patience steps, naming the scorer."""

    def fail_most(index: int, exp: experience_pb2.Experience) -> None:
        if index >= 4:  # the first batch scores fine; then the first sample of every record fails, both of 1 in 4
            for s in exp.samples[: 2 if index % 4 == 0 else 1]:
                s.score_status = common_pb2.ITEM_STATUS_SCORER_ERROR
                s.score_error = "scorer 'mine' raised KeyError: 'x'"

    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    cfg = _config(tmp_path, train_iters=10, save_interval=100)
    cfg["reward"].update(max_failed_fraction=0.5, failed_patience=2)
    trainer = start_service("trainer", cfg, env=env)
    _run_with_replicas(redis_server.url, lambda: trainer.proc.poll() is not None, mutate=fail_most)
    assert trainer.wait(timeout=30) == runlog.EXIT_STOPPED_BY_RULE, trainer.log_tail()
    log = trainer.log_text()
    assert "stopping the run: more than 50% of the samples failed scoring for 2 steps in a row" in log
    assert "scorer 'mine' failed" in log and "KeyError" in log
    steps = _metrics(run_dir)
    assert steps[0]["reward/failed_fraction"] == 0.0 and steps[0]["reward/length"] > 0  # per-scorer reward
    assert steps[1]["reward/failed_fraction"] == 0.625  # 5 of 8 samples failed


def test_admission_writes_lost_with_the_last_second_of_aof_heal(redis_server, start_service, tmp_path):
    """Redis acknowledges writes before its AOF is on disk (everysec): a machine crash can take back the last
    second. Here that second held the trainer's last trained count and the 4 jobs it then issued: a synchronous ring
    then has no free slot (so no job, so no step to write the count again) and used to wait forever."""
    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    trainer = start_service("trainer", _config(tmp_path, train_iters=4, save_interval=100), env=env)
    k, r = RunKeys("ring"), sync_redis.Redis.from_url(redis_server.url)
    _run_with_replicas(
        redis_server.url, lambda: len(_metrics(run_dir)) >= 2 and int(r.get(k.issued) or 0) == 12, limit=8
    )
    # The lost second: trained 8 -> 4, and the jobs issued after it (prompt entries, ids, count) never happened.
    newest = r.xrevrange(k.prompts, count=4)
    lost_ids = []
    for entry_id, fields in newest:
        job = experience_pb2.PromptJob.FromString(fields[b"pb"])
        lost_ids.append(job.job_id)
        r.xdel(k.prompts, entry_id)
    r.hdel(k.jobs, *lost_ids)
    r.set(k.issued, 8)
    r.set(k.trained, 4)
    _run_with_replicas(redis_server.url, lambda: trainer.proc.poll() is not None, timeout=90)
    assert trainer.wait(timeout=30) == 0, trainer.log_tail()
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3, 4]
    assert not set(lost_ids) & set(_ledger(run_dir)) and len(_ledger(run_dir)) == 16
    r.close()


def test_the_duplicate_filter_and_the_issued_ids_stay_bounded(redis_server, start_service, tmp_path):
    """A long run must not grow the trainer's memory, its checkpoints or Redis with every job id it ever trained:
    ids are kept for the last two checkpoint windows, the ledger file has them all."""
    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    trainer = start_service("trainer", _config(tmp_path, train_iters=8, save_interval=1), env=env)
    _run_with_replicas(redis_server.url, lambda: trainer.proc.poll() is not None)
    assert trainer.wait(timeout=30) == 0, trainer.log_tail()
    ledger = _ledger(run_dir)
    assert len(ledger) == len(set(ledger)) == 32
    state = json.loads((run_dir / "checkpoints" / "step_8" / "state.json").read_text())
    assert [w[0] for w in state["trained_job_windows"]] == [7, 8]
    assert set(state["trained_job_ids"]) == set(ledger[-8:])  # the jobs of steps 7 and 8 only
    r = sync_redis.Redis.from_url(redis_server.url)
    issued = {k.decode() for k in r.hkeys(RunKeys("ring").jobs)}
    r.close()
    assert not issued & set(ledger[:-8])  # forgotten: trained before the last two checkpoints
    assert set(ledger[-8:]) <= issued


def test_records_staler_than_the_bound_are_dropped_not_trained(redis_server, start_service, tmp_path):
    """Admission bounds the jobs in flight; a record that still arrives too stale (replicas finish out of order, a
    replica fell behind) is consumed without training, its slot freed at once, and listed in the ledger as such."""

    def stale(index: int, exp: experience_pb2.Experience) -> None:
        if 8 <= index < 10:  # two records of the third batch come from weights two steps old
            for s in exp.samples:
                s.policy_version = max(0, s.policy_version - 2)

    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    trainer = start_service("trainer", _config(tmp_path, train_iters=4, save_interval=1), env=env)
    answered = _run_with_replicas(redis_server.url, lambda: trainer.proc.poll() is not None, mutate=stale)
    assert trainer.wait(timeout=30) == 0, trainer.log_tail()
    steps = _metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(m["staleness/max"] == 0 for m in steps)  # max_staleness: 0 held
    assert steps[-1]["staleness/dropped_records_total"] == 2
    dropped = [
        j
        for line in (run_dir / "trained_jobs.jsonl").read_text().splitlines()
        for j in json.loads(line).get("dropped_stale", [])
    ]
    assert sorted(dropped) == sorted(answered[8:10])
    assert not set(dropped) & set(_ledger(run_dir)) and len(_ledger(run_dir)) == 16


def test_weight_sync_and_log_intervals_skip_pushes_and_progress_lines(redis_server, start_service, tmp_path):
    """``weight_sync_interval: 2``: a real rollout replica gets weights after steps 2 and 4 only (two UpdateWeights
    calls, ending at version 4; interval 1 would make four); ``log_interval: 2``: progress lines of steps 2 and 4."""
    run_dir = tmp_path / "run"
    cfg = _config(tmp_path, train_iters=4, save_interval=4)
    cfg["training"].update(weight_sync_interval=2, log_interval=2, max_staleness=1)  # interval 2 needs staleness 1
    rollout = start_service("rollout", cfg, env={"RLHF_API_TOKEN": TOKEN})  # serves weights; takes no jobs
    env = {
        "RLHF_REDIS_URL": redis_server.url,
        "RLHF_RUN_DIR": str(run_dir),
        "RLHF_API_TOKEN": TOKEN,
        "RLHF_ROLLOUT_ADDRS": rollout.grpc_addr,
        "RLHF_WEIGHTS_TRANSPORT": "grpc",
    }
    trainer = start_service("trainer", cfg, env=env)
    _run_with_replicas(redis_server.url, lambda: trainer.proc.poll() is not None)
    assert trainer.wait(timeout=30) == 0, trainer.log_tail()
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3, 4]
    assert httpx.get(rollout.http_url + "/v1/weights/version").json()["version"] == 4
    metrics = httpx.get(rollout.http_url + "/metrics").text
    pushes = [
        line for line in metrics.splitlines() if line.startswith("rlhf_requests_total") and "UpdateWeights" in line
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in pushes) == 2, pushes
    log = trainer.log_text()
    assert "step 2 reward" in log and "step 4 reward" in log, log[-2000:]
    assert "step 1 reward" not in log and "step 3 reward" not in log


class _TrainerGroup(ServiceProc):
    """``rlhf serve trainer`` as a torchrun group of two processes: the command ``rlhf up --trainer-procs 2`` runs."""

    @property
    def argv(self) -> list[str]:
        return ServiceSpec("trainer", "trainer", self.grpc_port, self.http_port, procs=2).argv(self.config)

    def ranks(self) -> dict[int, int]:
        """rank -> pid of torchrun's workers (its children, with RANK in their environment)."""
        out = {}
        for pid in Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((v[5:] for v in env if v.startswith(b"RANK=")), None)
            if rank is not None:
                out[int(rank)] = int(pid)
        return out


@pytest.mark.slow  # ~50 s: a 2-process group, then a restart
def test_a_rank_of_a_trainer_group_killed_mid_run_stops_the_group_and_loses_nothing(
    redis_server, start_service, tmp_path
):
    """A 2-process trainer (torchrun, gloo) whose rank 1 is killed -9 after step 3 (checkpoint at step 2): torchrun
    ends the group with a non-zero exit naming rank 1 and the signal; rank 0 (SIGTERMed) finds its peer gone at its
    checkpoint-on-stop at once, not after the collective timeout. No checkpoint covers step 3 and its experience
    stays unacknowledged; a restart (one process: any checkpoint resumes at any world size) resumes from step 2 and
    the run trains every job exactly once."""
    run_dir = tmp_path / "run"
    env = {"RLHF_REDIS_URL": redis_server.url, "RLHF_RUN_DIR": str(run_dir), "RLHF_API_TOKEN": TOKEN}
    cfg = _config(tmp_path, train_iters=4, save_interval=2)
    cfg["training"]["collective_timeout_s"] = 30  # a collective left waiting on the dead rank would fail after this
    config = write_config(tmp_path / "group.yaml", cfg)
    group = _TrainerGroup("trainer", config, tmp_path / "logs", env={**env, "OMP_NUM_THREADS": "1"})
    t0 = time.monotonic()
    try:
        group.start(timeout=120)
        _run_with_replicas(redis_server.url, lambda: len(_metrics(run_dir)) >= 3, limit=12)  # 3 batches, no more
        ranks = group.ranks()
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        rc = group.wait(timeout=60)
        stopped_s = time.monotonic() - killed
    finally:
        group.stop()
    log = group.log_text()
    assert rc != 0 and stopped_s < 30, (rc, stopped_s, log[-3000:])
    assert "ChildFailedError" in log and re.search(r"rank\s*:\s*1\b", log) and "Signal 9 (SIGKILL)" in log, log[-3000:]
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_2"  # step 3 lacks rank 1's shards: not saved
    assert asyncio.run(_stats(redis_server.url)).experience_pending == 4  # step 3's records, for the restart
    print(f"rank 1 killed after step 3: the group exited {rc} {stopped_s:.1f} s later ({killed - t0:.1f} s to step 3)")

    restarted = start_service("trainer", cfg, env=env)
    assert "resumed from" in restarted.log_text() and "step_2" in restarted.log_text()
    _run_with_replicas(redis_server.url, lambda: restarted.proc.poll() is not None)
    assert restarted.wait(timeout=30) == 0, restarted.log_tail()
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3, 4]
    assert len(_ledger(run_dir)) == len(set(_ledger(run_dir))) == 16
    assert asyncio.run(_stats(redis_server.url)).experience_pending == 0
