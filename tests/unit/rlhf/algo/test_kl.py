"""rlhf.algo.kl: estimators, KL-penalised rewards and the KL coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalized_rewards,
    make_kl_controller,
    penalize_missing_eos,
)

LP = [[-1.0, -0.5, -2.0], [-0.1, -3.0, -0.7]]
REF = [[-1.5, -0.5, -0.2], [-2.0, -1.0, -0.6]]

NAIVE = {
    "k1": lambda lp, ref: lp - ref,
    "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "k3": lambda lp, ref: math.exp(ref - lp) - 1.0 - (ref - lp),
    "abs": lambda lp, ref: abs(lp - ref),
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _naive(kind, lp=LP, ref=REF):
    f = NAIVE[ALIASES.get(kind, kind)]
    return [[f(a, b) for a, b in zip(ra, rb, strict=True)] for ra, rb in zip(lp, ref, strict=True)]


@pytest.mark.parametrize("kind", ["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"])
def test_kl_estimate_matches_formula(kind):
    got = kl_estimate(torch.tensor(LP, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64), kind)
    assert got.shape == (2, 3)
    for g, e in zip(got.tolist(), _naive(kind), strict=True):
        assert g == pytest.approx(e, abs=1e-12)


def test_kl_estimators_table_covers_all_names():
    assert set(KL_ESTIMATORS) == {"k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"}


def test_kl_estimate_hand_values():
    lp, ref = torch.tensor([[0.0]]), torch.tensor([[-1.0]])  # log ratio 1
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(-1.0) - 1.0 + 1.0, abs=1e-7)
    assert kl_estimate(ref, lp, "k1").item() == pytest.approx(-1.0)
    assert kl_estimate(ref, lp, "abs").item() == pytest.approx(1.0)


def test_kl_estimate_k3_nonnegative_and_zero_on_equal():
    lp = torch.tensor(LP)
    assert (kl_estimate(lp, torch.tensor(REF), "k3") >= 0).all()
    for kind in ("k1", "k2", "k3", "abs"):
        assert kl_estimate(lp, lp.clone(), kind).abs().max().item() == 0.0


def test_kl_estimate_low_precision_inputs_computed_in_fp32():
    got = kl_estimate(torch.tensor(LP, dtype=torch.bfloat16), torch.tensor(REF, dtype=torch.bfloat16), "k1")
    assert got.dtype == torch.float32


@pytest.mark.parametrize("kind", ["k1", "k3", "abs"])
def test_kl_estimate_clamp(kind):
    lp, ref = torch.tensor([[0.0, -30.0, 0.0]]), torch.tensor([[-30.0, 0.0, -0.5]])
    got = kl_estimate(lp, ref, kind, clamp=10.0)
    raw = _naive(kind, lp.tolist(), ref.tolist())[0]
    expected = [min(max(x, -10.0), 10.0) for x in raw]
    assert got[0].tolist() == pytest.approx(expected, rel=1e-6)
    assert got.abs().max().item() == pytest.approx(10.0)  # something actually got clamped


def test_kl_estimate_unknown_name():
    with pytest.raises(ValueError, match="'k4'"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 2), "k4")


# ---------------------------------------------------------------------------------------------- kl_penalized_rewards

B_LP = [[-1.0, -0.5, -2.0, -0.3], [-0.2, -0.4, -0.6, -0.8], [-1.1, -1.2, -1.3, -1.4]]
B_REF = [[-1.5, -0.5, -0.1, -0.9], [-0.3, -0.1, -1.6, -0.2], [-0.1, -0.2, -0.3, -0.4]]
ELL = [1, 3, -1]  # row 0: short response; row 1: full width; row 2: empty response
SCORES = [2.0, -1.0, 0.5]
COEF = 0.1


def _call(**kw):
    args = dict(
        scores=torch.tensor(SCORES, dtype=torch.float64),
        logprobs=torch.tensor(B_LP, dtype=torch.float64),
        ref_logprobs=torch.tensor(B_REF, dtype=torch.float64),
        sequence_lengths=torch.tensor(ELL),
        kl_coef=COEF,
    )
    args.update(kw)
    return kl_penalized_rewards(**args)


def _naive_rewards(ends, scores=SCORES, kind="k1"):
    kl = [[v if t <= ELL[b] else 0.0 for t, v in enumerate(row)] for b, row in enumerate(_naive(kind, B_LP, B_REF))]
    rewards = [[-COEF * v for v in row] for row in kl]
    for b, e in enumerate(ends):
        rewards[b][e] += scores[b]
    return kl, rewards


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_rewards_trl_placement(kind):
    out = _call(kl_estimator=kind)
    # ell + 1 when it exists (row 0 -> 2, empty row 2 -> 0), ell when the response fills the width (row 1 -> 3)
    assert out.score_index.tolist() == [2, 3, 0]
    kl, rewards = _naive_rewards([2, 3, 0], kind=kind)
    for got, exp in zip(out.kl.tolist(), kl, strict=True):
        assert got == pytest.approx(exp, abs=1e-12)
    for got, exp in zip(out.rewards.tolist(), rewards, strict=True):
        assert got == pytest.approx(exp, abs=1e-12)
    assert out.non_score_reward.tolist() == [pytest.approx([-COEF * v for v in r], abs=1e-12) for r in kl]
    assert out.scores.tolist() == SCORES


def test_kl_rewards_zero_past_ell():
    out = _call()
    assert out.kl[0, 2:].abs().sum().item() == 0.0
    assert out.kl[2].abs().sum().item() == 0.0
    assert (out.kl[1] != 0).all()
    # row 0: the score sits on a pad slot with no KL
    assert out.rewards[0, 2].item() == pytest.approx(SCORES[0])
    assert out.rewards[0, 3].item() == 0.0


def test_kl_rewards_last_token_placement():
    out = _call(score_position="last_token")
    assert out.score_index.tolist() == [1, 3, 0]
    _, rewards = _naive_rewards([1, 3, 0])
    for got, exp in zip(out.rewards.tolist(), rewards, strict=True):
        assert got == pytest.approx(exp, abs=1e-12)


def test_kl_rewards_placements_agree_only_on_full_width_rows():
    trl, last = _call(), _call(score_position="last_token")
    assert trl.score_index[1] == last.score_index[1] == 3
    assert trl.score_index[0] == last.score_index[0] + 1


def test_kl_rewards_missing_eos_penalty():
    contains_eos = torch.tensor([True, False, False])
    out = _call(contains_eos=contains_eos, missing_eos_penalty=1.5)
    expected_scores = [2.0, -2.5, -1.0]
    assert out.scores.tolist() == pytest.approx(expected_scores)
    _, rewards = _naive_rewards([2, 3, 0], scores=expected_scores)
    for got, exp in zip(out.rewards.tolist(), rewards, strict=True):
        assert got == pytest.approx(exp, abs=1e-12)


def test_kl_rewards_penalty_needs_contains_eos():
    with pytest.raises(ValueError, match="contains_eos"):
        _call(missing_eos_penalty=1.0)


def test_kl_rewards_bad_score_position():
    with pytest.raises(ValueError, match="score_position"):
        _call(score_position="first")


def test_kl_rewards_does_not_modify_inputs():
    lp = torch.tensor(B_LP, dtype=torch.float64)
    scores = torch.tensor(SCORES, dtype=torch.float64)
    _call(logprobs=lp, scores=scores, contains_eos=torch.tensor([False] * 3), missing_eos_penalty=1.0)
    assert lp.tolist() == B_LP and scores.tolist() == SCORES


# ---------------------------------------------------------------------------------------------- controllers


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(123.0, 64)
    ctl.update(float("nan"), 64)
    assert ctl.value == 0.05


def test_adaptive_controller_update_rule():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    expected = 0.1
    # inside the clip: error = 6.6 / 6 - 1 = 0.1
    ctl.update(6.6, 100)
    expected *= 1 + 0.1 * 100 / 10000
    assert ctl.value == pytest.approx(expected, rel=1e-12)
    # above: error 9 / 6 - 1 = 0.5 clipped to 0.2
    ctl.update(9.0, 256)
    expected *= 1 + 0.2 * 256 / 10000
    assert ctl.value == pytest.approx(expected, rel=1e-12)
    # below: error 0 / 6 - 1 = -1 clipped to -0.2
    ctl.update(0.0, 500)
    expected *= 1 - 0.2 * 500 / 10000
    assert ctl.value == pytest.approx(expected, rel=1e-12)
    # on target: unchanged
    ctl.update(6.0, 1000)
    assert ctl.value == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_adaptive_controller_ignores_non_finite(bad):
    ctl = AdaptiveKLController(0.2, 1.0, 100)
    ctl.update(bad, 10)
    assert ctl.value == 0.2


@pytest.mark.parametrize(("target", "horizon"), [(0.0, 10), (-1.0, 10), (1.0, 0)])
def test_adaptive_controller_bad_args(target, horizon):
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target, horizon)


def test_make_kl_controller():
    fixed = make_kl_controller("fixed", 0.05)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    adaptive = make_kl_controller("adaptive", 0.2, target_kl=3.0, horizon=50)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 3.0, 50)


def test_make_kl_controller_errors():
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="'linear'"):
        make_kl_controller("linear", 0.1)


def test_the_missing_eos_penalty_is_one_function_for_every_stage():
    scores, eos = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, False, True])
    assert penalize_missing_eos(scores, eos, 0.5).tolist() == [1.0, 1.5, 3.0]
    assert penalize_missing_eos(scores, eos, 0.0) is scores and penalize_missing_eos(scores, eos, None) is scores
