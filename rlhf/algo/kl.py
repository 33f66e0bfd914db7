"""KL estimators, KL-penalised per-token rewards, and KL coefficient controllers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from rlhf.algo.shaping import penalize_missing_eos

# Names users know from TRL (k1/k3), veRL/MindSpeed-LLM (kl, abs, mse, low_var_kl) and Schulman's note (k1, k2, k3).
KL_ESTIMATORS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1", clamp: float | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from log-probs of the sampled tokens (http://joschu.net/blog/kl-approx.html).

    logprobs, ref_logprobs: (B, L) -> (B, L).
      k1 (``kl``):          log pi - log ref            (unbiased, can be negative per token)
      k2 (``mse``):         0.5 * (log pi - log ref)^2
      k3 (``low_var_kl``):  exp(ref - pi) - 1 - (ref - pi)   (unbiased, never negative)
      abs:                  |log pi - log ref|
    ``clamp`` bounds the result to [-clamp, clamp] (OpenRLHF and veRL use 10).
    """
    try:
        canonical = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(KL_ESTIMATORS)}") from None
    # At least float32 (bf16 log ratios are too coarse), but never downcast float64 inputs.
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, ref_logprobs.dtype), torch.float32)
    log_ratio = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if canonical == "k1":
        kl = log_ratio
    elif canonical == "k2":
        kl = 0.5 * log_ratio.square()
    elif canonical == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        kl = log_ratio.abs()
    return kl.clamp(-clamp, clamp) if clamp is not None else kl


@dataclass
class KLRewards:
    rewards: torch.Tensor  # (B, L) -kl_coef * kl, plus the score at its position
    kl: torch.Tensor  # (B, L) per-token estimate, 0 past the response
    non_score_reward: torch.Tensor  # (B, L) -kl_coef * kl
    scores: torch.Tensor  # (B,) after the missing-EOS penalty
    score_index: torch.Tensor  # (B,) column that received the score


def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    sequence_lengths: torch.Tensor,
    kl_coef: float,
    kl_estimator: str = "k1",
    score_position: Literal["trl", "last_token"] = "trl",
    contains_eos: torch.Tensor | None = None,
    missing_eos_penalty: float | None = None,
    kl: torch.Tensor | None = None,
) -> KLRewards:
    """Per-token rewards ``-kl_coef * KL_t`` with the sequence score added at one position.

    scores: (B,); logprobs, ref_logprobs: (B, L); sequence_lengths: (B,) index of the last response token
    (``ell``, -1 for an empty response). Tokens after ``ell`` get no KL.

    score_position:
      ``trl``        TRL PPO: column ``ell + 1`` (the first pad slot) when it exists, else ``ell``.
      ``last_token`` OpenRLHF / MindSpeed-LLM: the last response token ``ell`` (column 0 for an empty response).
    ``missing_eos_penalty`` is subtracted from the score of rows whose ``contains_eos`` is False.
    ``kl``: a (B, L) per-token KL computed elsewhere (``full_kl``), used instead of ``kl_estimator``.
    """
    batch, length = logprobs.shape
    idx = torch.arange(length, device=logprobs.device)
    valid = idx[None, :] <= sequence_lengths[:, None]
    per_token = kl_estimate(logprobs, ref_logprobs, kl_estimator) if kl is None else kl
    kl = torch.where(valid, per_token, torch.zeros((), device=logprobs.device))
    non_score_reward = -kl_coef * kl
    scores = scores.to(non_score_reward.dtype)
    if missing_eos_penalty:
        if contains_eos is None:
            raise ValueError("missing_eos_penalty needs contains_eos")
        scores = penalize_missing_eos(scores, contains_eos, missing_eos_penalty)
    if score_position == "trl":
        end = torch.where(sequence_lengths + 1 < length, sequence_lengths + 1, sequence_lengths)
    elif score_position == "last_token":
        end = sequence_lengths.clamp(min=0)
    else:
        raise ValueError(f"score_position must be 'trl' or 'last_token', got {score_position!r}")
    end = end.clamp(min=0, max=length - 1)
    rewards = non_score_reward.clone()
    rewards[torch.arange(batch, device=rewards.device), end] += scores
    return KLRewards(rewards=rewards, kl=kl, non_score_reward=non_score_reward, scores=scores, score_index=end)


class FixedKLController:
    """A constant KL coefficient (``kl_ctrl.type: fixed``)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), as in veRL/MindSpeed-LLM and OpenRLHF.

    After each batch: ``error = clip(current_kl / target_kl - 1, -0.2, 0.2)``;
    ``value *= 1 + error * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("adaptive KL needs target_kl > 0 and horizon > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            return  # a NaN batch must not destroy the coefficient
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by ``kl_ctrl.type`` (``fixed`` or ``adaptive``)."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if target_kl is None:
            raise ValueError("kl_ctrl.type 'adaptive' needs kl_ctrl.target_kl")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"kl_ctrl.type must be 'fixed' or 'adaptive', got {type!r}")


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Exact per-token KL(pi || ref) over the whole vocabulary (TRL's ``kl_penalty="full"``).

    logits, ref_logits: (B, L, V) at the response positions -> (B, L) ``sum_v pi(v) (log pi(v) - log ref(v))`` of the
    softmax at ``temperature``; computed in float32 at least.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    ref_logp = torch.log_softmax(ref_logits.to(dtype) / temperature, dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)
