"""Rejection-sampling fine-tuning (seed 002: best of K by reward, then SFT on it, alternating with the RL update)."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf import algo
from rlhf.config import parse_config
from rlhf.models import causal_lm_logits
from rlhf.v1 import experience_pb2
from services.trainer.engine import TrainerEngine
from tests.support import make_experience, make_sample


def _config(stage: str = "ray_grpo", **rs):
    return parse_config(
        {
            "training": {"stage": stage, "device": "cpu", "lr": 5e-3, "seed": 7},
            "actor_rollout_ref": {"actor_rollout": {"n_samples_per_prompt": 4, "ppo_mini_batch_size": 8}},
            "critic": {"critic_mini_batch_size": 8},
            "algorithm": {"rejection_sampling": {"interval": 2, **rs}},
        }
    )


def _records(engine: TrainerEngine, seed: int = 0) -> list[experience_pb2.Experience]:
    """Three prompts x 4 samples of random tokens ending in EOS, random scores (one clear best per prompt)."""
    rng = random.Random(seed)
    vocab = [t for t in range(3, 120) if t not in (engine.eos_id, engine.pad_id)]
    out = []
    for j in range(3):
        exp = make_experience(f"j{j}", [2, 100 + j, 50 + j])
        for k in range(4):
            ids = [rng.choice(vocab) for _ in range(rng.randint(3, 6))] + [engine.eos_id]
            ref = [rng.uniform(-5, -1) for _ in ids]
            score = k / 10 + j / 100 if k != 2 else 0.9  # sample 2 is each prompt's best
            exp.samples.append(make_sample(ids, ref_logprobs=ref, score=score, policy_version=engine.policy_version))
        out.append(exp)
    return out


def test_best_of_group_picks_each_groups_best():
    scores = torch.tensor([0.1, 0.5, 0.5, 0.2, -1.0, -2.0, 3.0])
    group = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    assert algo.best_of_group(scores, group).tolist() == [1, 3, 6]  # the first of equal maxima
    assert algo.best_of_group(scores, group, min_score=0.3).tolist() == [1, 6]
    assert algo.best_of_group(scores, group, min_score=9.0).numel() == 0


def _nll(engine, exp_rows):
    with torch.no_grad():
        total = []
        for prompt, resp in exp_rows:
            ids = torch.tensor([prompt + resp])
            logits = causal_lm_logits(engine.actor, ids, engine.pad_id)[:, len(prompt) - 1 : -1]
            total.append(-algo.logprobs_from_logits(logits.float(), ids[:, len(prompt) :]).mean().item())
    return sum(total) / len(total)


def test_rejection_sampling_steps_alternate_and_raise_the_best_answers_likelihood(tiny_models):
    torch.manual_seed(0)
    engine = TrainerEngine(_config())
    recs = _records(engine)
    best = [(list(e.prompt_ids), list(e.samples[2].response_ids)) for e in recs]
    others = [(list(e.prompt_ids), list(e.samples[0].response_ids)) for e in recs]
    before_best, before_other = _nll(engine, best), _nll(engine, others)
    m1 = engine.step(recs)
    after_best, after_other = _nll(engine, best), _nll(engine, others)
    assert m1["rft/kept"] == 3 and m1["rft/kept_score_mean"] == pytest.approx(0.9) and "loss/sft" in m1
    assert after_best < before_best - 0.05  # SFT on the best answers makes them likelier
    assert after_best - before_best < after_other - before_other  # more than the rejected ones
    m2 = engine.step(_records(engine, seed=1))  # the RL update's turn: no rejection-sampling metrics
    assert "rft/kept" not in m2 and "loss/policy" in m2
    assert "rft/kept" in engine.step(_records(engine, seed=2))


@pytest.mark.parametrize("stage", ["ray_grpo", "ray_ppo"])
def test_only_the_kept_samples_move_the_weights(tiny_models, stage):
    def trained(recs):
        torch.manual_seed(0)
        engine = TrainerEngine(_config(stage))
        engine.step(recs)
        return [p.detach().clone() for p in engine.actor.parameters()]

    probe = TrainerEngine(_config(stage))
    base = _records(probe)

    def changed(sample: int):
        recs = [experience_pb2.Experience.FromString(e.SerializeToString()) for e in base]
        for e in recs:
            e.samples[sample].response_ids[0] = (e.samples[sample].response_ids[0] + 1) % 100 + 3
        return recs

    w, w_rejected, w_best = trained(base), trained(changed(0)), trained(changed(2))
    assert all(torch.equal(p, q) for p, q in zip(w, w_rejected, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(w, w_best, strict=True))


def test_min_score_can_keep_nothing_and_then_nothing_moves(tiny_models):
    torch.manual_seed(0)
    engine = TrainerEngine(_config(min_score=5.0))
    before = [p.detach().clone() for p in engine.actor.parameters()]
    m = engine.step(_records(engine))
    assert m["rft/kept"] == 0 and m["rft/groups"] == 3
    assert all(torch.equal(p, q) for p, q in zip(before, engine.actor.parameters(), strict=True))


def test_more_epochs_fit_the_kept_answers_more(tiny_models):
    drops = []
    for epochs in (1, 3):
        torch.manual_seed(0)
        engine = TrainerEngine(_config(epochs=epochs))
        recs = _records(engine)
        best = [(list(e.prompt_ids), list(e.samples[2].response_ids)) for e in recs]
        before = _nll(engine, best)
        engine.step(recs)
        drops.append(before - _nll(engine, best))
    assert drops[1] > drops[0] + 0.05, drops
