"""rlhf.algo.critic_free against naive loops (TRL 1.12's GRPO / RLOO formulas, OpenRLHF's REINFORCE++), and the rule
that a masked position can never turn a loss or its gradient into NaN."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo import (
    completion_mask,
    critic_free_advantages,
    dpo_pairs,
    grpo_advantages,
    grpo_loss,
    kl_estimate,
    leave_one_out,
    masked_mean,
    masked_sum,
    openrlhf_advantages,
    rloo_trl_advantages,
    rloo_trl_loss,
    top_entropy_mask,
)

SCORES = [0.5, 1.0, -0.25, 2.0, 0.3, 0.3, 0.3, 0.3, 3.0, -1.0, 0.0]
GROUP = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3]  # an equal-reward group, a group of 2 and a lone sample


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):  # unbiased, TRL's nanstd
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def _by_group(scores, group):
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        out.setdefault(g, []).append(i)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_match_a_loop(scale):
    got = grpo_advantages(torch.tensor(SCORES), torch.tensor(GROUP), scale).tolist()
    batch_std = _std(SCORES)
    expected = [0.0] * len(SCORES)
    for rows in _by_group(SCORES, GROUP).values():
        xs = [SCORES[i] for i in rows]
        for i in rows:
            a = SCORES[i] - _mean(xs)
            if scale == "group":
                a /= _std(xs) + 1e-4
            elif scale == "batch":
                a /= batch_std + 1e-4
            expected[i] = a if len(rows) > 1 else 0.0
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert got[-1] == 0.0  # a lone sample has no baseline


def test_grpo_equal_rewards_use_trls_epsilon():
    """TRL divides by std + 1e-4: an equal-reward group gets (almost) nothing, never ~0.03 as with 1e-6."""
    adv = grpo_advantages(torch.full((8,), 0.3), torch.zeros(8, dtype=torch.long))
    assert adv.abs().max() < 1e-2
    assert grpo_advantages(torch.tensor([1.0, 3.0]), torch.tensor([0, 0]))[1].item() == pytest.approx(
        1.0 / (math.sqrt(2.0) + 1e-4), rel=1e-6
    )


def test_leave_one_out_and_trl_rloo_fold_the_kl_before_the_baseline():
    scores, group = torch.tensor(SCORES), torch.tensor(GROUP)
    seq_kl = torch.linspace(-0.5, 1.0, len(SCORES))
    beta = 0.1
    rewards = [s - beta * k for s, k in zip(SCORES, seq_kl.tolist(), strict=True)]
    expected = [0.0] * len(SCORES)
    for rows in _by_group(SCORES, GROUP).values():
        for i in rows:
            others = [rewards[j] for j in rows if j != i]
            expected[i] = rewards[i] - _mean(others) if others else 0.0
    adv, r = rloo_trl_advantages(scores, group, seq_kl, beta)
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert r.tolist() == pytest.approx(rewards, abs=1e-6)
    assert leave_one_out(torch.tensor(rewards), group).tolist() == pytest.approx(expected, abs=1e-6)
    normed, _ = rloo_trl_advantages(scores, group, seq_kl, beta, normalize_advantages=True)
    m, s = _mean(expected), _std(expected)
    assert normed.tolist() == pytest.approx([(a - m) / (s + 1e-4) for a in expected], abs=1e-5)


def _openrlhf_loop(scores, group, lp, ref, mask, estimator, kl_coef, gamma, whiten):
    n_rows, n_cols = len(mask), len(mask[0])
    groups = _by_group(scores, group)
    shaped = list(scores)
    for rows in groups.values():
        xs = [scores[i] for i in rows]
        for i in rows:
            if estimator == "rloo":
                shaped[i] = scores[i] - (sum(xs) - scores[i]) / (len(xs) - 1)
            elif estimator == "reinforce_plus_plus_baseline":
                shaped[i] = scores[i] - _mean(xs)
    if estimator != "reinforce_plus_plus":
        gamma = 1.0
    returns = [[0.0] * n_cols for _ in range(n_rows)]
    for b in range(n_rows):
        valid = [t for t in range(n_cols) if mask[b][t]]
        r = [0.0] * n_cols
        for t in valid:
            r[t] = -kl_coef * max(-10.0, min(10.0, lp[b][t] - ref[b][t]))
        if valid:
            r[valid[-1]] += shaped[b]
        run = 0.0
        for t in reversed(range(n_cols)):
            run = r[t] + gamma * run
            returns[b][t] = run if mask[b][t] else 0.0
    if whiten:
        vals = [returns[b][t] for b in range(n_rows) for t in range(n_cols) if mask[b][t]]
        m = _mean(vals)
        var = sum((v - m) ** 2 for v in vals) / len(vals)  # plain variance
        for b in range(n_rows):
            for t in range(n_cols):
                returns[b][t] = (returns[b][t] - m) / math.sqrt(max(var, 1e-8)) if mask[b][t] else 0.0
    return returns


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_openrlhf_advantages_match_a_loop(estimator):
    gen = torch.Generator().manual_seed(0)
    scores = [1.0, 0.0, 2.0, 0.5, -1.0, 0.25]
    group = [0, 0, 0, 1, 1, 1]
    n_rows, n_cols = 6, 5
    lp = -torch.rand(n_rows, n_cols, generator=gen) * 3
    ref = -torch.rand(n_rows, n_cols, generator=gen) * 3
    ref[0, 0] = -40.0  # a log-ratio past the clamp
    lengths = [5, 3, 1, 4, 2, 5]
    mask = torch.tensor([[t < n for t in range(n_cols)] for n in lengths])
    lp[~mask] = -math.inf  # whatever sits on padding must not matter
    whiten = estimator != "rloo"
    adv, _ = openrlhf_advantages(
        torch.tensor(scores), torch.tensor(group), lp, ref, mask, estimator, kl_coef=0.1, gamma=0.9
    )
    expected = _openrlhf_loop(scores, group, lp.tolist(), ref.tolist(), mask.tolist(), estimator, 0.1, 0.9, whiten)
    assert torch.isfinite(adv).all()
    assert adv.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]


def test_reinforce_whitening_uses_the_plain_variance():
    """OpenRLHF normalises with the biased variance; the unbiased one would scale by sqrt((N-1)/N)."""
    mask = torch.ones(2, 2, dtype=torch.bool)
    zeros = torch.zeros(2, 2)
    adv, _ = openrlhf_advantages(
        torch.tensor([1.0, 3.0]), torch.tensor([0, 1]), zeros, zeros, mask, "reinforce_plus_plus"
    )
    # returns are [1, 1, 3, 3]: mean 2, plain variance 1 -> exactly -1, 1
    assert adv.tolist() == [[-1.0, -1.0], [1.0, 1.0]]


def _loss_loop(lp, old, adv, mask, ref, *, loss_type, eps_lo, eps_hi, level, beta, bias, emask, max_len, num_items):
    n_rows, n_cols = len(lp), len(lp[0])
    rows = []
    for b in range(n_rows):
        valid = [t for t in range(n_cols) if mask[b][t]]
        if level == "sequence":
            lw = sum(lp[b][t] - old[b][t] for t in valid) / max(len(valid), 1)
        per = []
        for t in range(n_cols):
            coef = math.exp(lw if level == "sequence" else lp[b][t] - old[b][t])
            clipped = min(max(coef, 1 - eps_lo), 1 + eps_hi)
            x = -min(coef * adv[b], clipped * adv[b])
            if emask is not None and not emask[b][t]:
                x = 0.0
            if beta:
                d = ref[b][t] - lp[b][t]
                k = math.exp(d) - d - 1
                x += beta * (k * coef if bias else k)
            per.append(x if mask[b][t] else 0.0)
        rows.append(per)
    n = sum(sum(1 for t in range(n_cols) if mask[b][t]) for b in range(n_rows))
    total = sum(sum(r) for r in rows)
    if loss_type == "grpo":
        return _mean([sum(rows[b]) / max(1, sum(mask[b])) for b in range(n_rows)])
    if loss_type == "bnpo":
        return total / n
    if loss_type == "dr_grpo":
        return total / (n_rows * max_len)
    return total / num_items


LOSS_CASES = [
    dict(loss_type="grpo", level="token", beta=0.0, bias=True, entropy=False),
    dict(loss_type="bnpo", level="token", beta=0.04, bias=True, entropy=False),
    dict(loss_type="dr_grpo", level="token", beta=0.04, bias=False, entropy=True),
    dict(loss_type="dapo", level="token", beta=0.1, bias=True, entropy=False),
    dict(loss_type="grpo", level="sequence", beta=0.04, bias=True, entropy=True),
    dict(loss_type="dapo", level="sequence", beta=0.0, bias=True, entropy=False),
]


@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: f"{c['loss_type']}-{c['level']}-b{c['beta']}")
def test_grpo_loss_matches_a_loop(case):
    gen = torch.Generator().manual_seed(1)
    n_rows, n_cols = 4, 6
    old = -torch.rand(n_rows, n_cols, generator=gen) * 2 - 0.1
    lp = (old + 0.3 * torch.randn(n_rows, n_cols, generator=gen)).requires_grad_(True)
    ref = old + 0.2 * torch.randn(n_rows, n_cols, generator=gen)
    adv = torch.tensor([1.5, -0.7, 0.2, -2.0])
    mask = torch.tensor([[t < n for t in range(n_cols)] for n in (6, 3, 1, 0)])  # an empty row too
    emask = (torch.rand(n_rows, n_cols, generator=gen) > 0.4) & mask if case["entropy"] else None
    kw = dict(
        loss_type=case["loss_type"],
        eps_lo=0.2,
        eps_hi=0.28,
        level=case["level"],
        beta=case["beta"],
        bias=case["bias"],
        emask=None if emask is None else emask.tolist(),
        max_len=8,
        num_items=7.5,
    )
    loss, stats = grpo_loss(
        lp,
        old,
        adv,
        mask,
        loss_type=case["loss_type"],
        epsilon=0.2,
        epsilon_high=0.28,
        importance_sampling_level=case["level"],
        ref_logprobs=ref,
        beta=case["beta"],
        use_bias_correction_kl=case["bias"],
        entropy_mask=emask,
        max_completion_length=8,
        num_items=7.5,
    )
    expected = _loss_loop(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), ref.tolist(), **kw)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()
    assert 0.0 <= stats["clip_ratio/region_mean"].item() <= 1.0


def test_masked_positions_never_make_nan():
    """A padded position with log-prob -inf (or NaN) leaves the loss and its gradient finite, beta > 0 included."""
    n_rows, n_cols = 3, 5
    mask = torch.tensor([[t < n for t in range(n_cols)] for n in (5, 2, 3)])
    base = torch.full((n_rows, n_cols), -1.0)
    lp = base.clone().masked_fill(~mask, -math.inf).requires_grad_(True)
    old = base.clone().masked_fill(~mask, math.nan)
    ref = torch.full((n_rows, n_cols), -1.3).masked_fill(~mask, -math.inf)
    adv = torch.tensor([1.0, -1.0, 0.5])
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        for level in ("token", "sequence"):
            lp.grad = None
            loss, stats = grpo_loss(
                lp,
                old,
                adv,
                mask,
                loss_type=loss_type,
                importance_sampling_level=level,
                ref_logprobs=ref,
                beta=0.5,
                max_completion_length=n_cols,
                num_items=4.0,
            )
            loss.backward()
            assert torch.isfinite(loss), (loss_type, level)
            assert torch.isfinite(lp.grad).all(), (loss_type, level)
            assert all(torch.isfinite(v).all() for v in stats.values())
    seq_loss, _ = rloo_trl_loss(lp, torch.tensor([-5.0, -2.0, -3.0]), adv, mask)
    seq_loss.backward()
    assert torch.isfinite(seq_loss) and torch.isfinite(lp.grad).all()
    adv_tok, _ = openrlhf_advantages(
        torch.ones(3), torch.zeros(3, dtype=torch.long), lp.detach(), ref, mask, "reinforce_plus_plus", kl_coef=0.1
    )
    assert torch.isfinite(adv_tok).all()
    x = torch.tensor([[1.0, math.inf], [2.0, math.nan]])
    m = torch.tensor([[True, False], [True, False]])
    assert masked_mean(x, m).item() == 1.5 and masked_sum(x, m, dim=1).tolist() == [1.0, 2.0]


def test_rloo_trl_loss_is_one_clipped_ratio_per_sequence():
    lp = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, 7.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    old = torch.tensor([-3.5, -0.1])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = rloo_trl_loss(lp, old, adv, mask, epsilon=0.2, epsilon_high=0.3)
    r0, r1 = math.exp(-3.0 + 3.5), math.exp(-0.5 + 0.1)
    expected = _mean([-min(r0 * 1.0, min(max(r0, 0.8), 1.3) * 1.0), -min(r1 * -2.0, min(max(r1, 0.8), 1.3) * -2.0)])
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clip_ratio/high_mean"].item() == 0.5 and stats["clip_ratio/low_mean"].item() == 0.5


def test_top_entropy_mask_keeps_the_top_quantile():
    ent = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    valid = sorted(ent[mask].tolist())
    q = 0.25
    thr = torch.quantile(torch.tensor(valid), 1 - q).item()
    got = top_entropy_mask(ent, mask, q)
    assert got.tolist() == [
        [bool(m and e >= thr) for e, m in zip(er, mr, strict=True)]
        for er, mr in zip(ent.tolist(), mask.tolist(), strict=True)
    ]
    assert not got[0, 3]  # padding never kept, however high its entropy
    assert top_entropy_mask(ent, mask, 1.0).equal(mask)


def test_completion_mask_cuts_after_eos_and_can_drop_truncated_completions():
    eos, pad = 2, 0
    responses = torch.tensor([[5, eos, 7, 8], [5, 6, 7, 8], [5, 6, pad, pad]])
    cut, mask, ends = completion_mask(responses, eos, pad)
    assert cut.tolist() == [[5, eos, pad, pad], [5, 6, 7, 8], [5, 6, pad, pad]]
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, True, False, False]]
    assert ends.tolist() == [True, False, False]
    _, dropped, _ = completion_mask(responses, eos, pad, mask_truncated=True)
    assert dropped.tolist() == [[True, True, False, False], [False] * 4, [False] * 4]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
def test_critic_free_advantages_dispatch_to_each_estimators_formula(estimator):
    g = torch.Generator().manual_seed(0)
    scores, group = torch.randn(6, generator=g), torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.rand(6, 5, generator=g) > 0.3
    old = torch.where(mask, -torch.rand(6, 5, generator=g), torch.zeros(()))
    ref = torch.where(mask, -torch.rand(6, 5, generator=g), torch.zeros(()))
    adv, kl = critic_free_advantages(estimator, scores, group, old, ref, mask, beta=0.1, kl_estimator="kl")
    assert torch.equal(kl, kl_estimate(old, ref, "kl"))
    if estimator == "grpo":
        want = grpo_advantages(scores, group, "group")
    elif estimator == "rloo":  # TRL's convention: the summed KL folded in before the leave-one-out baseline
        want, _ = rloo_trl_advantages(scores, group, masked_sum(kl, mask, dim=1), 0.1, normalize_advantages=False)
    else:
        want, _ = openrlhf_advantages(scores, group, old, ref, mask, estimator, 0.1, "kl", 1.0, whiten=False)
    assert torch.equal(adv, want)


def test_dpo_pairs_take_the_first_two_rows_of_each_prompt():
    assert dpo_pairs(torch.tensor([0, 0, 0, 1, 2, 2])) == ([0, 4], [1, 5])
    assert dpo_pairs(torch.tensor([3, 1, 3, 1])) == ([1, 0], [3, 2])
