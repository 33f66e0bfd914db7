"""rlhf.algo.logprobs against an explicit log-softmax loop."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo import entropy_from_logits, logprobs_from_logits


def _naive_log_softmax(row, temperature=1.0):
    z = [x / temperature for x in row]
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def _logits(seed=0, shape=(2, 3, 7), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.0 + 1e-7, 2.5])
def test_logprobs_match_loop(temperature):
    logits = _logits()
    tokens = torch.tensor([[0, 6, 3], [2, 2, 5]])
    got = logprobs_from_logits(logits, tokens, temperature=temperature)
    assert got.shape == (2, 3)
    assert got.dtype == torch.float64
    for b in range(2):
        for t in range(3):
            expected = _naive_log_softmax(logits[b, t].tolist(), temperature)[tokens[b, t].item()]
            assert got[b, t].item() == pytest.approx(expected, abs=1e-12)


def test_logprobs_hand_value():
    # uniform over 4 tokens -> log(1/4) for any token, any temperature
    got = logprobs_from_logits(torch.zeros(1, 4), torch.tensor([2]), temperature=0.3)
    assert got.item() == pytest.approx(-math.log(4.0), abs=1e-6)
    # logits [0, log 3] -> p = [1/4, 3/4]
    got = logprobs_from_logits(torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([1]))
    assert got.item() == pytest.approx(math.log(0.75), abs=1e-6)


def test_logprobs_temperature_changes_result():
    logits, tokens = _logits(), torch.zeros(2, 3, dtype=torch.long)
    assert not torch.allclose(logprobs_from_logits(logits, tokens), logprobs_from_logits(logits, tokens, 0.5))


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_logprobs_bad_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(_logits(), torch.zeros(2, 3, dtype=torch.long), temperature=temperature)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logprobs_half_input_returns_fp32(dtype):
    logits = _logits().to(dtype)
    tokens = torch.tensor([[0, 6, 3], [2, 2, 5]])
    got = logprobs_from_logits(logits, tokens, temperature=0.9)
    assert got.dtype == torch.float32
    # computed from the upcast logits, not in half precision
    up = logits.double()
    for b in range(2):
        for t in range(3):
            expected = _naive_log_softmax(up[b, t].tolist(), 0.9)[tokens[b, t].item()]
            assert got[b, t].item() == pytest.approx(expected, abs=1e-5)


def test_logprobs_float32_stays_float32():
    got = logprobs_from_logits(_logits().float(), torch.zeros(2, 3, dtype=torch.long))
    assert got.dtype == torch.float32


def test_logprobs_large_logits_are_stable():
    logits = torch.tensor([[1000.0, 0.0, -1000.0]])
    got = logprobs_from_logits(logits.expand(3, 3), torch.tensor([0, 1, 2]))
    assert torch.isfinite(got).all()
    assert got.tolist() == pytest.approx([0.0, -1000.0, -2000.0], abs=1e-3)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_matches_loop(temperature):
    logits = _logits(seed=3)
    got = entropy_from_logits(logits, temperature=temperature)
    assert got.shape == (2, 3)
    for b in range(2):
        for t in range(3):
            lp = _naive_log_softmax(logits[b, t].tolist(), temperature)
            expected = -sum(math.exp(x) * x for x in lp)
            assert got[b, t].item() == pytest.approx(expected, abs=1e-10)


def test_entropy_hand_values():
    got = entropy_from_logits(torch.tensor([[0.0] * 5, [50.0, 0.0, 0.0, 0.0, 0.0]]))
    assert got[0].item() == pytest.approx(math.log(5.0), abs=1e-6)
    assert got[1].item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_bf16_returns_fp32():
    got = entropy_from_logits(_logits().to(torch.bfloat16))
    assert got.dtype == torch.float32
