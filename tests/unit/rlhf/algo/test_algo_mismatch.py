"""rlhf.algo.mismatch: the trainer-inference log-prob mismatch, against a naive loop."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo import kl_estimate, logprob_mismatch


def _naive(lp, samp, mask, rows):
    """Token by token: k3 = exp(d) - 1 - d with d = trainer - sampler, over the masked tokens of the chosen rows."""
    total, count, biggest = 0.0, 0, 0.0
    per_row = []
    for i in range(len(lp)):
        row_sum, row_n = 0.0, 0
        for t in range(len(lp[i])):
            if not (mask[i][t] and rows[i]):
                continue
            d = lp[i][t] - samp[i][t]
            row_sum += math.exp(d) - 1.0 - d
            row_n += 1
            biggest = max(biggest, abs(d))
        per_row.append((row_sum, row_n))
        total += row_sum
        count += row_n
    return (total / count if count else 0.0), biggest, count, per_row


def test_matches_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    samp = lp + 0.3 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 0, 5, 1])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    rows = torch.tensor([True, True, True, False, True])
    lp[~mask] = float("-inf")  # padding may hold anything: it must not reach the result
    samp[~mask] = 0.0
    got = logprob_mismatch(lp, samp, mask, rows)
    kl, biggest, count, per_row = _naive(lp.tolist(), samp.tolist(), mask.tolist(), rows.tolist())
    assert got["kl"].item() == pytest.approx(kl, abs=1e-12)
    assert got["max_abs"].item() == pytest.approx(biggest, abs=1e-12)
    assert got["tokens"].item() == count == 7 + 3 + 1
    assert got["row_kl_sum"].tolist() == pytest.approx([s for s, _ in per_row], abs=1e-12)
    assert got["row_tokens"].tolist() == [n for _, n in per_row]


def test_direction_is_k3_of_kl_sampler_to_trainer():
    lp, samp = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -0.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # kl_estimate(pi, ref, "k3") estimates KL(pi || ref) from samples of pi: here pi is the sampler
    expected = kl_estimate(samp, lp, "k3").mean()
    assert logprob_mismatch(lp, samp, mask)["kl"].item() == pytest.approx(expected.item())
    d = torch.tensor([0.5, -1.5])
    assert logprob_mismatch(lp, samp, mask)["kl"].item() == pytest.approx((d.exp() - 1 - d).mean().item())


def test_equal_logprobs_give_zero_and_no_token_gives_zero_not_nan():
    lp = torch.tensor([[-0.2, -1.0, -3.0]])
    mask = torch.tensor([[True, True, False]])
    same = logprob_mismatch(lp, lp.clone(), mask)
    assert same["kl"].item() == 0.0 and same["max_abs"].item() == 0.0 and same["tokens"].item() == 2
    none = logprob_mismatch(lp, lp + 1.0, mask, rows=torch.tensor([False]))
    assert none["kl"].item() == 0.0 and none["max_abs"].item() == 0.0 and none["tokens"].item() == 0


def test_bf16_inputs_are_computed_in_float32():
    lp = torch.full((1, 4), -2.0, dtype=torch.bfloat16)
    samp = lp.float() - 1e-3  # below bf16's resolution at -2
    got = logprob_mismatch(lp, samp, torch.ones(1, 4, dtype=torch.bool))
    assert got["kl"].dtype == torch.float32
    assert got["max_abs"].item() == pytest.approx(1e-3, rel=1e-3)
