"""Advantage estimators: GAE for PPO, and the critic-free group baselines (GRPO, RLOO, REINFORCE++)."""

from __future__ import annotations

import torch

from rlhf.algo.masked import masked_whiten


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response axis.

    rewards, values: (B, L); mask: (B, L) or None -> (advantages, returns), both (B, L).
    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V_L = 0``; ``A_t = delta_t + gamma * lam * A_{t+1}``;
    ``returns = A + V``. With a mask, rewards and values are zeroed outside it first (OpenRLHF's convention); TRL
    passes tensors already zero past ``ell + 1`` and no mask, which gives the same numbers. Advantages are not whitened.
    """
    if mask is not None:
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        rewards, values = torch.where(mask.bool(), rewards, zero), torch.where(mask.bool(), values, zero)
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    return advantages, advantages + values


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "dr_grpo")


def group_advantages(
    scores: torch.Tensor,
    group_size: int,
    estimator: str = "grpo",
    eps: float = 1e-4,
    scale: str = "group",
) -> torch.Tensor:
    """Per-sequence advantages from ``n = group_size`` samples of each prompt, laid out contiguously.

    Equal-size groups only; the trainer uses ``rlhf.algo.critic_free`` (groups of any size). ``eps`` is TRL's 1e-4.
    scores: (G * n,) -> (G * n,).
      grpo / group_norm:             (r - mean_group) / (std_group + eps)   (unbiased std; ``scale="batch"`` uses the
                                     batch std, ``scale="none"`` skips the division as Dr. GRPO does)
      dr_grpo:                       r - mean_group
      rloo:                          r - mean of the other n - 1 samples of the group
      reinforce_plus_plus:           r (no baseline; whiten the token-level returns over the batch afterwards)
      reinforce_plus_plus_baseline:  r - mean_group (then batch whitening, as OpenRLHF's REINFORCE++-baseline)
    """
    if estimator == "group_norm":
        estimator = "grpo"
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"unknown group estimator {estimator!r}; expected one of {GROUP_ESTIMATORS}")
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    r = scores.float().view(-1, group_size)
    if estimator == "reinforce_plus_plus":
        return r.flatten()
    mean = r.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs at least 2 samples per prompt")
        return (r - (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)).flatten()
    centred = r - mean
    if estimator in ("dr_grpo", "reinforce_plus_plus_baseline") or scale == "none":
        return centred.flatten()
    if scale == "group":
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    elif scale == "batch":
        std = r.flatten().std() if r.numel() > 1 else torch.zeros(())
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return (centred / (std + eps)).flatten()


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = sum_{k >= t} gamma^(k-t) r_k`` over masked tokens: (B, L) -> (B, L), 0 outside the mask."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    rewards = torch.where(mask, rewards, zero)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return torch.where(mask, returns, zero)


def token_advantages_from_sequence(advantages: torch.Tensor, mask: torch.Tensor, whiten: bool = False) -> torch.Tensor:
    """Broadcast per-sequence advantages (B,) over the response tokens (B, L); optionally whiten over the batch."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=advantages.device)
    token = torch.where(mask, advantages.float()[:, None], zero)
    if whiten:
        token = torch.where(mask, masked_whiten(token, mask), zero)
    return token
