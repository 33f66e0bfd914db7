"""The trainer on episode records (multi-turn): every stage trains on the loss mask (the model's own tokens) only.

A one-turn episode must train exactly as today's single-turn record; the environment's tokens must not move the
weights (changing their log-probs or ids beyond the context they give changes nothing but that context).
"""

from __future__ import annotations

import random

import pytest
import torch

from rlhf.config import parse_config
from rlhf.v1 import experience_pb2
from services.trainer.batch import collate
from services.trainer.engine import TrainerEngine
from tests.support import make_experience, make_sample

STAGES = ["ray_ppo", "ray_grpo", "ray_online_dpo"]


def _config(stage: str):
    n = 2 if stage == "ray_online_dpo" else 4
    return parse_config(
        {
            "training": {"stage": stage, "device": "cpu", "lr": 5e-3, "seed": 7, "clip_grad": 1.0},
            "actor_rollout_ref": {"actor_rollout": {"n_samples_per_prompt": n, "ppo_mini_batch_size": 8}},
            "critic": {"critic_mini_batch_size": 8},
            "algorithm": {"kl_ctrl": {"kl_coef": 0.05}},
        }
    )


def _records(engine: TrainerEngine, n: int, episode: str, seed: int = 0) -> list[experience_pb2.Experience]:
    """Four prompts x n samples of random tokens ending in EOS. ``episode``: "" (single-turn records), "one" (each
    as a one-turn episode) or "multi" (each split into two model turns around 3 environment tokens)."""
    rng = random.Random(seed)
    eos, pad = engine.eos_id, engine.pad_id
    vocab = [t for t in range(3, 120) if t not in (eos, pad)]
    out = []
    for j in range(4):
        exp = make_experience(f"j{j}", [2, 100 + j, 50 + j])
        for _ in range(n):
            k = rng.randint(3, 7)
            ids = [rng.choice(vocab) for _ in range(k)] + [eos]
            mask = [True] * len(ids)
            if episode == "multi":
                turn2 = [rng.choice(vocab) for _ in range(3)] + [eos]
                ids = ids + [rng.choice(vocab) for _ in range(3)] + turn2
                mask = mask + [False] * 3 + [True] * len(turn2)
            s = make_sample(
                ids,
                ref_logprobs=[rng.uniform(-5, -1) for _ in ids],
                sampling_logprobs=[rng.uniform(-5, -1) if m else 0.0 for m in mask],
                score=rng.random(),
                policy_version=engine.policy_version,
            )
            if episode:
                s.loss_mask.extend(mask)
                s.ended_by = "done"
            exp.samples.append(s)
        out.append(exp)
    return out


def _weights(engine: TrainerEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.actor.parameters()]


@pytest.mark.parametrize("stage", STAGES)
def test_a_one_turn_episode_trains_exactly_as_a_single_turn_record(tiny_models, stage):
    results = []
    for episode in ("", "one"):
        torch.manual_seed(0)
        engine = TrainerEngine(_config(stage))
        n = engine.cfg.actor.n_samples_per_prompt
        metrics = [engine.step(_records(engine, n, episode, seed=s)) for s in range(2)]
        results.append((metrics, _weights(engine)))
    (m_single, w_single), (m_episode, w_episode) = results
    for a, b in zip(m_single, m_episode, strict=True):
        same = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "episode/"))}
        assert same(a) == same(b)
    assert all(torch.equal(p, q) for p, q in zip(w_single, w_episode, strict=True))


@pytest.mark.parametrize("stage", STAGES)
def test_environment_tokens_carry_no_loss(tiny_models, stage):
    """Changing what the records say about the environment's tokens (their reference and sampling log-probs) leaves
    the update as it was; changing a model token's reference log-prob does not (the check can fail)."""
    torch.manual_seed(0)
    probe = TrainerEngine(_config(stage))
    n = probe.cfg.actor.n_samples_per_prompt
    base = _records(probe, n, "multi")

    def perturbed(model_tokens: bool):
        recs = [experience_pb2.Experience.FromString(e.SerializeToString()) for e in base]
        for e in recs:
            for s in e.samples:
                for i, m in enumerate(s.loss_mask):
                    if m == model_tokens:
                        s.ref_logprobs[i] -= 3.0
                        if not model_tokens:
                            s.sampling_logprobs[i] = -9.0
        return recs

    weights = []
    for recs in (base, perturbed(False), perturbed(True)):
        torch.manual_seed(0)
        engine = TrainerEngine(_config(stage))
        engine.step(recs)
        weights.append(_weights(engine))
    assert all(torch.equal(p, q) for p, q in zip(weights[0], weights[1], strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(weights[0], weights[2], strict=True))


def test_collate_carries_the_loss_mask_and_who_ended(tiny_models):
    engine = TrainerEngine(_config("ray_grpo"))
    recs = _records(engine, 2, "multi")
    recs[0].samples[0].ended_by = "max_turns"
    b = collate(recs, engine.pad_id, torch.device("cpu"))
    s = recs[0].samples[0]
    assert b.loss_mask[0, : len(s.loss_mask)].tolist() == list(s.loss_mask)
    assert not b.loss_mask[0, len(s.loss_mask) :].any()
    assert b.episodes.all() and b.episode_done.tolist()[:2] == [False, True]
    bad = _records(engine, 2, "multi")
    bad[1].samples[0].loss_mask.append(True)
    with pytest.raises(ValueError, match="loss_mask has"):
        collate(bad, engine.pad_id, torch.device("cpu"))


def test_a_step_reports_per_episode_metrics(tiny_models):
    engine = TrainerEngine(_config("ray_grpo"))
    recs = _records(engine, 4, "multi")
    for e in recs:
        for s in e.samples:
            s.episode_metrics.update({"turns": 2.0, "tool_calls": 1.0})
    recs[0].samples[0].ended_by = "max_turns"
    m = engine.step(recs)
    assert m["episode/turns"] == 2.0 and m["episode/tool_calls"] == 1.0
    assert m["episode/environment_tokens"] == 3.0
    assert m["episode/ended_by_done"] == pytest.approx(15 / 16) and m["episode/ended_by_max_turns"] == 1 / 16
    single = TrainerEngine(_config("ray_grpo")).step(_records(engine, 4, ""))
    assert not any(k.startswith("episode/") for k in single)
