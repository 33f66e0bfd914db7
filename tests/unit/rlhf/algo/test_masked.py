"""rlhf.algo.masked against plain-Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo import masked_mean, masked_sum, masked_var, masked_whiten

VALUES = [[1.0, -2.0, 3.5, 100.0], [0.5, 4.0, -7.0, 2.0], [9.0, 9.0, 9.0, 9.0]]
MASK = [[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]]  # padding in rows 0/1, row 2 all masked


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _selected(values=VALUES, mask=MASK):
    return [v for row, mrow in zip(values, mask, strict=True) for v, m in zip(row, mrow, strict=True) if m]


def _naive_mean(xs):
    return sum(xs) / len(xs)


def _naive_var(xs, unbiased=True):
    mu = _naive_mean(xs)
    ss = sum((x - mu) ** 2 for x in xs)
    n = len(xs)
    return ss / (n - 1) if unbiased and n > 1 else ss / n


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64, torch.long])
def test_masked_sum_scalar_and_per_row(mask_dtype):
    mask = torch.tensor(MASK).to(mask_dtype)
    assert masked_sum(_t(VALUES), mask).item() == pytest.approx(sum(_selected()))
    rows = masked_sum(_t(VALUES), mask, dim=1)
    expected = [sum(v for v, m in zip(r, mr, strict=True) if m) for r, mr in zip(VALUES, MASK, strict=True)]
    assert rows.tolist() == pytest.approx(expected)
    assert rows.tolist() == pytest.approx([2.5, -4.5, 0.0])


def test_masked_mean_scalar_is_token_mean():
    got = masked_mean(_t(VALUES), torch.tensor(MASK, dtype=torch.bool))
    assert got.item() == pytest.approx(_naive_mean(_selected()))
    assert got.item() == pytest.approx(-2.0 / 6.0)  # (1 - 2 + 3.5 + 0.5 - 7 + 2) / 6


def test_masked_mean_per_row_all_masked_row_is_zero():
    got = masked_mean(_t(VALUES), torch.tensor(MASK, dtype=torch.bool), dim=1)
    assert torch.isfinite(got).all()
    assert got.tolist() == pytest.approx([2.5 / 3, -4.5 / 3, 0.0])


def test_masked_mean_nothing_selected_is_zero_not_nan():
    got = masked_mean(_t(VALUES), torch.zeros(3, 4, dtype=torch.bool))
    assert got.item() == 0.0


def test_masked_mean_float32_all_masked_row():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = masked_mean(values, torch.tensor([[0.0, 0.0], [1.0, 1.0]]), dim=1)
    assert got.tolist() == [0.0, 3.5]


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_matches_loop(unbiased):
    got = masked_var(_t(VALUES), torch.tensor(MASK, dtype=torch.bool), unbiased=unbiased)
    assert got.item() == pytest.approx(_naive_var(_selected(), unbiased=unbiased), rel=1e-12)


def test_masked_var_unbiased_hand_value():
    # [1, 3] -> mean 2, squared deviations 1 + 1, unbiased 2 / 1 = 2, biased 1
    values, mask = _t([[1.0, 3.0, 50.0]]), torch.tensor([[1, 1, 0]])
    assert masked_var(values, mask).item() == pytest.approx(2.0)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(1.0)


def test_masked_var_single_element_is_zero():
    values, mask = _t([[5.0, -3.0, 8.0]]), torch.tensor([[0, 1, 0]])
    got = masked_var(values, mask)
    assert got.item() == 0.0


def test_masked_var_empty_mask_raises():
    with pytest.raises(ValueError, match="no element"):
        masked_var(_t(VALUES), torch.zeros(3, 4))


def test_masked_whiten_matches_loop():
    values, mask = _t(VALUES), torch.tensor(MASK, dtype=torch.bool)
    got = masked_whiten(values, mask)
    xs = _selected()
    mu, var = _naive_mean(xs), _naive_var(xs)
    expected = [[(v - mu) / math.sqrt(var + 1e-8) for v in row] for row in VALUES]
    assert got.tolist() == [pytest.approx(r, rel=1e-10) for r in expected]
    # the selected entries are standardised (unbiased variance 1, up to eps)
    sel = got[mask]
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert sel.var(unbiased=True).item() == pytest.approx(1.0, rel=1e-6)


def test_masked_whiten_shift_mean_false_adds_mean_back():
    values, mask = _t(VALUES), torch.tensor(MASK, dtype=torch.bool)
    got = masked_whiten(values, mask, shift_mean=False)
    xs = _selected()
    mu, var = _naive_mean(xs), _naive_var(xs)
    expected = [[(v - mu) / math.sqrt(var + 1e-8) + mu for v in row] for row in VALUES]
    assert got.tolist() == [pytest.approx(r, rel=1e-10) for r in expected]
    assert got[mask].mean().item() == pytest.approx(mu)


def test_masked_whiten_biased_and_eps():
    values, mask = _t([[1.0, 3.0, 0.0]]), torch.tensor([[1, 1, 0]])
    # biased var = 1, eps = 3 -> scale 1 / sqrt(4) = 0.5
    got = masked_whiten(values, mask, unbiased=False, eps=3.0)
    assert got.tolist() == [pytest.approx([-0.5, 0.5, -1.0])]


def test_masked_whiten_single_element_is_finite():
    got = masked_whiten(_t([[4.0, 0.0]]), torch.tensor([[1, 0]]))
    assert torch.isfinite(got).all()
    assert got[0, 0].item() == 0.0


def test_masked_whiten_empty_mask_raises():
    with pytest.raises(ValueError):
        masked_whiten(_t(VALUES), torch.zeros(3, 4, dtype=torch.bool))
