"""The pure parts of the seeds' training options: LR schedule values, running reward statistics and clipping, the
SFT loss of PPO-ptx, micro-batch weights."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf import algo
from rlhf.config import parse_config
from services.trainer import optim


def _lrs(style, total=11, warmup=0.0, lr=1.0, min_lr=0.1):
    return [
        algo.lr_at(s, lr=lr, min_lr=min_lr, total_steps=total, warmup_fraction=warmup, style=style)
        for s in range(total)
    ]


def test_lr_schedule_values_at_given_steps():
    assert _lrs("constant") == [1.0] * 11
    lin = _lrs("linear")
    assert lin[0] == 1.0 and lin[-1] == pytest.approx(0.1) and lin[5] == pytest.approx(0.55)
    cos = _lrs("cosine")
    assert cos[0] == 1.0 and cos[-1] == pytest.approx(0.1) and cos[5] == pytest.approx(0.55)
    assert cos[2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    # warm-up: 20% of 10 steps = 2 steps rising from lr/2, then the decay over the remaining steps
    warm = _lrs("linear", total=10, warmup=0.2)
    assert warm[:2] == [0.5, 1.0] and warm[2] == 1.0 and warm[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(warm[2:], warm[3:], strict=False))
    with pytest.raises(ValueError, match="lr_decay_style"):
        _lrs("step")


def test_per_role_optimizer_fields_override_the_training_section():
    cfg = parse_config(
        {
            "training": {
                "lr": 1e-5,
                "min_lr": 1e-6,
                "weight_decay": 0.1,
                "clip_grad": 1.0,
                "lr_decay_style": "cosine",
                "train_iters": 4,
            },
            "actor_rollout_ref": {
                "actor_rollout": {
                    "lr": 2e-5,
                    "weight_decay": 0.0,
                    "adam_beta2": 0.95,
                    "clip_grad": 5.0,
                    "lr_decay_style": "linear",
                    "min_lr": 0.0,
                }
            },
            "critic": {"lr": 4e-5},
        }
    )
    a, c = optim.actor_optim(cfg), optim.critic_optim(cfg)
    assert (a.lr, a.min_lr, a.weight_decay, a.betas, a.clip_grad, a.decay_style) == (
        2e-5,
        0.0,
        0.0,
        (0.9, 0.95),
        5.0,
        "linear",
    )
    # the critic's section leaves them out: the training section's values (MindSpeed's defaults for every role)
    assert (c.lr, c.min_lr, c.weight_decay, c.betas, c.clip_grad, c.decay_style, c.warmup_fraction) == (
        4e-5,
        1e-6,
        0.1,
        (0.9, 0.999),
        1.0,
        "cosine",
        0.0,
    )
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=a.lr)
    assert [optim.set_lr(opt, a, s, 4) for s in range(4)] == pytest.approx([2e-5, 2e-5 * 2 / 3, 2e-5 / 3, 0.0])
    assert opt.param_groups[0]["lr"] == 0.0


def test_the_critic_section_overrides_the_training_sections_optimizer_fields():
    critic = {
        "lr": 9e-6,
        "min_lr": 9e-7,
        "weight_decay": 0.01,
        "adam_beta1": 0.8,
        "adam_beta2": 0.95,
        "clip_grad": 0.5,
        "lr_decay_style": "linear",
        "lr_warmup_fraction": 0.25,
    }
    cfg = parse_config({"training": {"lr": 1e-6, "weight_decay": 0.1, "train_iters": 8}, "critic": critic})
    c, a = optim.critic_optim(cfg), optim.actor_optim(cfg)
    assert (c.lr, c.min_lr, c.weight_decay, c.betas, c.clip_grad, c.decay_style, c.warmup_fraction) == (
        9e-6,
        9e-7,
        0.01,
        (0.8, 0.95),
        0.5,
        "linear",
        0.25,
    )
    assert (a.weight_decay, a.betas, a.clip_grad, a.decay_style) == (0.1, (0.9, 0.999), 1.0, "constant")
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=c.lr)
    # two warm-up steps (a quarter of 8) rising to 9e-6, then linear from 9e-6 down to min_lr at the last step
    lrs = [optim.set_lr(opt, c, s, 8) for s in range(8)]
    assert lrs[:3] == pytest.approx([4.5e-6, 9e-6, 9e-6]) and lrs[-1] == pytest.approx(9e-7)
    assert lrs[3] == pytest.approx(9e-6 - (9e-6 - 9e-7) / 5)


def test_running_moments_are_the_statistics_of_everything_seen():
    torch.manual_seed(0)
    batches = [torch.randn(n) * 3 + 2 for n in (5, 1, 17, 8)]
    m = algo.RunningMoments()
    for i, x in enumerate(batches):
        m.update(x)
        seen = torch.cat(batches[: i + 1]).double()
        assert m.count == seen.numel()
        assert m.mean == pytest.approx(seen.mean().item(), rel=1e-9, abs=1e-12)
        assert m.var == pytest.approx(seen.var(unbiased=False).item(), rel=1e-9, abs=1e-12)
    out = algo.normalize_and_clip(batches[-1], m, None)
    assert torch.allclose(out, (batches[-1] - m.mean) / m.std, atol=1e-6)


def test_clipped_rewards_stay_in_range():
    x = torch.tensor([-50.0, -1.0, 0.0, 2.0, 40.0])
    out = algo.normalize_and_clip(x, None, (-3.0, 3.0))
    assert out.tolist() == [-3.0, -1.0, 0.0, 2.0, 3.0]
    m = algo.RunningMoments()
    m.update(x)
    normed = algo.normalize_and_clip(x, m, (-1.0, 1.0))
    assert normed.min() >= -1.0 and normed.max() <= 1.0 and normed[0] == -1.0 and normed[-1] == 1.0


def test_fixed_moments_normalise_with_the_given_mean_and_std_exactly():
    x = torch.tensor([-1.0, 0.0, 0.5, 3.0])
    fixed = algo.FixedMoments(0.5, 2.0)
    fixed.update(x)  # fixed: nothing learnt from the scores
    assert algo.normalize_and_clip(x, fixed, None).tolist() == [-0.75, -0.25, 0.0, 1.25]
    assert algo.normalize_and_clip(x, fixed, (-0.5, 0.5)).tolist() == [-0.5, -0.25, 0.0, 0.5]
    with pytest.raises(ValueError, match="std"):
        algo.FixedMoments(0.0, 0.0)


def test_reward_baseline_subtracts_the_other_samples_of_the_prompt():
    scores = torch.tensor([1.0, 4.0, -2.0, 7.0, 0.5, 3.0])
    group = torch.tensor([0, 0, 1, 0, 1, 2])  # prompt 0: rows 0, 1, 3; prompt 1: rows 2, 4; prompt 2: row 5 alone
    loo = algo.subtract_reward_baseline(scores, group, "leave_one_out")
    assert loo.tolist() == [1.0 - 5.5, 4.0 - 4.0, -2.0 - 0.5, 7.0 - 2.5, 0.5 + 2.0, 0.0]
    mean = algo.subtract_reward_baseline(scores, group, "group_mean")
    assert mean.tolist() == [1.0 - 4.0, 0.0, -2.0 + 0.75, 3.0, 0.5 + 0.75, 0.0]
    assert algo.subtract_reward_baseline(scores, group, "none") is scores
    with pytest.raises(ValueError, match="reward baseline"):
        algo.subtract_reward_baseline(scores, group, "mean")


def test_ppo_rollout_puts_the_baselined_score_after_the_eos_penalty_and_before_the_kl():
    responses = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [5, 2, 0, 0], [6, 7, 8, 9]])  # eos 2, pad 0
    logprobs, ref = -torch.rand(4, 4), -torch.rand(4, 4)
    kw = dict(pad_token_id=0, eos_token_id=2, kl_coef=0.1, missing_eos_penalty=1.0, whiten_advantages=False)
    scores, group = torch.tensor([2.0, 1.0, 0.0, 3.0]), torch.tensor([0, 0, 1, 1])
    base = algo.ppo_rollout(responses, logprobs, ref, torch.zeros(4, 4), scores, **kw)
    out = algo.ppo_rollout(
        responses, logprobs, ref, torch.zeros(4, 4), scores, group=group, reward_baseline="leave_one_out", **kw
    )
    # penalised scores [2, 0, 0, 2] (rows 1 and 3 have no EOS), then minus the other sample's
    assert out.scores.tolist() == [2.0, -2.0, -2.0, 2.0]
    assert base.scores.tolist() == [2.0, 0.0, 0.0, 2.0]
    torch.testing.assert_close(out.non_score_reward, base.non_score_reward)
    # the per-token rewards differ by the baseline alone, at the score position
    torch.testing.assert_close((out.rewards - base.rewards).sum(1), torch.tensor([0.0, -2.0, -2.0, 0.0]))
    assert ((out.rewards - base.rewards) != 0).sum().item() == 2
    with pytest.raises(ValueError, match="needs group"):
        algo.ppo_rollout(responses, logprobs, ref, torch.zeros(4, 4), scores, reward_baseline="group_mean", **kw)


def test_sft_loss_is_the_mean_next_token_nll_over_real_tokens():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(1, 7, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
    terms = [-torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]] for b in range(2) for t in range(4) if mask[b, t + 1]]
    assert algo.sft_loss(logits, ids, mask).item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-6)


def test_micro_weights_add_up_to_one_minibatch():
    whole = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]).bool()
    parts = [whole[:2], whole[2:]]
    assert sum(optim.micro_weight("tokens", p, whole) for p in parts) == pytest.approx(1.0)
    assert optim.micro_weight("tokens", parts[0], whole) == pytest.approx(3 / 6)
    assert optim.micro_weight("rows", parts[1][:1], whole) == 0.25
    assert optim.micro_weight("sum", parts[0], whole) == 1.0
    assert [len(m) for m in optim.micro_batches(torch.arange(5), 2)] == [2, 2, 1]
    assert [len(m) for m in optim.micro_batches(torch.arange(5), None)] == [5]


def test_full_kl_is_the_exact_kl_over_the_vocabulary_and_replaces_the_estimate():
    torch.manual_seed(2)
    logits, ref_logits = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    got = algo.full_kl(logits, ref_logits, temperature=0.7)
    for b in range(2):
        for t in range(3):
            p = torch.softmax(logits[b, t] / 0.7, -1)
            q = torch.softmax(ref_logits[b, t] / 0.7, -1)
            assert got[b, t].item() == pytest.approx((p * (p / q).log()).sum().item(), rel=1e-5)
    assert (got >= 0).all() and algo.full_kl(logits, logits).abs().max() < 1e-6
    lp = torch.zeros(2, 3)
    kr = algo.kl_penalized_rewards(torch.ones(2), lp, lp, torch.tensor([2, 0]), 0.5, kl=got)
    assert torch.allclose(kr.kl, got * torch.tensor([[1, 1, 1], [1, 0, 0]]))
    assert torch.allclose(kr.non_score_reward, -0.5 * kr.kl)
