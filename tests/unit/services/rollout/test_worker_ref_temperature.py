"""The rollout worker asks the reference service for log-probs at the temperature the trainer uses: the sampling
temperature (TRL's PPO / GRPO / RLOO), or 1.0 under ray_online_dpo (TRL's OnlineDPOTrainer never divides)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rlhf.config import parse_config
from rlhf.serving.settings import ServiceSettings
from rlhf.v1 import common_pb2, reference_pb2, reward_pb2
from services.rollout.engine_types import Sample
from services.rollout.worker import RolloutWorker
from tests.support import make_prompt_job


class _Engine:
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "text", encode=lambda text: [2, 5])

    async def generate(self, prompts, opts):
        sample = Sample(
            token_ids=[5, 6, 1], text="", logprobs=[-1.0, -2.0, -0.5], finish_reason="stop", policy_version=0
        )
        return [SimpleNamespace(samples=[sample, sample])]


def _reference_temperature(stage: str, temperature: float) -> float:
    actor = {"temperature": temperature, "n_samples_per_prompt": 2}
    cfg = parse_config({"training": {"stage": stage}, "actor_rollout_ref": {"actor_rollout": actor}})
    settings = ServiceSettings(
        redis_url="redis://127.0.0.1:1/0", reward_addr="127.0.0.1:1", reference_addr="127.0.0.1:2"
    )
    worker = RolloutWorker.from_settings(_Engine(), settings, cfg)
    seen = {}

    async def score(req, **kw):
        return reward_pb2.ScoreResponse(
            results=[reward_pb2.ScoreResult(score=1.0, status=common_pb2.ITEM_STATUS_OK) for _ in req.items]
        )

    async def logprobs(req, **kw):
        seen["temperature"] = req.temperature
        return reference_pb2.LogProbsResponse(
            results=[reference_pb2.TokenLogProbs(logprobs=[-1.0, -1.0, -1.0]) for _ in req.items]
        )

    jobs = worker.job_runner(SimpleNamespace(Score=score), SimpleNamespace(LogProbs=logprobs))
    job = make_prompt_job("j", [2, 5], params=common_pb2.SamplingParams(n=2))
    asyncio.run(jobs.process(job))
    return seen["temperature"]


@pytest.mark.parametrize("stage, expected", [("ray_online_dpo", 1.0), ("ray_grpo", 0.75), ("ray_ppo", 0.75)])
def test_reference_temperature_follows_the_stage(stage, expected):
    assert _reference_temperature(stage, 0.75) == pytest.approx(expected)
