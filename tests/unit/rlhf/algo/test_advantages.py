"""rlhf.algo.advantages against naive loops: GAE, group baselines, discounted returns."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo import GROUP_ESTIMATORS, discounted_returns, gae, group_advantages, token_advantages_from_sequence


def _rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _naive_gae(rewards, values, mask=None, gamma=1.0, lam=0.95):
    """A_t = sum_k (gamma * lam)^k delta_{t+k}, delta_t = r_t + gamma V_{t+1} - V_t, V_L = 0; plain Python."""
    n_rows, n_cols = len(rewards), len(rewards[0])
    if mask is not None:
        rewards = [[r * m for r, m in zip(rr, mm, strict=True)] for rr, mm in zip(rewards, mask, strict=True)]
        values = [[v * m for v, m in zip(vv, mm, strict=True)] for vv, mm in zip(values, mask, strict=True)]
    adv, ret = [], []
    for b in range(n_rows):
        delta = [
            rewards[b][t] + gamma * (values[b][t + 1] if t + 1 < n_cols else 0.0) - values[b][t] for t in range(n_cols)
        ]
        row = [sum((gamma * lam) ** k * delta[t + k] for k in range(n_cols - t)) for t in range(n_cols)]
        adv.append(row)
        ret.append([a + v for a, v in zip(row, values[b], strict=True)])
    return adv, ret


def _assert_close(got: torch.Tensor, expected, tol=1e-10):
    assert list(got.shape) == [len(expected), len(expected[0])]
    for g, e in zip(got.tolist(), expected, strict=True):
        assert g == pytest.approx(e, abs=tol)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_double_loop(gamma, lam):
    rewards, values = _rand((3, 6), 0), _rand((3, 6), 1)
    adv, ret = gae(rewards, values, gamma=gamma, lam=lam)
    exp_adv, exp_ret = _naive_gae(rewards.tolist(), values.tolist(), gamma=gamma, lam=lam)
    _assert_close(adv, exp_adv)
    _assert_close(ret, exp_ret)


def test_gae_with_mask_zeroes_outside_first():
    rewards, values = _rand((3, 5), 2), _rand((3, 5), 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask=mask, gamma=0.95, lam=0.9)
    exp_adv, exp_ret = _naive_gae(rewards.tolist(), values.tolist(), mask.int().tolist(), gamma=0.95, lam=0.9)
    _assert_close(adv, exp_adv)
    _assert_close(ret, exp_ret)
    # past the mask both are 0 (rewards and values were zeroed there)
    assert adv[0, 3:].abs().sum().item() == 0.0 and ret[2, 1:].abs().sum().item() == 0.0
    # and the masked result differs from the unmasked one
    assert not torch.allclose(adv, gae(rewards, values, gamma=0.95, lam=0.9)[0])


def test_gae_length_one_response():
    # L = 1: A = r - V (V_1 = 0), return = r
    adv, ret = gae(torch.tensor([[2.0], [-1.0]]), torch.tensor([[0.5], [0.25]]))
    assert adv.tolist() == [[1.5], [-1.25]]
    assert ret.tolist() == [[2.0], [-1.0]]


def test_gae_length_one_row_in_wider_batch():
    rewards = torch.tensor([[3.0, 7.0, 7.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[1.0, 9.0, 9.0], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv, ret = gae(rewards, values, mask=mask, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == [2.0, 0.0, 0.0]
    assert ret[0].tolist() == [3.0, 0.0, 0.0]
    # gamma = lam = 1: A_t = sum_{k>=t} r_k - V_t
    assert adv[1].tolist() == pytest.approx([0.5, 0.5, 0.5])


def test_gae_hand_values():
    # r = [0, 1], V = [0.5, 0.25], gamma = 1, lam = 0.5:
    # delta_1 = 1 - 0.25 = 0.75, delta_0 = 0 + 0.25 - 0.5 = -0.25; A_1 = 0.75, A_0 = -0.25 + 0.5 * 0.75 = 0.125
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), gamma=1.0, lam=0.5)
    assert adv.tolist() == [[0.125, 0.75]]
    assert ret.tolist() == [[0.625, 1.0]]


# ---------------------------------------------------------------------------------------------- group estimators

SCORES = [1.0, 2.0, 4.0, 0.0, 0.0, 3.0, -1.0, 5.0]  # two prompts, four samples each


def _groups(xs, n):
    return [xs[i : i + n] for i in range(0, len(xs), n)]


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    mu = _mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def test_grpo_group_scale():
    got = group_advantages(torch.tensor(SCORES), 4, "grpo", eps=1e-6)
    expected = [(x - _mean(g)) / (_std(g) + 1e-6) for g in _groups(SCORES, 4) for x in g]
    assert got.tolist() == pytest.approx(expected, rel=1e-5)
    assert got.dtype == torch.float32


def test_group_norm_is_grpo_alias():
    a = group_advantages(torch.tensor(SCORES), 4, "group_norm")
    b = group_advantages(torch.tensor(SCORES), 4, "grpo")
    assert torch.equal(a, b)


def test_grpo_batch_scale():
    got = group_advantages(torch.tensor(SCORES), 4, "grpo", eps=1e-4, scale="batch")
    std = _std(SCORES)
    expected = [(x - _mean(g)) / (std + 1e-4) for g in _groups(SCORES, 4) for x in g]
    assert got.tolist() == pytest.approx(expected, rel=1e-5)


def test_grpo_no_scale_and_dr_grpo_are_centred():
    expected = [x - _mean(g) for g in _groups(SCORES, 4) for x in g]
    assert group_advantages(torch.tensor(SCORES), 4, "grpo", scale="none").tolist() == pytest.approx(expected)
    assert group_advantages(torch.tensor(SCORES), 4, "dr_grpo").tolist() == pytest.approx(expected)


def test_grpo_constant_group_is_zero():
    got = group_advantages(torch.tensor([1.0, 1.0, 1.0, 2.0, 4.0, 6.0]), 3, "grpo")
    assert got[:3].tolist() == [0.0, 0.0, 0.0]
    assert got[3:].tolist() == pytest.approx([-2 / (2 + 1e-4), 0.0, 2 / (2 + 1e-4)], rel=1e-6)  # std 2, TRL's eps


def test_grpo_group_size_one_is_zero_not_nan():
    got = group_advantages(torch.tensor([3.0, -2.0]), 1, "grpo")
    assert got.tolist() == [0.0, 0.0]


def test_rloo_leave_one_out():
    got = group_advantages(torch.tensor(SCORES), 4, "rloo")
    expected = []
    for g in _groups(SCORES, 4):
        for i, x in enumerate(g):
            others = g[:i] + g[i + 1 :]
            expected.append(x - _mean(others))
    assert got.tolist() == pytest.approx(expected)
    assert got[:4].tolist() == pytest.approx([1.0 - 2.0, 2.0 - 5.0 / 3, 4.0 - 1.0, 0.0 - 7.0 / 3])


def test_rloo_is_scaled_centring():
    # r - mean(others) == n / (n - 1) * (r - mean)
    got = group_advantages(torch.tensor(SCORES), 4, "rloo")
    centred = group_advantages(torch.tensor(SCORES), 4, "dr_grpo")
    assert torch.allclose(got, centred * 4 / 3, atol=1e-6)


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="rloo"):
        group_advantages(torch.tensor([1.0, 2.0]), 1, "rloo")


def test_reinforce_plus_plus_variants():
    assert group_advantages(torch.tensor(SCORES), 4, "reinforce_plus_plus").tolist() == SCORES
    expected = [x - _mean(g) for g in _groups(SCORES, 4) for x in g]
    got = group_advantages(torch.tensor(SCORES), 4, "reinforce_plus_plus_baseline")
    assert got.tolist() == pytest.approx(expected)


def test_group_estimators_listed():
    assert set(GROUP_ESTIMATORS) == {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "dr_grpo"}


@pytest.mark.parametrize(("n_scores", "group_size"), [(5, 2), (4, 0), (4, -2), (3, 4)])
def test_bad_group_sizes(n_scores, group_size):
    with pytest.raises(ValueError, match="groups of"):
        group_advantages(torch.arange(float(n_scores)), group_size, "grpo")


def test_unknown_estimator_and_scale():
    with pytest.raises(ValueError, match="'ppo'"):
        group_advantages(torch.zeros(4), 2, "ppo")
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.arange(4.0), 2, "grpo", scale="global")


# ---------------------------------------------------------------------------------------------- returns


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns_matches_loop(gamma):
    rewards = _rand((3, 5), 7)
    mask = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]
    got = discounted_returns(rewards, torch.tensor(mask), gamma=gamma)
    r = rewards.tolist()
    expected = [
        [m[t] * sum(gamma ** (k - t) * r[b][k] * m[k] for k in range(t, 5)) for t in range(5)]
        for b, m in enumerate(mask)
    ]
    _assert_close(got, expected)


def test_discounted_returns_hand_values():
    got = discounted_returns(torch.tensor([[1.0, 2.0, 4.0, 8.0]]), torch.tensor([[1, 1, 1, 0]]), gamma=0.5)
    # G_2 = 4, G_1 = 2 + 0.5 * 4 = 4, G_0 = 1 + 0.5 * 4 = 3, G_3 masked (its reward 8 is ignored)
    assert got.tolist() == [[3.0, 4.0, 4.0, 0.0]]


def test_token_advantages_from_sequence():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert token_advantages_from_sequence(adv, mask).tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]
    got = token_advantages_from_sequence(adv, mask, whiten=True)
    xs = [2.0, 2.0, -1.0]
    mu, sd = _mean(xs), _std(xs)
    expected = [[(2.0 - mu) / sd, (2.0 - mu) / sd, 0.0], [(-1.0 - mu) / sd, 0.0, 0.0]]
    _assert_close(got, expected, tol=1e-5)
