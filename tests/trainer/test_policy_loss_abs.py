"""``loss/policy_abs``: the actor loss MindSpeed-LLM logs and seed 000 compares with TRL's, the mean over the actor's
micro-batches of |policy loss|. Advantages whitened over the batch keep the signed mean (``loss/policy``) near 0.

Checked against a direct computation: with one minibatch the weights do not move before its last micro-batch, so
every ratio is 1 and each micro-batch's loss is minus the mean advantage of its tokens (PPO) or of its rows (GRPO,
loss_type grpo, no KL term)."""

from __future__ import annotations

import pytest
import torch

from rlhf import algo
from rlhf.config import parse_config
from services.trainer.engine import TrainerEngine
from tests.support import make_experience, make_sample
from tests.support.sampling import actor_samples

PROMPTS = [[2, 100 + i, 200 + i] for i in range(4)]
N, MICRO = 4, 2  # 16 rows in one minibatch, 8 micro-batches


def _engine(stage: str, **algorithm) -> TrainerEngine:
    return TrainerEngine(
        parse_config(
            {
                "training": {"stage": stage, "device": "cpu", "lr": 5e-3, "seed": 7},
                "actor_rollout_ref": {
                    "actor_rollout": {
                        "n_samples_per_prompt": N,
                        "ppo_mini_batch_size": N * len(PROMPTS),
                        "micro_batch_size": MICRO,
                        "ppo_epochs": 1,
                        "shuffle_minibatch": False,
                    }
                },
                "critic": {"critic_mini_batch_size": N * len(PROMPTS)},
                "algorithm": algorithm,
            }
        )
    )


def _batch(engine: TrainerEngine, scores: list[float]):
    torch.manual_seed(0)
    records = []
    for j, prompt in enumerate(PROMPTS):
        out = actor_samples(engine, torch.tensor([prompt] * N), 5)[:, len(prompt) :].tolist()
        samples = [
            make_sample(row, ref_logprobs=[-1.0] * len(row), score=scores[j * N + i], policy_version=0)
            for i, row in enumerate(out)
        ]
        records.append(make_experience(f"j{j}", prompt, samples))
    return records


def _micro_batches(total: int) -> list[torch.Tensor]:
    return list(torch.arange(total).split(MICRO))


def test_ppo_logs_the_mean_absolute_micro_batch_loss(tiny_models, monkeypatch):
    rollouts = []
    real = algo.ppo_rollout

    def keep(*args, **kwargs):
        rollouts.append(real(*args, **kwargs))
        return rollouts[-1]

    monkeypatch.setattr(algo, "ppo_rollout", keep)
    engine = _engine("ray_ppo", kl_ctrl={"kl_coef": 0.01})
    m = engine.step(_batch(engine, [float(i % 3) for i in range(N * len(PROMPTS))]))
    (r,) = rollouts
    mask = r.response_mask
    losses = torch.stack([-algo.masked_mean(r.advantages[mu], mask[mu]) for mu in _micro_batches(len(mask))])
    assert m["loss/policy_abs"] == pytest.approx(losses.abs().mean().item(), abs=1e-5)
    assert m["loss/policy"] == pytest.approx(losses.mean().item(), abs=1e-5)
    # the seed's point: whitened advantages, a signed mean well below the magnitude
    assert (losses > 0).any() and (losses < 0).any()
    assert abs(m["loss/policy"]) < 0.5 * m["loss/policy_abs"]


def test_grpo_logs_the_mean_absolute_micro_batch_loss(tiny_models):
    engine = _engine("ray_grpo", adv_estimator="grpo", loss_type="grpo")
    # one prompt's group [0, 1, 2, 3]: its first micro-batch has the two low scores, its second the two high ones
    scores = [0.0, 1.0, 2.0, 3.0] * len(PROMPTS)
    m = engine.step(_batch(engine, scores))
    group = torch.tensor([0.0, 1.0, 2.0, 3.0])
    advantages = ((group - group.mean()) / (group.std() + 1e-4)).repeat(len(PROMPTS))  # TRL's group scaling
    losses = torch.stack([-advantages[mu].mean() for mu in _micro_batches(len(scores))])
    assert m["loss/policy_abs"] == pytest.approx(losses.abs().mean().item(), abs=1e-4)
    assert m["loss/policy"] == pytest.approx(0.0, abs=1e-4)
    assert m["loss/policy_abs"] > 0.5
