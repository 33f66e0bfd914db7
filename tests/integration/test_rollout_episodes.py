"""Multi-turn episodes through a rollout replica in worker mode, against real parts: a private redis-server, the
reference service as a process, the environment service on real gRPC + HTTP servers on loopback, and the tiny
policy in the hf engine.

Shows: an episode's record holds every turn as generated (each model turn's ids are exactly what the engine got
back, and each next turn is generated from the ids so far: nothing re-tokenised), the loss mask, zero sampling
log-probs on environment tokens, reference log-probs for all, turn versions and rewards, who ended it; max_turns
ends an endless one; an environment that fails makes its samples errors (never a score), and the job is still
written; an episode the environment service lost (as after a restart) is played again from its start; with partial
rollouts, a push in the middle of a model turn gives the record version spans over every token.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf.config import parse_config
from rlhf.environments.base import EPISODE_ENVIRONMENT_KEY, EPISODE_MAX_TOKENS_KEY, EPISODE_MAX_TURNS_KEY
from rlhf.serving import ServiceMetrics, ServiceSettings
from rlhf.transport import ExperienceQueue, PromptQueue, connect, dead_letters
from rlhf.v1 import common_pb2, experience_pb2
from services.environment.engine import EnvironmentEngine
from services.environment.main import build_runner
from services.rollout.engine_types import EngineHooks
from services.rollout.hf_engine import HFEngine
from services.rollout.worker import RolloutWorker
from services.trainer.batch import token_versions
from services.trainer.publisher import episode_metadata
from tests.integration._procs import ServiceProc, write_config
from tests.support import make_prompt_job

RUN = "episodes-test"
ECHO = "python:_environments:Echo"
FAILING = "python:_environments:FailingStep"
CALC = "builtin:calculator"
HOSTED = {ECHO: {"turns": 3}, FAILING: {}, CALC: {}}


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory):
    d = tmp_path_factory.mktemp("episodes-ref")
    cfg = write_config(d / "cfg.yaml", {"run_id": RUN, "actor_rollout_ref": {"actor_rollout": {"load": "tiny:policy"}}})
    proc = ServiceProc("reference", cfg, d / "logs", env={"RLHF_CACHE_DIR": os.environ["RLHF_CACHE_DIR"]})
    proc.start()
    yield proc
    proc.stop()


class _Recording:
    """The engine, with the prompts of every generate call kept (and a hook before each)."""

    def __init__(self, engine, before=None):
        self._e, self.prompts, self.before = engine, [], before

    def __getattr__(self, name):
        return getattr(self._e, name)

    async def generate(self, prompts, params):
        self.prompts += [list(p) for p in prompts]
        if self.before is not None:
            self.before(len(self.prompts))
        return await self._e.generate(prompts, params)


def _job(
    i: int, environment: str, max_turns: int = 4, n: int = 2, max_tokens: int = 300, turn_tokens: int = 5
) -> experience_pb2.PromptJob:
    job = make_prompt_job(
        f"ep{i}", run_id=RUN, data_index=i, epoch=0, prompt_text=f"say something {i}", issued_policy_version=0
    )
    job.params.CopyFrom(common_pb2.SamplingParams(n=n, temperature=1.0, max_tokens=turn_tokens, seed=10 + i))
    if turn_tokens != 5:  # turns of exactly that many tokens
        job.params.ignore_eos = True
    job.metadata[EPISODE_ENVIRONMENT_KEY] = environment
    job.metadata[EPISODE_MAX_TURNS_KEY] = str(max_turns)
    job.metadata[EPISODE_MAX_TOKENS_KEY] = str(max_tokens)
    return job


def _run(reference, redis_server, jobs, before=None, hosted=HOSTED, until=None, letters=None, **engine_kw):
    """Serve the environments, run a worker over ``jobs`` until each has a record (or ``until(records, worker)``);
    -> (records by job id, the recording engine, the worker, the environment engine). ``before(calls, env_engine,
    policy)`` runs before each generate call; ``letters``: a list the run's dead letters are added to;
    ``engine_kw``: for the hf engine."""

    async def main():
        settings = ServiceSettings.from_env({}, host="127.0.0.1", grpc_port=0, http_port=0, api_token="t")
        metrics = ServiceMetrics("environment")
        env_engine = EnvironmentEngine(hosted, timeout_s=5, metrics=metrics)
        runner = build_runner(env_engine, settings, metrics)
        served = asyncio.create_task(
            runner.run(startup=env_engine.start, shutdown=env_engine.close, install_signal_handlers=False)
        )
        await asyncio.wait_for(runner.started.wait(), 10)
        policy = HFEngine(Path(os.environ["RLHF_CACHE_DIR"]) / "tiny" / "policy", model_name="tiny:policy", **engine_kw)
        await policy.start()
        engine = _Recording(policy, None if before is None else lambda k: before(k, env_engine, policy))
        redis = connect(redis_server.url)
        await PromptQueue(redis, RUN).publish_many(jobs)
        worker = RolloutWorker(
            engine,
            redis_url=redis_server.url,
            run_id=RUN,
            reward_addr="127.0.0.1:1",  # never called for episodes
            reference_addr=reference.grpc_addr,
            environment_addr=f"127.0.0.1:{runner.grpc_port}",
            settings=settings,
            replica_id="r0",
            block_ms=100,
        )
        task = asyncio.create_task(worker.run())
        eq, out = ExperienceQueue(redis, RUN), {}
        deadline = time.monotonic() + 90
        done = until or (lambda records, _: len(records) == len(jobs))
        while not done(out, worker) and time.monotonic() < deadline:
            out.update({e.job_id: e for _, e in await eq.read("trainer", count=16, block_ms=200)})
        worker.stop()
        await asyncio.wait_for(task, 30)
        if letters is not None:
            letters.extend(await dead_letters(redis, RUN))
        await policy.close()
        runner.request_stop()
        await asyncio.wait_for(served, 15)
        await redis.flushall()
        await redis.aclose()
        return out, engine, worker, env_engine

    return asyncio.run(main())


def test_an_episode_is_every_turn_as_generated(reference, redis_server):
    out, engine, worker, _ = _run(
        reference, redis_server, [_job(0, ECHO), _job(1, ECHO, max_turns=2), _job(4, ECHO, max_tokens=8)]
    )
    exp = out["ep0"]
    assert len(exp.samples) == 2
    for s in exp.samples:
        n = len(s.response_ids)
        assert s.score_status == common_pb2.ITEM_STATUS_OK, s.score_error
        assert len(s.loss_mask) == len(s.sampling_logprobs) == len(s.ref_logprobs) == n
        assert s.ended_by == "done" and list(s.turn_rewards) == [1.0, 2.0, 3.0] and s.score == 6.0
        assert len(s.turn_policy_versions) == 3 and s.episode_metrics["turns"] == 3.0
        # three model turns separated by two environment turns; environment tokens have no sampling log-prob
        runs = [m for i, m in enumerate(s.loss_mask) if i == 0 or m != s.loss_mask[i - 1]]
        assert runs == [True, False, True, False, True]
        assert all(lp == 0.0 for lp, m in zip(s.sampling_logprobs, s.loss_mask, strict=True) if not m)
        assert any(lp != 0.0 for lp, m in zip(s.sampling_logprobs, s.loss_mask, strict=True) if m)
        assert "echo 1:" in s.response_text and "echo 2:" in s.response_text
        assert not s.span_starts and not s.span_versions and s.policy_version == 0  # one version: no spans
        # token in, token out: every turn was generated from the prompt plus the record's ids before it
        seq = list(exp.prompt_ids) + list(s.response_ids)
        starts = [i for i, m in enumerate(s.loss_mask) if m and (i == 0 or not s.loss_mask[i - 1])]
        for start in starts:
            assert seq[: len(exp.prompt_ids) + start] in engine.prompts
    cut = out["ep1"].samples[0]
    assert cut.ended_by == "max_turns" and len(cut.turn_policy_versions) == 2 and list(cut.turn_rewards) == [1.0, 2.0]
    assert cut.loss_mask[-1]  # nothing appended after the last turn
    assert worker.stats.processed == 3
    short = out["ep4"].samples[0]  # a budget of 8 tokens: the first turn (5) and the echo leave none for a second
    assert short.ended_by == "max_tokens" and len(short.turn_policy_versions) == 1


def test_a_failing_environment_is_an_error_never_a_score(reference, redis_server):
    out, _, worker, env_engine = _run(reference, redis_server, [_job(2, FAILING)])
    for s in out["ep2"].samples:
        assert s.score_status == common_pb2.ITEM_STATUS_SCORER_ERROR
        assert "cannot handle" in s.score_error and FAILING in s.score_error
        assert s.ended_by == "error" and not s.score_components
    assert worker.stats.processed == 1  # written (its failure is kept on the samples), and acknowledged


def test_a_job_the_environment_refuses_is_dead_lettered_at_once(reference, redis_server):
    """Issue 46.5: the calculator refuses a reset without a label as the caller's error (INVALID_ARGUMENT, field
    label); the replica dead-letters that job at once with the reason (no replay fixes it), and goes on."""
    bad = _job(5, CALC, n=1)  # make_prompt_job sets no label
    letters: list[dict] = []
    out, _, worker, env_engine = _run(
        reference,
        redis_server,
        [bad, _job(6, ECHO, n=1)],
        until=lambda records, w: "ep6" in records and w.stats.dead_lettered == 1,
        letters=letters,
    )
    assert "ep5" not in out and out["ep6"].samples[0].score_status == common_pb2.ITEM_STATUS_OK
    assert worker.stats.dead_lettered == 1 and worker.stats.failed.get("invalid_argument") == 1
    (letter,) = letters
    assert (
        "refused the job's label" in letter["reason"] and "needs the reference answer as the label" in letter["reason"]
    ), letter["reason"]
    assert env_engine.episodes == {}


def test_an_episode_the_service_lost_is_played_again(reference, redis_server):
    def restart_once(calls: int, env_engine, _policy) -> None:
        if calls == 2:  # the second model turn of the first episode: the service forgets every episode
            env_engine.episodes.clear()

    out, engine, worker, _ = _run(reference, redis_server, [_job(3, ECHO, n=1)], before=restart_once)
    (s,) = out["ep3"].samples
    assert s.score_status == common_pb2.ITEM_STATUS_OK and s.ended_by == "done" and s.score == 6.0
    assert worker.stats.failed.get("environment_episode_lost") == 1
    assert len(engine.prompts) == 2 + 3  # the lost play's two turns, then three


def test_a_push_mid_turn_gives_the_episode_version_spans(reference, redis_server):
    """Partial rollouts: a push (version 1) three decode steps into the second of three model turns stops that turn
    and resumes it under the new weights. The record's version spans cover every token: the first turn, the
    environment's answer and the second turn's start at version 0, the rest of the second turn, the answer after it
    and the third turn at 1; policy_version is the oldest (0), turn_policy_versions each turn's oldest, and the
    trainer expands the spans per token as the tokens were sampled. The reference holds version 0's weights: the
    sampling log-probs agree with it on the model tokens the spans give version 0 only."""
    path = Path(os.environ["RLHF_CACHE_DIR"]) / "tiny" / "policy"
    g = torch.Generator().manual_seed(5)
    state = load_file(str(path / "model.safetensors"))
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    steps: list[int] = []
    pushes: list[asyncio.Task] = []
    turn = 32

    def push_in_turn_2(calls: int, _env, policy) -> None:
        if calls != 2:
            return
        at = len(steps)

        async def push():
            while len(steps) < at + 3:  # the second turn is decoding
                await asyncio.sleep(0.002)
            return await policy.swap_weights(new, 1, "c1")

        pushes.append(asyncio.get_running_loop().create_task(push()))

    out, engine, _, _ = _run(
        reference,
        redis_server,
        [_job(7, ECHO, n=1, turn_tokens=turn)],
        before=push_in_turn_2,
        partial_rollouts=True,
        hooks=EngineHooks(on_step=steps.append),
    )
    (push,) = pushes
    assert push.done() and push.result().swapped
    exp = out["ep7"]
    (s,) = exp.samples
    assert s.score_status == common_pb2.ITEM_STATUS_OK and s.ended_by == "done", s.score_error
    assert len(engine.prompts) == 3 and list(s.turn_policy_versions) == [0, 0, 1] and s.policy_version == 0
    mask = list(s.loss_mask)
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    assert len(starts) == 3 and all(mask[a : a + turn] == [True] * turn for a in starts)
    # the second turn was stopped mid-way: its tokens after the cut were sampled by version 1
    assert list(s.span_versions) == [0, 1] and s.span_starts[0] == 0
    cut = s.span_starts[1]
    assert starts[1] < cut < starts[1] + turn, (starts, cut)
    n = len(s.response_ids)
    per_token = token_versions(s, n, exp.job_id).tolist()  # the trainer's expansion accepts and reads them
    assert per_token == [0] * cut + [1] * (n - cut)
    model = [i for i in range(n) if mask[i]]
    old = [abs(s.sampling_logprobs[i] - s.ref_logprobs[i]) for i in model if per_token[i] == 0]
    moved = [abs(s.sampling_logprobs[i] - s.ref_logprobs[i]) for i in model if per_token[i] == 1]
    assert len(old) + len(moved) == 3 * turn
    assert max(old) < 1e-3 and max(moved) > 1e-3


def test_the_environment_section_makes_jobs_episodes():
    assert episode_metadata(parse_config({})) == {}
    cfg = parse_config({"environment": {"name": "builtin:calculator", "max_turns": 3}})
    meta = episode_metadata(cfg)
    assert meta[EPISODE_ENVIRONMENT_KEY] == "builtin:calculator" and meta[EPISODE_MAX_TURNS_KEY] == "3"
    assert meta[EPISODE_MAX_TOKENS_KEY] == str(3 * cfg.max_new_tokens)  # default: max_turns turns of the budget
    cfg = parse_config({"environment": {"name": "builtin:calculator", "max_tokens": 40}})
    assert episode_metadata(cfg)[EPISODE_MAX_TOKENS_KEY] == "40"
