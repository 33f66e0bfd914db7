"""Rollout worker mode (services/rollout/worker.py) against real parts: a private redis-server, the reward and
reference services as subprocesses, and a real causal LM for generation (the ``hf`` rollout engine when it exists,
else a small transformers engine on the same EngineBase, defined here).

Shows: N prompt jobs in -> N experience records out (n samples each, log-probs aligned, reference log-probs, OK
scores, policy version), every job acked; reward down -> jobs stay pending, no experience; a worker that dies
mid-job -> another reclaims the job after the idle timeout and the experience is written once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf.models import load_causal_lm, load_tokenizer
from rlhf.procs import free_port as _free_port
from rlhf.serving import ServiceMetrics, ServiceSettings
from rlhf.transport import ExperienceQueue, PromptQueue, connect, dead_letters, queue_stats
from rlhf.v1 import common_pb2, experience_pb2
from services.rollout.engine import EngineBase
from services.rollout.engine_types import EngineHooks, PromptResult, Sample
from services.rollout.hf_engine import HFEngine
from services.rollout.options import SamplingOptions
from services.rollout.swap import read_checkpoint_manifest
from services.rollout.worker import RolloutWorker, maybe_start_worker
from tests.integration._procs import ServiceProc, write_config
from tests.support import make_prompt_job

RUN = "worker-test"
MAX_TOKENS = 6


# ------------------------------------------------------------------------------------------------------ engine


class _TinyEngine(EngineBase):
    """A real transformers policy, sampled token by token (no KV cache: the tiny model makes that cheap). Same
    conventions as the engines: seed + j per sample, log_softmax(logits / T) at the drawn token, EOS included."""

    kind = "hf-test"

    def __init__(self, path: Path):
        super().__init__(path, "tiny:policy")
        self._lock = threading.Lock()
        self.calls = 0

    async def start(self) -> None:
        self._tokenizer = load_tokenizer(self.model_path)
        self._model = load_causal_lm(self.model_path).eval()
        self._manifest = read_checkpoint_manifest(self.model_path)
        self._mark_loaded()

    async def _generate(self, prompts: list[list[int]], params: SamplingOptions, version: int) -> list[PromptResult]:
        self.calls += 1
        return await asyncio.to_thread(self._generate_sync, prompts, params, version)

    def _generate_sync(self, prompts, params, version):
        out = []
        with self._lock, torch.no_grad():
            for p in prompts:
                samples = []
                for j in range(params.n):
                    gen = torch.Generator().manual_seed((params.seed or 0) + j)
                    ids, lps, reason = list(p), [], "length"
                    for _ in range(params.max_tokens):
                        logits = self._model(torch.tensor([ids])).logits[0, -1].float()
                        t = 1.0 if params.greedy else params.temperature
                        logp = torch.log_softmax(logits / t, -1)
                        tok = (
                            int(logp.argmax())
                            if params.greedy
                            else int(torch.multinomial(logp.exp(), 1, generator=gen))
                        )
                        ids.append(tok)
                        lps.append(float(logp[tok]))
                        if tok == self.eos_token_id and not params.ignore_eos:
                            reason = "stop"
                            break
                    resp = ids[len(p) :]
                    text = self._tokenizer.decode(resp, skip_special_tokens=True)
                    samples.append(Sample(resp, lps, reason, text, version))
                out.append(PromptResult(list(p), samples))
        return out


def _make_engine(path: Path) -> EngineBase:
    try:
        from services.rollout.hf_engine import HFEngine  # noqa: PLC0415 - the service's own engine where it imports, else the stand-in
    except ImportError:
        return _TinyEngine(path)
    return HFEngine(path, model_name="tiny:policy", dtype="float32", device="cpu")


class _Hang:
    """Wraps an engine; generate() blocks until released (a replica stuck or dying mid-job)."""

    def __init__(self, engine):
        self._e = engine
        self.entered = asyncio.Event()

    def __getattr__(self, name):
        return getattr(self._e, name)

    async def generate(self, prompts, params):
        self.entered.set()
        await asyncio.Event().wait()


# ------------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def services(tiny_models, tmp_path_factory):
    """Reward (rule scorer ``length``) and reference services as real processes, shared by this module."""
    d = tmp_path_factory.mktemp("worker-services")
    cfg = write_config(
        d / "cfg.yaml",
        {
            "run_id": RUN,
            "actor_rollout_ref": {"actor_rollout": {"load": "tiny:policy", "engine": "hf"}},
            "reward": {
                "scorers": [
                    {"type": "rule", "name": "length", "kwargs": {"target": 4}},
                    {"type": "rule", "name": "exact_match", "weight": 0.0},
                ]
            },  # needs a label
        },
    )
    env = {"RLHF_CACHE_DIR": os.environ["RLHF_CACHE_DIR"], "RLHF_DEVICE": "cpu"}
    procs = [ServiceProc(n, cfg, d / "logs", env=env) for n in ("reward", "reference")]
    for p in procs:
        p.start(wait_ready=False)
    try:
        for p in procs:
            p.wait_ready(120)
        yield {p.name: p for p in procs}
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def engine(tiny_models):
    """Built here, started inside each test's event loop (engines may hold loop-bound state)."""
    return _make_engine(Path(os.environ["RLHF_CACHE_DIR"]) / "tiny" / "policy")


def _jobs(n: int, tok, prefix: str = "j") -> list[experience_pb2.PromptJob]:
    jobs = []
    for i in range(n):
        text = f"What is {i} plus {i + 1}?"
        job = make_prompt_job(
            f"{prefix}{i}", run_id=RUN, data_index=i, epoch=1, issued_policy_version=0, label=str(2 * i + 1)
        )
        job.params.CopyFrom(common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=100 + i))
        if i % 3 == 2:
            job.prompt_text = text  # text only: the worker tokenizes
        else:
            job.prompt_ids.extend(tok.encode(text))  # ids only: the worker decodes the text for the scorer
        jobs.append(job)
    return jobs


def _worker(engine, redis_server, services, replica="r0", **kw) -> RolloutWorker:
    kw.setdefault("reward_addr", services["reward"].grpc_addr)
    kw.setdefault("reference_addr", services["reference"].grpc_addr)
    return RolloutWorker(
        engine, redis_url=redis_server.url, run_id=RUN, replica_id=replica, **{"block_ms": 100, "drain_s": 5.0, **kw}
    )


async def _read_experience(eq: ExperienceQueue, n: int, timeout: float) -> list[tuple[str, experience_pb2.Experience]]:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += await eq.read("trainer-0", count=64, block_ms=200)
    return out


async def _stop(worker: RolloutWorker, task: asyncio.Task) -> None:
    worker.stop()
    await asyncio.wait_for(task, 30)


# ------------------------------------------------------------------------------------------------------ tests


def test_jobs_in_experience_out(engine, services, redis_server):
    n_jobs = 12

    async def body():
        await engine.start()
        redis = connect(redis_server.url)
        pq, eq = PromptQueue(redis, RUN), ExperienceQueue(redis, RUN)
        jobs = _jobs(n_jobs, engine.tokenizer)
        assert all(r.published for r in await pq.publish_many(jobs))
        worker = _worker(engine, redis_server, services, max_inflight_jobs=4)
        t0 = time.perf_counter()
        task = asyncio.create_task(worker.run())
        records = await _read_experience(eq, n_jobs, 60)
        elapsed = time.perf_counter() - t0
        await _stop(worker, task)

        assert len(records) == n_jobs
        by_id = {e.job_id: e for _, e in records}
        assert set(by_id) == {j.job_id for j in jobs}
        for job in jobs:
            e = by_id[job.job_id]
            assert (e.run_id, e.data_index, e.epoch, e.replica_id) == (RUN, job.data_index, 1, "r0")
            assert e.label == job.label and e.issued_policy_version == 0 and e.created_at_unix_ms > 0
            assert e.prompt_ids and e.prompt_text
            if job.prompt_text:
                assert e.prompt_text == job.prompt_text and list(e.prompt_ids) == engine.tokenizer.encode(
                    job.prompt_text
                )
            else:
                assert list(e.prompt_ids) == list(job.prompt_ids)
            assert len(e.samples) == 2
            for s in e.samples:
                n = len(s.response_ids)
                assert 1 <= n <= MAX_TOKENS
                assert len(s.sampling_logprobs) == n and len(s.ref_logprobs) == n
                assert all(math.isfinite(x) and x <= 0 for x in [*s.sampling_logprobs, *s.ref_logprobs])
                # same weights, same temperature: the reference agrees with the sampler token by token
                assert max(abs(a - b) for a, b in zip(s.sampling_logprobs, s.ref_logprobs, strict=True)) < 1e-3
                assert s.score_status == common_pb2.ITEM_STATUS_OK and 0 < s.score <= 1
                assert s.policy_version == engine.weights_version == 0
                assert s.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
                assert s.response_text == engine.tokenizer.decode(list(s.response_ids), skip_special_tokens=True)
        stats = await queue_stats(redis, RUN)
        assert (stats.prompts_pending, stats.prompts_backlog, stats.dead_letters) == (0, 0, 0)
        assert worker.stats.processed == n_jobs and not worker.stats.failed
        print(f"\nrollout worker: {n_jobs} jobs x 2 samples in {elapsed:.2f}s = {n_jobs / elapsed:.1f} jobs/s")
        await redis.aclose()

    asyncio.run(body())


def test_reward_down_leaves_jobs_pending_until_it_is_back(engine, services, redis_server):
    async def body():
        await engine.start()
        redis = connect(redis_server.url)
        pq = PromptQueue(redis, RUN)
        await pq.publish_many(_jobs(3, engine.tokenizer))
        worker = _worker(
            engine,
            redis_server,
            services,
            reward_addr=f"127.0.0.1:{_free_port()}",
            rpc_retries=2,
            rpc_backoff_s=0.05,
            rpc_timeout_s=2.0,
            reclaim_idle_s=600,
        )
        task = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 30
        while sum(worker.stats.failed.values()) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await _stop(worker, task)
        assert worker.stats.failed == {"reward_unavailable": 3} and worker.stats.processed == 0
        stats = await queue_stats(redis, RUN)
        assert stats.experience_length == 0  # no experience with made-up scores
        assert (stats.prompts_pending, stats.prompts_backlog, stats.dead_letters) == (3, 0, 0)

        # reward is back; the replica restarts under its name and finishes its own pending jobs first
        worker = _worker(engine, redis_server, services, reclaim_idle_s=600)
        task = asyncio.create_task(worker.run())
        records = await _read_experience(ExperienceQueue(redis, RUN), 3, 30)
        await _stop(worker, task)
        assert len({e.job_id for _, e in records}) == len(records) == 3 and worker.stats.reclaimed == 0
        assert all(s.score_status == common_pb2.ITEM_STATUS_OK for _, e in records for s in e.samples)
        assert (await queue_stats(redis, RUN)).prompts_pending == 0
        await redis.aclose()

    asyncio.run(body())


def test_dead_worker_job_is_reclaimed_and_written_once(engine, services, redis_server):
    async def body():
        await engine.start()
        redis = connect(redis_server.url)
        pq, eq = PromptQueue(redis, RUN), ExperienceQueue(redis, RUN)
        (job,) = _jobs(1, engine.tokenizer)
        entry_id = (await pq.publish(job)).entry_id
        hung = _Hang(engine)
        dead = _worker(hung, redis_server, services, replica="dying", drain_s=0.0, reclaim_idle_s=600)
        dead_task = asyncio.create_task(dead.run())
        await asyncio.wait_for(hung.entered.wait(), 10)
        dead_task.cancel()  # the replica dies mid-job: its job stays pending under its name
        with contextlib.suppress(asyncio.CancelledError):
            await dead_task
        assert (await queue_stats(redis, RUN)).prompts_pending == 1

        t0 = time.monotonic()
        worker = _worker(engine, redis_server, services, replica="survivor", reclaim_idle_s=1.0, reclaim_interval_s=0.2)
        task = asyncio.create_task(worker.run())
        records = await _read_experience(eq, 1, 20)
        took = time.monotonic() - t0
        await _stop(worker, task)
        assert len(records) == 1 and records[0][1].job_id == job.job_id
        assert records[0][1].replica_id == "survivor" and worker.stats.reclaimed == 1
        assert took >= 0.5  # it waited for the idle timeout (the job was idle ~0s when the survivor started)
        stats = await queue_stats(redis, RUN)
        assert (stats.prompts_pending, stats.experience_length) == (0, 1)
        # the dead replica coming back late with a result writes nothing: the job is no longer pending
        assert await eq.publish_and_ack(records[0][1], entry_id) is None
        assert await eq.length() == 1
        await redis.aclose()

    asyncio.run(body())


class _Gate:
    """Wraps an engine; generate() waits until ``release`` is set, then generates (jobs held in flight)."""

    def __init__(self, engine):
        self._e = engine
        self.entered = 0
        self.release = asyncio.Event()

    def __getattr__(self, name):
        return getattr(self._e, name)

    async def generate(self, prompts, params):
        self.entered += 1
        await self.release.wait()
        return await self._e.generate(prompts, params)


def test_a_leaving_replica_reads_nothing_more_and_finishes_its_jobs_in_flight(engine, services, redis_server):
    """Scale-in (SIGTERM -> stop()): the replica stops reading at once, finishes the jobs it holds, and leaves the
    rest undelivered for the replicas that stay."""

    async def body():
        await engine.start()
        redis = connect(redis_server.url)
        pq, eq = PromptQueue(redis, RUN), ExperienceQueue(redis, RUN)
        for job in _jobs(6, engine.tokenizer, prefix="leave"):
            await pq.publish(job)
        gate = _Gate(engine)
        worker = _worker(gate, redis_server, services, replica="leaving", max_inflight_jobs=2, drain_s=30.0)
        task = asyncio.create_task(worker.run())
        while gate.entered < 2:
            await asyncio.sleep(0.02)
        worker.stop()
        await asyncio.sleep(0.3)  # a worker still reading would take more jobs here
        gate.release.set()
        await asyncio.wait_for(task, 30)
        stats = await queue_stats(redis, RUN)
        assert worker.stats.processed == 2 and worker.stats.handed_back == 0
        assert (stats.experience_length, stats.prompts_pending, stats.prompts_backlog) == (2, 0, 4)
        assert gate.entered == 2
        assert len(await _read_experience(eq, 2, 5)) == 2
        await redis.aclose()

    asyncio.run(body())


def test_jobs_unfinished_when_the_drain_ends_are_handed_back_not_left_idle(engine, services, redis_server):
    """A drain that runs out (a job stuck past the grace period) hands its jobs back: another replica's next
    reclaim pass takes them, long before the idle timeout (600 s here) would."""

    async def body():
        await engine.start()
        redis = connect(redis_server.url)
        pq, eq = PromptQueue(redis, RUN), ExperienceQueue(redis, RUN)
        jobs = _jobs(2, engine.tokenizer, prefix="handback")
        for job in jobs:
            await pq.publish(job)
        hung = _Hang(engine)
        leaving = _worker(hung, redis_server, services, replica="leaving", drain_s=0.5, reclaim_idle_s=600)
        task = asyncio.create_task(leaving.run())
        await asyncio.wait_for(hung.entered.wait(), 10)
        await asyncio.sleep(0.2)
        assert (await queue_stats(redis, RUN)).prompts_pending == 2
        leaving.stop()
        await asyncio.wait_for(task, 10)
        assert leaving.stats.handed_back == 2 and leaving.stats.processed == 0

        t0 = time.monotonic()
        stays = _worker(engine, redis_server, services, replica="stays", reclaim_idle_s=600, reclaim_interval_s=0.2)
        stays_task = asyncio.create_task(stays.run())
        records = await _read_experience(eq, 2, 30)
        took = time.monotonic() - t0
        await _stop(stays, stays_task)
        assert sorted(r[1].job_id for r in records) == sorted(j.job_id for j in jobs)
        assert {r[1].replica_id for r in records} == {"stays"} and stays.stats.reclaimed == 2
        assert took < 30
        # handed back, not re-delivered: the hand-back itself is not counted against max_deliveries
        assert (await queue_stats(redis, RUN)).dead_letters == 0
        await redis.aclose()

    asyncio.run(body())


def test_service_hook_scorer_errors_kept_and_invalid_jobs_dead_lettered(engine, services, redis_server):
    """The hook main.py uses (settings + RLHF_ROLLOUT_* env); a scorer's per-item error stays in the sample's
    score_status; a job the engine refuses as invalid is dead-lettered at once (it could never succeed)."""

    async def body():
        await engine.start()
        redis = connect(redis_server.url)
        pq, eq = PromptQueue(redis, RUN), ExperienceQueue(redis, RUN)
        no_label, too_long, ok = _jobs(3, engine.tokenizer)
        no_label.ClearField("label")
        too_long.params.max_tokens = 10**6
        await pq.publish_many([no_label, too_long, ok])
        assert maybe_start_worker(engine, ServiceSettings()) is None  # no RLHF_REDIS_URL: no worker mode
        settings = ServiceSettings(
            redis_url=redis_server.url,
            run_id=RUN,
            replica_id="hooked",
            reward_addr=services["reward"].grpc_addr,
            reference_addr=services["reference"].grpc_addr,
        )
        metrics = ServiceMetrics("rollout")
        worker = maybe_start_worker(engine, settings, metrics=metrics, env={"RLHF_ROLLOUT_MAX_INFLIGHT_JOBS": "2"})
        assert worker is not None and worker.max_inflight_jobs == 2 and worker.replica_id == "hooked"
        records = await _read_experience(eq, 2, 30)
        deadline = time.monotonic() + 10
        while worker.stats.dead_lettered < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await worker.aclose()
        assert not worker.running

        by_id = {e.job_id: e for _, e in records}
        assert set(by_id) == {no_label.job_id, ok.job_id}
        for s in by_id[no_label.job_id].samples:
            assert s.score_status == common_pb2.ITEM_STATUS_INVALID_INPUT and "label" in s.score_error
        assert all(s.score_status == common_pb2.ITEM_STATUS_OK for s in by_id[ok.job_id].samples)
        (dead,) = await dead_letters(redis, RUN)
        assert "max_tokens" in dead["reason"] and "hooked" in dead["reason"]
        stats = await queue_stats(redis, RUN)
        assert (stats.prompts_pending, stats.dead_letters, stats.released) == (0, 1, 1)
        text = metrics.render()[0].decode()
        assert 'kind="rollout_job_invalid_argument"' in text and 'method="RolloutJob"' in text
        await redis.aclose()

    asyncio.run(body())


def test_jobs_in_flight_and_slots_follow_the_replica(engine, services, redis_server):
    """rlhf_rollout_jobs_in_flight counts the jobs this replica holds, up to rlhf_rollout_job_slots; the jobs it
    has no slot for wait in the stream (the ring's rlhf_ring_jobs_waiting, docs/deploy.md#scaling-signals)."""

    async def body():
        await engine.start()
        gate, real = asyncio.Event(), engine._generate

        async def held(*args, **kw):
            await gate.wait()
            return await real(*args, **kw)

        engine._generate = held
        redis = connect(redis_server.url)
        await PromptQueue(redis, RUN).publish_many(_jobs(3, engine.tokenizer))
        metrics = ServiceMetrics("rollout")
        worker = _worker(engine, redis_server, services, metrics=metrics, max_inflight_jobs=2)

        def sample(name: str) -> float | None:
            return metrics.registry.get_sample_value(name, {"service": "rollout"})

        assert (sample("rlhf_rollout_jobs_in_flight"), sample("rlhf_rollout_job_slots")) == (0, 2)
        task = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 30
        while sample("rlhf_rollout_jobs_in_flight") < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert sample("rlhf_rollout_jobs_in_flight") == 2
        stats = await queue_stats(redis, RUN)
        assert (stats.prompts_pending, stats.prompts_backlog) == (2, 1)
        gate.set()
        assert len(await _read_experience(ExperienceQueue(redis, RUN), 3, 60)) == 3
        while sample("rlhf_rollout_jobs_in_flight") > 0 and time.monotonic() < deadline + 30:
            await asyncio.sleep(0.02)
        assert sample("rlhf_rollout_jobs_in_flight") == 0
        await _stop(worker, task)
        await redis.aclose()

    asyncio.run(body())


def test_rollout_service_in_worker_mode(services, redis_server, tmp_path, tiny_models):
    """The real rollout service process with RLHF_REDIS_URL set runs the worker next to its servers."""
    tok = load_tokenizer(Path(os.environ["RLHF_CACHE_DIR"]) / "tiny" / "policy")
    cfg = write_config(
        tmp_path / "rollout.yaml",
        {"run_id": RUN, "actor_rollout_ref": {"actor_rollout": {"load": "tiny:policy", "engine": "hf"}}},
    )
    env = {
        "RLHF_REDIS_URL": redis_server.url,
        "RLHF_REPLICA_ID": "svc-0",
        "RLHF_DEVICE": "cpu",
        "RLHF_REWARD_ADDR": services["reward"].grpc_addr,
        "RLHF_REFERENCE_ADDR": services["reference"].grpc_addr,
        "RLHF_ROLLOUT_ENGINE": "hf",
        "RLHF_ROLLOUT_MAX_INFLIGHT_JOBS": "4",
        "RLHF_SHUTDOWN_GRACE_S": "5",
    }
    svc = ServiceProc("rollout", cfg, tmp_path / "logs", env=env).start(timeout=120)
    try:

        async def body():
            redis = connect(redis_server.url)
            await PromptQueue(redis, RUN).publish_many(_jobs(4, tok))
            records = await _read_experience(ExperienceQueue(redis, RUN), 4, 60)
            stats = await queue_stats(redis, RUN)
            await redis.aclose()
            return records, stats

        records, stats = asyncio.run(body())
        assert len(records) == 4, svc.log_tail()
        assert {e.replica_id for _, e in records} == {"svc-0"}
        assert all(len(e.samples) == 2 and e.samples[0].ref_logprobs for _, e in records)
        assert (stats.prompts_pending, stats.prompts_backlog) == (0, 0)
        svc.signal()
        assert svc.wait(30) == 0, svc.log_tail()
    finally:
        svc.stop()


def test_partial_rollouts_write_version_spans(services, redis_server, tiny_models):
    """A push while the worker generates a job (hf engine, partial rollouts on): the record's samples carry version
    spans that cover their tokens (version 0, then 1), policy_version the oldest, reference log-probs of every token;
    the sampling log-probs of the new span agree with the reference's only where the weights are the same."""

    path = Path(os.environ["RLHF_CACHE_DIR"]) / "tiny" / "policy"
    steps: list[int] = []
    engine = HFEngine(path, "tiny:policy", device="cpu", partial_rollouts=True, hooks=EngineHooks(on_step=steps.append))
    g = torch.Generator().manual_seed(3)
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in load_file(str(path / "model.safetensors")).items()
    }

    async def body():
        await engine.start()
        redis = connect(redis_server.url)
        pq, eq = PromptQueue(redis, RUN), ExperienceQueue(redis, RUN)
        job = make_prompt_job("p0", run_id=RUN, data_index=0, epoch=1, issued_policy_version=0, label="3")
        job.prompt_ids.extend(engine.tokenizer.encode("What is 1 plus 2?"))
        job.params.CopyFrom(common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=100, seed=7, ignore_eos=True))
        assert all(r.published for r in await pq.publish_many([job]))
        worker = _worker(engine, redis_server, services)
        task = asyncio.create_task(worker.run())
        while len(steps) < 5:  # the job is decoding
            await asyncio.sleep(0.002)
        await engine.swap_weights(new, 1, "c1")
        records = await _read_experience(eq, 1, 60)
        await _stop(worker, task)
        await engine.close()
        await redis.aclose()
        return records

    ((_, exp),) = asyncio.run(body())
    assert len(exp.samples) == 2
    for s in exp.samples:
        assert len(s.response_ids) == len(s.sampling_logprobs) == len(s.ref_logprobs) == 100
        assert list(s.span_versions) == [0, 1] and s.policy_version == 0
        cut = s.span_starts[1]
        assert s.span_starts[0] == 0 and 0 < cut < 100
        # the reference holds the old weights: it agrees with the sampler on the old span only
        old = [abs(a - b) for a, b in zip(s.sampling_logprobs[:cut], s.ref_logprobs[:cut], strict=True)]
        moved = [abs(a - b) for a, b in zip(s.sampling_logprobs[cut:], s.ref_logprobs[cut:], strict=True)]
        assert max(old) < 1e-3 and max(moved) > 1e-3
