"""bench.queue: experience records through rlhf.transport vs raw XADD/XREADGROUP of the same bytes, same Redis.

Each record is one Experience (one prompt job's rollout) holding one 1,000-token sample: a 200-token prompt and an
800-token response with its sampling and reference log-probs (protobuf, ~8.5 KB). Three measurements per round,
interleaved so that noise hits all of them alike, against one private redis-server (AOF everysec, as deployed):

- ``experience``: a replica publishes records one by one and the trainer reads them in batches and acknowledges them.
  Ours: ``ExperienceQueue.publish`` (validate + encode + XADD) and ``ExperienceQueue.read`` (XREADGROUP + decode +
  validate) + ``ack``. Raw: XADD of the already-encoded bytes, XREADGROUP, XACK.
- ``ring``: the whole path of one training step's batch: the trainer publishes the prompt jobs
  (``PromptQueue.publish_many``, idempotent + admission Lua), a replica reads the jobs (up to 8 per read, the rollout
  worker's default ``RLHF_ROLLOUT_MAX_INFLIGHT_JOBS``) and writes each one's experience while acknowledging the job
  (``ExperienceQueue.publish_and_ack``, Lua), the trainer reads the batch and acks it.
  Raw: the same commands without the scripts and without protobuf work (XADD, XREADGROUP, XADD + XACK, XREADGROUP,
  XACK of pre-encoded bytes).
- ``replicated``: the ring again on a master with one replica (loopback), interleaved without WAIT and with
  ``wait_replicas=1`` (``WAIT 1`` after each guarantee-bearing write and each experience read, see docs/redis-ha.md),
  the trainer writing its trained count as the service does (``set_trained``): the cost of acknowledged replication.
- a PPO training step of the tiny model (``TrainerEngine.step``, one actor and one critic epoch) on one batch of such
  records, in the same run: the target compares the queue's time per step with it (the tiny model's one-epoch step
  is the shortest real step there is, so the fraction only shrinks for real models and settings).

Target: queue overhead under 1% of a training step's time, judged two ways: the whole queue time per step (as if
the queue cost nothing without rlhf.transport) and the time rlhf.transport adds over raw Redis commands doing the
same work.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

from bench._common import RING_THREADS, RedisServer, build_model, emit, log, median, rnd, side, target
from rlhf.config import parse_config
from rlhf.procs import LocalRedis
from rlhf.transport import Admission, ExperienceQueue, PromptQueue, RunKeys, connect, delete_run, encode
from rlhf.v1 import common_pb2, experience_pb2
from services.trainer.engine import TrainerEngine

PROMPT_TOKENS = 200
RESPONSE_TOKENS = 800
BATCH = 16  # records per training step (configs/demo.yaml: global_batch_size 16)
READ_JOBS = 8  # prompt jobs a replica takes per read: the rollout worker's default RLHF_ROLLOUT_MAX_INFLIGHT_JOBS
ROUNDS = 7
EXP_RECORDS = 128  # per round, experience-only measurement
RING_STEPS = 4  # per round, ring measurement (BATCH records each)
STEP_ROUNDS = 2  # training steps measured (the first step is no slower than the next: no warm-up step)
RUN = "bench"


def make_experience(i: int, vocab: int, rng: random.Random):
    exp = experience_pb2.Experience(
        job_id=f"{RUN}-e0-i{i}",
        run_id=RUN,
        data_index=i,
        prompt_ids=[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)],
        replica_id="replica-0",
        created_at_unix_ms=int(time.time() * 1000),
    )
    s = exp.samples.add(
        response_ids=[rng.randrange(3, vocab) for _ in range(RESPONSE_TOKENS)],
        sampling_logprobs=[-rng.random() * 5 for _ in range(RESPONSE_TOKENS)],
        ref_logprobs=[-rng.random() * 5 for _ in range(RESPONSE_TOKENS)],
        score=rng.random(),
        score_status=common_pb2.ITEM_STATUS_OK,
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        policy_version=0,
    )
    del s
    return exp


def make_job(i: int, vocab: int, rng: random.Random):
    return experience_pb2.PromptJob(
        job_id=f"{RUN}-e0-i{i}",
        run_id=RUN,
        data_index=i,
        prompt_ids=[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)],
        params=common_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=RESPONSE_TOKENS),
    )


# ------------------------------------------------------------------------------------------------- experience only


async def exp_ours(redis, exps) -> float:
    await delete_run(redis, RUN)
    q = ExperienceQueue(redis, RUN)
    await q.ensure_groups()
    t0 = time.perf_counter()
    for e in exps:
        await q.publish(e)
    got = 0
    while got < len(exps):
        recs = await q.read("trainer-0", count=BATCH, block_ms=None)
        await q.ack([r for r, _ in recs])
        got += len(recs)
    return time.perf_counter() - t0


async def exp_raw(redis, payloads) -> float:
    await delete_run(redis, RUN)
    stream = RunKeys(RUN).experience
    await redis.xgroup_create(stream, "trainer", id="0", mkstream=True)
    t0 = time.perf_counter()
    for p in payloads:
        await redis.xadd(stream, {b"pb": p})
    got = 0
    while got < len(payloads):
        resp = await redis.xreadgroup("trainer", "trainer-0", {stream: ">"}, count=BATCH)
        entries = resp[0][1] if isinstance(resp, list) else next(iter(resp.values()))[0]
        await redis.xack(stream, "trainer", *[eid for eid, _ in entries])
        got += len(entries)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------- the ring


async def ring_ours(redis, jobs, exps, absolute: bool = False) -> float:
    await delete_run(redis, RUN)
    pq, eq = PromptQueue(redis, RUN), ExperienceQueue(redis, RUN)
    adm = Admission(redis, RUN, 0, BATCH)
    await pq.ensure_groups()
    await eq.ensure_groups()
    t0 = time.perf_counter()
    for s in range(0, len(jobs), BATCH):
        step_jobs, step_exps = jobs[s : s + BATCH], exps[s : s + BATCH]
        await pq.publish_many(step_jobs, adm)  # trainer
        todo = list(step_exps)
        while todo:  # replica: takes up to READ_JOBS jobs per read, as the worker does, and answers each
            for entry, _job in await pq.read("replica-0", count=READ_JOBS, block_ms=None):
                await eq.publish_and_ack(todo.pop(0), entry)
        got = 0
        while got < len(step_exps):  # trainer
            recs = await eq.read("trainer-0", count=BATCH - got, block_ms=None)
            await eq.ack([r for r, _ in recs])
            got += len(recs)
        if absolute:  # as the trainer service writes it (retry-safe, and WAITed under a wait policy)
            await adm.set_trained(s + len(step_exps))
        else:
            await adm.mark_trained(len(step_exps))
    return time.perf_counter() - t0


async def replicated_rounds(tmp: Path, jobs, exps, log_prefix: str) -> tuple[list[float], list[float]]:
    """The ring on a master with one replica (loopback), without WAIT and with ``wait_replicas=1``, interleaved."""
    fast = ["--repl-diskless-sync-delay", "0"]
    with (
        LocalRedis(tmp / "master", extra_args=fast) as master,
        LocalRedis(tmp / "replica", extra_args=[*fast, "--replicaof", "127.0.0.1", str(master.port)]),
    ):
        plain, waiting = connect(master.url), connect(master.url.replace("/0", "/0?wait_replicas=1"))
        while (await plain.info("replication")).get("connected_slaves", 0) < 1 or "online" not in str(
            (await plain.info("replication")).get("slave0", "")
        ):
            await asyncio.sleep(0.05)
        await ring_ours(plain, jobs[:BATCH], exps[:BATCH], absolute=True)  # warm-up
        await ring_ours(waiting, jobs[:BATCH], exps[:BATCH], absolute=True)
        no_wait, wait1 = [], []
        for r in range(ROUNDS):
            for k in [0, 1] if r % 2 == 0 else [1, 0]:
                (no_wait if k == 0 else wait1).append(await ring_ours(plain if k == 0 else waiting, jobs, exps, True))
            log(
                f"  {log_prefix} round {r + 1}/{ROUNDS}: ring no WAIT {len(jobs) / no_wait[-1]:.0f}/s, "
                f"WAIT 1 {len(jobs) / wait1[-1]:.0f}/s"
            )
        await plain.aclose()
        await waiting.aclose()
    return no_wait, wait1


async def ring_raw(redis, job_payloads, exp_payloads) -> float:
    await delete_run(redis, RUN)
    k = RunKeys(RUN)
    await redis.xgroup_create(k.prompts, "rollout", id="0", mkstream=True)
    await redis.xgroup_create(k.experience, "trainer", id="0", mkstream=True)

    def entries(resp):
        return resp[0][1] if isinstance(resp, list) else next(iter(resp.values()))[0]

    t0 = time.perf_counter()
    for s in range(0, len(job_payloads), BATCH):
        step_jobs, step_exps = job_payloads[s : s + BATCH], exp_payloads[s : s + BATCH]
        async with redis.pipeline(transaction=False) as pipe:
            for p in step_jobs:
                pipe.xadd(k.prompts, {b"pb": p})
            await pipe.execute()
        todo = list(step_exps)
        while todo:
            es = entries(await redis.xreadgroup("rollout", "replica-0", {k.prompts: ">"}, count=READ_JOBS))
            for entry, _ in es:
                async with redis.pipeline(transaction=True) as pipe:
                    pipe.xadd(k.experience, {b"pb": todo.pop(0)})
                    pipe.xack(k.prompts, "rollout", entry)
                    await pipe.execute()
        got = 0
        while got < len(step_exps):
            es = entries(await redis.xreadgroup("trainer", "trainer-0", {k.experience: ">"}, count=BATCH - got))
            await redis.xack(k.experience, "trainer", *[eid for eid, _ in es])
            got += len(es)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------- training step


def make_trainer(policy: Path, critic: Path):
    cfg = parse_config(
        {
            "run_id": RUN,
            "training": {
                "stage": "ray_ppo",
                "global_batch_size": BATCH,
                "seq_length": 1024,
                "lr": 1e-5,
                "device": "cpu",
                "seed": 1,
            },
            "actor_rollout_ref": {
                "actor_rollout": {
                    "load": str(policy),
                    "max_prompt_length": PROMPT_TOKENS,
                    "max_new_tokens": RESPONSE_TOKENS,
                    "ppo_mini_batch_size": 8,
                    "ppo_epochs": 1,
                    "shuffle_minibatch": True,
                },
            },
            "critic": {"load": str(critic), "critic_mini_batch_size": 8, "critic_update_epochs": 1},
            "algorithm": {
                "adv_estimator": "gae",
                "gamma": 1.0,
                "lam": 0.95,
                "kl_ctrl": {"type": "fixed", "kl_coef": 0.01},
            },
        }
    )
    return TrainerEngine(cfg, "cpu")


async def main() -> None:
    started = time.monotonic()

    paths = build_model("tiny", max_position_embeddings=1024)
    vocab = 512
    rng = random.Random(0)
    exps = [make_experience(i, vocab, rng) for i in range(max(EXP_RECORDS, RING_STEPS * BATCH))]
    jobs = [make_job(i, vocab, rng) for i in range(RING_STEPS * BATCH)]
    exp_bytes = [encode(e) for e in exps]
    job_bytes = [encode(j) for j in jobs]
    record_bytes = sum(len(b) for b in exp_bytes) / len(exp_bytes)
    log(f"bench.queue: record {record_bytes:.0f} bytes; building the trainer (tiny PPO, {BATCH} x 1,000 tokens)")
    trainer = make_trainer(paths.policy, paths.reward)

    t_exp_ours, t_exp_raw, t_ring_ours, t_ring_raw, t_step = [], [], [], [], []
    n_ring = RING_STEPS * BATCH
    with tempfile.TemporaryDirectory(prefix="bench-queue-") as tmp, RedisServer(Path(tmp) / "redis") as server:
        redis = connect(server.url)
        # warm-up: connections, script loading, allocator
        await exp_ours(redis, exps[:BATCH])
        await exp_raw(redis, exp_bytes[:BATCH])
        await ring_ours(redis, jobs[:BATCH], exps[:BATCH])
        await ring_raw(redis, job_bytes[:BATCH], exp_bytes[:BATCH])
        for r in range(ROUNDS):
            order = [0, 1, 2, 3] if r % 2 == 0 else [1, 0, 3, 2]
            for k in order:
                if k == 0:
                    t_exp_ours.append(await exp_ours(redis, exps[:EXP_RECORDS]))
                elif k == 1:
                    t_exp_raw.append(await exp_raw(redis, exp_bytes[:EXP_RECORDS]))
                elif k == 2:
                    t_ring_ours.append(await ring_ours(redis, jobs[:n_ring], exps[:n_ring]))
                else:
                    t_ring_raw.append(await ring_raw(redis, job_bytes[:n_ring], exp_bytes[:n_ring]))
            if r < STEP_ROUNDS:
                t0 = time.perf_counter()
                trainer.step(exps[:BATCH])
                t_step.append(time.perf_counter() - t0)
            log(
                f"  round {r + 1}/{ROUNDS}: experience ours {EXP_RECORDS / t_exp_ours[-1]:.0f}/s "
                f"raw {EXP_RECORDS / t_exp_raw[-1]:.0f}/s; ring ours {n_ring / t_ring_ours[-1]:.0f}/s "
                f"raw {n_ring / t_ring_raw[-1]:.0f}/s"
            )
        await redis.aclose()
        t_no_wait, t_wait1 = await replicated_rounds(Path(tmp), jobs[:n_ring], exps[:n_ring], "master+replica")

    exp_ours_rps = EXP_RECORDS / median(t_exp_ours)
    exp_raw_rps = EXP_RECORDS / median(t_exp_raw)
    ring_ours_rps = n_ring / median(t_ring_ours)
    ring_raw_rps = n_ring / median(t_ring_raw)
    step_s = median(t_step)
    per_step_ours = BATCH / ring_ours_rps
    per_step_extra = BATCH / ring_ours_rps - BATCH / ring_raw_rps
    frac = per_step_ours / step_s
    per_step_no_wait = BATCH / (n_ring / median(t_no_wait))
    per_step_wait1 = BATCH / (n_ring / median(t_wait1))
    emit(
        "queue",
        settings={
            "resources": {
                "rlhf_transport": side(RING_THREADS, "this benchmark's process + a private redis-server (1 thread)"),
                "raw_redis": side(RING_THREADS, "the same process and redis-server, interleaved"),
                "training_step": side(RING_THREADS, "in this process, a service process's threads (as `rlhf up`)"),
            },
            "record": f"1 Experience, 1 sample of {PROMPT_TOKENS} prompt + {RESPONSE_TOKENS} response tokens "
            "with sampling and reference log-probs",
            "record_bytes": round(record_bytes),
            "batch_per_step": BATCH,
            "experience_records_per_round": EXP_RECORDS,
            "ring_records_per_round": n_ring,
            "rounds": ROUNDS,
            "redis": "private redis-server on loopback, appendonly yes, appendfsync everysec",
            "replicated": "the ring again on a master with one replica (two more redis-servers on loopback, AOF "
            "everysec), the trainer writing its trained count as the service does (set_trained): no WAIT vs "
            "wait_replicas=1 in RLHF_REDIS_URL (WAIT 1 after each guarantee-bearing write and each experience read)",
            "training_step": "TrainerEngine.step, PPO, tiny model (0.1M params), 16 records x 1,000 tokens, "
            "minibatch 8, 1 actor + 1 critic epoch (the shortest PPO step on this batch), CPU",
        },
        figures={
            "experience_records_per_s": {"rlhf_transport": rnd(exp_ours_rps), "raw_redis": rnd(exp_raw_rps)},
            "experience_MB_per_s": {
                "rlhf_transport": rnd(exp_ours_rps * record_bytes / 1e6),
                "raw_redis": rnd(exp_raw_rps * record_bytes / 1e6),
            },
            "ring_records_per_s": {"rlhf_transport": rnd(ring_ours_rps), "raw_redis": rnd(ring_raw_rps)},
            "queue_ms_per_step": {
                "rlhf_transport": rnd(per_step_ours * 1e3),
                "extra_over_raw": rnd(per_step_extra * 1e3),
            },
            "training_step_s": rnd(step_s),
            "queue_fraction_of_step_pct": rnd(100 * frac),
            "extra_over_raw_fraction_of_step_pct": rnd(100 * per_step_extra / step_s),
            "replicated_queue_ms_per_step": {
                "no_wait": rnd(per_step_no_wait * 1e3),
                "wait_1": rnd(per_step_wait1 * 1e3),
            },
            "replicated_queue_fraction_of_step_pct": {
                "no_wait": rnd(100 * per_step_no_wait / step_s),
                "wait_1": rnd(100 * per_step_wait1 / step_s),
            },
        },
        ratio={
            "experience_ours_vs_raw": rnd(exp_ours_rps / exp_raw_rps),
            "ring_ours_vs_raw": rnd(ring_ours_rps / ring_raw_rps),
            "replicated_ring_wait_1_vs_no_wait": rnd(median(t_no_wait) / median(t_wait1)),
        },
        targets=[
            target(
                "queue time per training step / step time (tiny PPO step), %", rnd(100 * frac), "< 1 %", frac < 0.01
            ),
            target(
                "rlhf.transport time over raw Redis per training step / step time (tiny PPO step), %",
                rnd(100 * per_step_extra / step_s),
                "< 1 %",
                per_step_extra / step_s < 0.01,
            ),
        ],
        notes=[
            "profile (cProfile): most of the per-record cost over raw is the record checks on publish and on read "
            "(min over the token ids, sum over the log-probs of the protobuf repeated fields: ~160 us per 1,000-token "
            "record each way); commit cb5a247 (faster validation) took experience ours/raw from 0.35 to ~0.44",
            "queue time per step: the whole ring of one step's batch through rlhf.transport (publish prompt jobs, "
            "read the jobs, publish_and_ack each experience, read and ack the batch)",
            "the step this compares with got shorter this round (the critic's passes now run alongside the actor's: "
            "2.77 s under load before, ~1.2 s on a quiet machine), so the fraction rose for the same queue time "
            "(14.1 ms -> 16.2 ms per step, replica reading one job at a time); the replica now reads jobs as the "
            "worker does (up to 8 per read) on both sides",
            "replicated rows: a step of the ring makes about 20 WAITs (publish_many, 16 publish_and_ack, the "
            "trainer's read(s), its ack, its trained count); each waits for the replica's acknowledgement on loopback",
        ],
        started=started,
    )


if __name__ == "__main__":
    asyncio.run(main())
