"""Policy, value and preference losses. Each returns ``(loss, stats)``; stats are detached floats-as-tensors."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from rlhf.algo.masked import masked_mean

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
# how a loss averages over a minibatch, so that its micro-batches' weighted losses add up to it (:func:`micro_weight`)
MicroWeighting = Literal["tokens", "rows", "sum"]


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: LossAggregation = "token_mean") -> torch.Tensor:
    """Reduce a (B, L) per-token loss to a scalar.

    ``token_mean`` (TRL PPO, DAPO): mean over all valid tokens of the batch; ``seq_mean_token_mean`` (GRPO): mean over
    rows of each row's token mean; ``seq_mean_token_sum_norm`` (Dr. GRPO): sum over valid tokens / (B * L).
    """
    if how == "token_mean":
        return masked_mean(values, mask)
    if how == "seq_mean_token_mean":
        return masked_mean(values, mask, dim=1).mean()
    if how == "seq_mean_token_sum_norm":
        return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)).sum() / (
            values.numel()
        )
    raise ValueError(f"unknown loss aggregation {how!r}")


def micro_weight(kind: MicroWeighting, micro: torch.Tensor, whole: torch.Tensor) -> float:
    """The factor that makes a micro-batch's loss its share of the minibatch's loss.

    ``kind``: ``tokens`` for a mean over the minibatch's valid tokens (micro/whole are (b, L) masks), ``rows`` for a
    mean over rows (micro/whole: anything with one row per sample), ``sum`` for a loss already normalised by a
    constant (DAPO's num_items): the micro-batch losses simply add.
    """
    if kind == "sum":
        return 1.0
    if kind == "rows":
        return micro.shape[0] / whole.shape[0]
    if kind == "tokens":
        total = float(whole.sum())
        return float(micro.sum()) / total if total > 0 else micro.shape[0] / whole.shape[0]
    raise ValueError(f"unknown micro-batch weighting {kind!r}")


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_high: float | None = None,
    dual_clip: float | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    aggregation: LossAggregation = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective of PPO, as a loss to minimise.

    logprobs (with grad), old_logprobs, advantages, mask: (B, L).
    ``ratio = exp(logprobs - old_logprobs)``; per token
    ``max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))``.
    dual_clip (c > 1, Ye et al. 2020): for A < 0 the loss is further capped at ``-c * A``.
    Truncated importance sampling: when the samples came from another engine or an older policy,
    ``behavior_logprobs`` are the sampling log-probs and each token's loss is weighted by
    ``min(exp(old_logprobs - behavior_logprobs), tis_cap)`` (a constant; Yao et al. 2025, OpenRLHF ``tis``).

    stats: ``clipfrac`` (fraction of valid tokens where the clipped branch is active), ``approxkl``
    (masked mean of 0.5 * (log ratio)^2), ``ratio`` (masked mean), ``dual_clipfrac``, ``tis_weight`` (masked mean).
    """
    if not 0 <= clip_ratio < 1:
        raise ValueError(f"clip_ratio must be in [0, 1), got {clip_ratio}")
    eps_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    mask = mask.bool()
    # The gradient flows through ``logprobs`` only, even if a caller's old log-probs or advantages carry a graph.
    old_logprobs, advantages = old_logprobs.detach(), advantages.detach()
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + eps_high)
    per_token = torch.max(loss_unclipped, loss_clipped)
    stats: dict[str, torch.Tensor] = {}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        capped = torch.min(per_token, -dual_clip * advantages)
        dual_active = (advantages < 0) & (capped < per_token)
        per_token = torch.where(advantages < 0, capped, per_token)
        stats["dual_clipfrac"] = masked_mean(dual_active.float(), mask).detach()
    if behavior_logprobs is not None:
        if tis_cap is None:
            raise ValueError("behavior_logprobs given without tis_cap")
        weight = torch.exp(old_logprobs - behavior_logprobs).clamp(max=tis_cap).detach()
        per_token = per_token * weight
        stats["tis_weight"] = masked_mean(weight, mask)
    loss = aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        stats["clipfrac"] = masked_mean((loss_clipped > loss_unclipped).float(), mask)
        stats["approxkl"] = masked_mean(0.5 * log_ratio.square(), mask)
        stats["ratio"] = masked_mean(ratio, mask)
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None = 0.2,
    aggregation: LossAggregation = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)``, aggregated over ``mask``.

    values (with grad), old_values, returns, mask: (B, L). ``cliprange_value`` None or <= 0 disables clipping
    (MindSpeed-LLM's convention). stats: ``clipfrac`` (tokens where the clipped branch is larger), ``vpred`` mean.
    """
    mask = mask.bool()
    loss_unclipped = (values - returns).square()
    if cliprange_value is not None and cliprange_value > 0:
        # clamp(V, V_old - eps, V_old + eps) as TRL: an unclipped V comes back bit-identical, so it never counts as
        # clipped (V_old + (V - V_old) can be 1 ulp off V and tip ``loss_clipped > loss_unclipped`` on rounding).
        clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
        loss_clipped = (clipped - returns).square()
        per_token = torch.max(loss_unclipped, loss_clipped)
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask).detach()
    else:
        per_token = loss_unclipped
        clipfrac = torch.zeros(())
    loss = 0.5 * aggregate(per_token, mask, aggregation)
    return loss, {"clipfrac": clipfrac, "vpred": masked_mean(values.detach(), mask)}


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss from per-sequence log-prob sums (each (B,)).

    ``logits = (pi_c - pi_r) - (ref_c - ref_r)``; sigmoid (Rafailov et al.): ``-logsigmoid(beta * logits)``;
    ipo (Azar et al.): ``(logits - 1 / (2 * beta))^2``. The loss is the batch mean. Sums, not token means, as TRL.
    stats: ``rewards/chosen`` = beta (pi_c - ref_c) (mean), ``rewards/rejected``, ``rewards/margins``,
    ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    logits = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)).square()
    else:
        raise ValueError(f"loss_type must be 'sigmoid' or 'ipo', got {loss_type!r}")
    with torch.no_grad():
        chosen_rewards = beta * (chosen_logps - ref_chosen_logps)
        rejected_rewards = beta * (rejected_logps - ref_rejected_logps)
        margins = chosen_rewards - rejected_rewards
        stats = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": margins.mean(),
            "rewards/accuracies": (margins > 0).float().mean(),
            "logps/chosen": chosen_logps.detach().mean(),
            "logps/rejected": rejected_logps.detach().mean(),
        }
    return losses.mean(), stats


def select_chosen_rejected(scores: torch.Tensor, num_prompts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen/rejected row indices for two samples per prompt in block layout ``[p0..pB-1, p0..pB-1]``.

    scores: (2B,) -> (chosen, rejected), each (B,) indices into the 2B rows. Ties choose the first sample (TRL).
    """
    if scores.numel() != 2 * num_prompts:
        raise ValueError(f"expected {2 * num_prompts} scores for {num_prompts} prompts, got {scores.numel()}")
    first, second = scores.split(num_prompts)
    first_wins = first >= second
    arange = torch.arange(num_prompts, device=scores.device)
    chosen = arange + (~first_wins).long() * num_prompts
    rejected = arange + first_wins.long() * num_prompts
    return chosen, rejected


def dpo_pairs(group: torch.Tensor) -> tuple[list[int], list[int]]:
    """Online DPO's pairs: the first two rows of each prompt's group (in row order), as (firsts, seconds) row lists;
    a prompt with fewer than two scored samples gives no pair."""
    firsts, seconds = [], []
    for g in torch.unique(group).tolist():
        rows = (group == g).nonzero().flatten().tolist()
        if len(rows) >= 2:
            firsts.append(rows[0])
            seconds.append(rows[1])
    return firsts, seconds
