"""The critic-free family assembled: GRPO (with Dr. GRPO, DAPO, BNPO and GSPO), RLOO, REINFORCE++ (+baseline).

One rollout batch holds ``B`` rows (samples); ``group`` (B,) says which prompt each row answers. The functions here
turn sequence scores into advantages and compute the loss of one minibatch; the last section puts them together
for one update (masks, targets, each micro-batch's weighted loss), so the trainer only runs the model passes. GRPO is
TRL 1.12's ``GRPOTrainer``, RLOO ``"trl"`` TRL 1.12's ``RLOOTrainer``, RLOO ``"openrlhf"`` and REINFORCE++
OpenRLHF's, checked number for number by tests/parity. Masked positions are *selected* away (``torch.where``), never
multiplied by 0.

Design (each convention): docs/training.md#rl-math; parity: docs/training.md#parity-with-trl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from rlhf.algo.kl import kl_estimate
from rlhf.algo.losses import MicroWeighting, micro_weight
from rlhf.algo.masked import masked_mean, masked_sum
from rlhf.algo.ppo import sequence_lengths, truncate_at_stop
from rlhf.algo.shaping import penalize_missing_eos

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
ScaleRewards = Literal["group", "batch", "none"]
GRPO_STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)
OPENRLHF_KL_CLAMP = 10.0


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _groups(group: torch.Tensor) -> list[torch.Tensor]:
    """Row indices of each group, in order of first appearance of the group id."""
    return [(group == g).nonzero().flatten() for g in torch.unique(group).tolist()]


def _unbiased_std(x: torch.Tensor) -> torch.Tensor:
    """TRL's ``nanstd`` for a vector without NaN: sqrt(mean((x - mean)^2) * n / (n - 1)); 0 for a single value."""
    n = x.numel()
    if n < 2:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    mean = x.mean()
    return torch.sqrt(((x - mean) ** 2).mean() * (n / (n - 1)))


def grpo_advantages(
    scores: torch.Tensor, group: torch.Tensor, scale_rewards: ScaleRewards = "group", eps: float = GRPO_STD_EPS
) -> torch.Tensor:
    """TRL GRPO: ``A = r - mean_group(r)``, divided by ``std + eps`` unless ``scale_rewards == "none"``.

    scores, group: (B,) -> (B,) float32. ``"group"``: the unbiased std of each group; ``"batch"``: of all scores. A
    group of one sample (others dropped) gets advantage 0, as TRL's ``nan_to_num`` of its 0/0 would give.
    """
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    r = scores.float()
    adv = torch.zeros_like(r)
    batch_std = _unbiased_std(r)
    for rows in _groups(group):
        g = r[rows]
        centred = g - g.mean()
        if scale_rewards == "group":
            centred = centred / (_unbiased_std(g) + eps)
        elif scale_rewards == "batch":
            centred = centred / (batch_std + eps)
        adv[rows] = centred if rows.numel() > 1 else torch.zeros_like(g)
    return adv


def leave_one_out(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """``r_i - mean_{j != i} r_j`` within each group: (B,) -> (B,); 0 for a group of one sample."""
    r = rewards.float()
    adv = torch.zeros_like(r)
    for rows in _groups(group):
        n = rows.numel()
        if n > 1:
            g = r[rows]
            adv[rows] = g - (g.sum() - g) / (n - 1)
    return adv


def rloo_trl_advantages(
    scores: torch.Tensor,
    group: torch.Tensor,
    sequence_kl: torch.Tensor | None = None,
    beta: float = 0.0,
    normalize_advantages: bool = False,
    eps: float = GRPO_STD_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL RLOO: ``r = score - beta * sequence_kl``, then the leave-one-out baseline, then optional batch normalisation.

    scores, group: (B,); sequence_kl: (B,) the KL summed over each completion (TRL: ``sum_t (old_t - ref_t)``).
    Returns ``(advantages, rewards)``, both (B,). Normalisation is ``(A - mean) / (std + eps)`` over the batch.
    """
    rewards = scores.float()
    if beta != 0.0:
        if sequence_kl is None:
            raise ValueError("beta != 0 needs sequence_kl")
        rewards = rewards - beta * sequence_kl.float()
    adv = leave_one_out(rewards, group)
    if normalize_advantages:
        adv = (adv - adv.mean()) / (_unbiased_std(adv) + eps)
    return adv, rewards


OpenRLHFEstimator = Literal["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]


def openrlhf_advantages(
    scores: torch.Tensor,
    group: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: OpenRLHFEstimator,
    kl_coef: float = 0.0,
    kl_estimator: str = "k1",
    gamma: float = 1.0,
    whiten: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenRLHF's token-level advantages for ``rloo``, ``reinforce`` and ``reinforce_baseline``.

    scores, group: (B,); logprobs (rollout policy), ref_logprobs, mask: (B, L). Steps (OpenRLHF ``experience_maker``):
    the baseline on the scalar score (rloo: leave-one-out; reinforce_baseline: group mean; reinforce: none), the
    per-token reward ``-kl_coef * clamp(KL_t, -10, 10)`` with the shaped score added at the last response token, the
    reward-to-go ``G_t = sum_{k>=t} gamma^(k-t) r_k`` (gamma forced to 1 with a baseline), and, for the two REINFORCE++
    estimators (``whiten=None``), whitening over every response token of the batch: ``(G - mean) *
    rsqrt(clamp(var, 1e-8))`` with the plain (biased) variance. Returns ``(advantages, per_token_rewards)``, (B, L),
    0 outside ``mask``.
    """
    mask = mask.bool()
    r = scores.float()
    if estimator == "rloo":
        shaped = leave_one_out(r, group)
    elif estimator == "reinforce_plus_plus_baseline":
        shaped = r.clone()
        for rows in _groups(group):
            shaped[rows] = r[rows] - r[rows].mean()
    elif estimator == "reinforce_plus_plus":
        shaped = r
    else:
        raise ValueError(f"unknown OpenRLHF estimator {estimator!r}")
    if estimator != "reinforce_plus_plus":
        gamma = 1.0
    zero = _zero(r)
    kl = kl_estimate(
        torch.where(mask, logprobs, zero), torch.where(mask, ref_logprobs, zero), kl_estimator, clamp=OPENRLHF_KL_CLAMP
    )
    rewards = torch.where(mask, -kl_coef * kl, zero)
    length = mask.shape[1]
    last = (mask.long() * torch.arange(1, length + 1, device=mask.device)).argmax(dim=1)  # last set column
    has_tokens = mask.any(dim=1)
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += torch.where(has_tokens, shaped, zero)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(r)
    for t in reversed(range(length)):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    returns = torch.where(mask, returns, zero)
    if whiten is None:
        whiten = estimator != "rloo"
    if whiten:
        n = mask.sum().clamp(min=1)
        mean = torch.where(mask, returns, zero).sum() / n
        var = torch.where(mask, (returns - mean) ** 2, zero).sum() / n  # plain variance, as OpenRLHF
        returns = torch.where(mask, (returns - mean) * var.clamp(min=1e-8).rsqrt(), zero)
    return returns, rewards


def top_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """TRL's ``top_entropy_quantile``: keep the response tokens whose entropy is in the top ``quantile`` of the batch.

    entropies, mask: (B, L) -> bool (B, L). The threshold is ``torch.quantile(valid entropies, 1 - quantile)``; a token
    is kept when its entropy is >= the threshold. ``quantile=1`` keeps every response token.
    """
    mask = mask.bool()
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {quantile}")
    valid = entropies.detach()[mask].float()
    if valid.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(valid, 1.0 - quantile)
    return (torch.where(mask, entropies.detach(), _zero(entropies)) >= threshold) & mask


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: LossType = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: Literal["token", "sequence"] = "token",
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    use_bias_correction_kl: bool = True,
    entropy_mask: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items: float | torch.Tensor | None = None,
    dual_clip: float | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO-family loss of one minibatch (TRL 1.12 ``GRPOTrainer._compute_loss``).

    logprobs (with grad), old_logprobs, mask: (B, L); advantages: (B,) per sequence or (B, L) per token.
    ``coef = exp(log pi - log pi_old)`` per token, or (``importance_sampling_level="sequence"``, GSPO) the exp of the
    masked mean log-ratio of each row; ``loss_t = -min(coef * A, clamp(coef, 1 - epsilon, 1 + epsilon_high) * A)``;
    tokens outside ``entropy_mask`` drop out of that term; with ``beta != 0`` the ``kl_estimator`` (k3 in TRL) of
    ``pi`` against ``ref_logprobs`` is added per token, times ``coef`` when ``use_bias_correction_kl``. Aggregation
    (the KL term included):

      grpo     mean over rows of (sum_t loss_t / n_tokens(row))
      bnpo     sum loss_t / n_tokens(minibatch)
      dr_grpo  sum loss_t / (rows * max_completion_length)
      dapo     sum loss_t / num_items  (TRL: tokens of the whole generation batch / minibatches per generation)

    Extras that TRL does not have (off by default): ``dual_clip`` (OpenRLHF, negative advantages) and a truncated
    importance weight ``min(exp(old - behaviour), tis_cap)`` per token for samples from an older policy version.
    stats: ``clip_ratio/{low_mean,high_mean,region_mean}`` (TRL's names: fractions of the valid tokens, or of the rows
    at sequence level), ``kl`` (mean per valid token),
    ``approxkl``, ``ratio``, ``policy_loss`` (the loss before any entropy bonus).
    """
    _check_grpo_options(loss_type, importance_sampling_level, dual_clip)
    mask = mask.bool()
    eps_high = epsilon if epsilon_high is None else epsilon_high
    old_logprobs, advantages = old_logprobs.detach(), advantages.detach()
    log_ratio, coef_1 = _importance_ratio(logprobs, old_logprobs, mask, importance_sampling_level)
    adv = advantages.float().unsqueeze(1) if advantages.dim() == 1 else advantages.float()
    per_token = _clipped_surrogate(coef_1, adv, epsilon, eps_high, dual_clip, log_ratio.shape)
    zero = _zero(logprobs)
    if entropy_mask is not None:
        per_token = torch.where(entropy_mask.bool(), per_token, zero)
    stats: dict[str, torch.Tensor] = {}
    if behavior_logprobs is not None:
        weight = _tis_weight(old_logprobs, behavior_logprobs, mask, tis_cap)
        per_token = per_token * weight
        stats["tis_weight"] = masked_mean(weight, mask)
    kl = None
    if beta != 0.0:
        kl = _kl_to_reference(logprobs, ref_logprobs, mask, kl_estimator, coef_1 if use_bias_correction_kl else None)
        per_token = per_token + beta * kl
    loss = _aggregate_grpo(torch.where(mask, per_token, zero), mask, loss_type, max_completion_length, num_items)
    with torch.no_grad():
        stats.update(_clip_stats(coef_1, adv, mask, epsilon, eps_high))
        stats["approxkl"] = masked_mean(0.5 * log_ratio.square(), mask)
        stats["ratio"] = masked_mean(torch.exp(log_ratio), mask)
        stats["kl"] = masked_mean(kl, mask) if kl is not None else torch.zeros(())
        stats["policy_loss"] = loss.detach()
    return loss, stats


def _check_grpo_options(loss_type: str, importance_sampling_level: str, dual_clip: float | None) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")


def _importance_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_ratio (B, L), 0 outside ``mask``; coef_1: exp of it per token, or (B, 1) per sequence (GSPO))."""
    zero = _zero(logprobs)
    # Select before subtracting: padded positions hold whatever the caller left there (0, 1.0, -inf, ...).
    log_ratio = torch.where(mask, logprobs - torch.where(mask, old_logprobs, zero), zero)
    if level == "token":
        return log_ratio, torch.exp(log_ratio)
    return log_ratio, torch.exp((log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).unsqueeze(1))  # (B, 1)


def _clipped_surrogate(
    coef_1: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    shape: torch.Size,
) -> torch.Tensor:
    """``-min(coef * A, clamp(coef, 1 - eps_low, 1 + eps_high) * A)`` per token (``shape``), capped at
    ``-dual_clip * A`` where A < 0."""
    coef_2 = torch.clamp(coef_1, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.min(per_token, -dual_clip * adv), per_token)
    return per_token.expand(shape) if per_token.shape != shape else per_token


def _tis_weight(
    old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor, tis_cap: float | None
) -> torch.Tensor:
    """The truncated importance weight ``min(exp(old - behaviour), tis_cap)`` per token, a constant."""
    if tis_cap is None:
        raise ValueError("behavior_logprobs given without tis_cap")
    zero = _zero(old_logprobs)
    weight = torch.exp(torch.where(mask, old_logprobs - torch.where(mask, behavior_logprobs, zero), zero))
    return weight.clamp(max=tis_cap).detach()


def _kl_to_reference(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    kl_estimator: str,
    coef_1: torch.Tensor | None,
) -> torch.Tensor:
    """The per-token KL estimate of the policy against the reference, times ``coef_1`` (TRL's bias correction) when
    given."""
    if ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs")
    zero = _zero(logprobs)
    kl = kl_estimate(torch.where(mask, logprobs, zero), torch.where(mask, ref_logprobs, zero), kl_estimator)
    return kl if coef_1 is None else kl * coef_1


def _aggregate_grpo(
    total: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None,
    num_items: float | torch.Tensor | None,
) -> torch.Tensor:
    """The per-token loss ``total`` (0 outside ``mask``) to a scalar, as ``loss_type`` says (:func:`grpo_loss`)."""
    count = mask.sum(dim=1)
    if loss_type == "grpo":
        return (total.sum(dim=1) / count.clamp(min=1)).mean()
    if loss_type == "bnpo":
        return total.sum() / count.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        return total.sum() / (total.shape[0] * max_completion_length)
    if num_items is None:
        raise ValueError("loss_type 'dapo' needs num_items (tokens per minibatch, averaged over the batch)")
    return total.sum() / torch.as_tensor(num_items, dtype=total.dtype, device=total.device).clamp(min=1.0)


def _clip_stats(
    coef_1: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float
) -> dict[str, torch.Tensor]:
    """TRL's ``clip_ratio/{low,high,region}_mean``: a fraction of tokens, or of rows when there is one ratio per row
    (sequence level)."""
    is_low = (coef_1 < 1.0 - eps_low) & (adv < 0)
    is_high = (coef_1 > 1.0 + eps_high) & (adv > 0)
    stats = {}
    for name, flags in (("low", is_low), ("high", is_high), ("region", is_low | is_high)):
        frac = flags.float().mean() if flags.shape[1] == 1 else masked_mean(flags.float(), mask)
        stats[f"clip_ratio/{name}_mean"] = frac
    return stats


def rloo_trl_loss(
    logprobs: torch.Tensor,
    old_sequence_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    behavior_sequence_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL 1.12 ``RLOOTrainer._compute_loss``: one clipped ratio per sequence, mean over rows.

    logprobs (with grad), mask: (B, L); old_sequence_logprobs, advantages: (B,). ``coef = exp(sum_t log pi -
    old_sequence_logprobs)``; ``loss = mean_b -min(coef * A, clamp(coef, 1 - epsilon, 1 + epsilon_high) * A)``.
    Optional (not in TRL): a per-sequence truncated importance weight ``min(exp(old - behaviour), tis_cap)`` from the
    summed sampling log-probs. stats: ``clip_ratio/{low_mean,high_mean,region_mean}`` over rows, ``ratio``.
    """
    mask = mask.bool()
    zero = _zero(logprobs)
    eps_high = epsilon if epsilon_high is None else epsilon_high
    old, adv = old_sequence_logprobs.detach().float(), advantages.detach().float()
    seq = torch.where(mask, logprobs, zero).sum(dim=1)
    coef_1 = torch.exp(seq - old)
    coef_2 = torch.clamp(coef_1, 1.0 - epsilon, 1.0 + eps_high)
    per_sequence = -torch.min(coef_1 * adv, coef_2 * adv)
    stats: dict[str, torch.Tensor] = {}
    if behavior_sequence_logprobs is not None:
        if tis_cap is None:
            raise ValueError("behavior_sequence_logprobs given without tis_cap")
        weight = torch.exp(old - behavior_sequence_logprobs.float()).clamp(max=tis_cap).detach()
        per_sequence = per_sequence * weight
        stats["tis_weight"] = weight.mean()
    loss = per_sequence.mean()
    with torch.no_grad():
        is_low = (coef_1 < 1.0 - epsilon) & (adv < 0)
        is_high = (coef_1 > 1.0 + eps_high) & (adv > 0)
        stats["clip_ratio/low_mean"] = is_low.float().mean()
        stats["clip_ratio/high_mean"] = is_high.float().mean()
        stats["clip_ratio/region_mean"] = (is_low | is_high).float().mean()
        stats["ratio"] = coef_1.mean()
        stats["policy_loss"] = loss.detach()
    return loss, stats


def completion_mask(
    responses: torch.Tensor, eos_token_id: int | None, pad_token_id: int, mask_truncated: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A critic-free batch's completions as the losses see them: (responses cut after their first EOS, the (B, L)
    mask of real tokens through the EOS, (B,) whether each ended in EOS). ``mask_truncated`` (TRL's
    ``mask_truncated_completions``) takes completions without an EOS out of the loss."""
    responses = truncate_at_stop(responses, eos_token_id, pad_token_id)
    ell = sequence_lengths(responses, pad_token_id)
    mask = torch.arange(responses.shape[1], device=responses.device)[None, :] <= ell[:, None]
    contains_eos = (responses == eos_token_id).any(1)
    if mask_truncated:
        mask = mask & contains_eos[:, None]
    return responses, mask, contains_eos


def episode_completion_mask(
    responses: torch.Tensor,
    loss_mask: torch.Tensor,
    episodes: torch.Tensor,
    ended: torch.Tensor,
    eos_token_id: int | None,
    pad_token_id: int,
    mask_truncated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`completion_mask` where some rows are episodes (``episodes``, (B,) bool): an episode row is kept whole
    (its model turns each end in EOS, so it is not cut at the first), its mask is its ``loss_mask`` (the model's own
    tokens), and it "ended in EOS" when the environment ended it (``ended``). Other rows as :func:`completion_mask`."""
    cut, mask, contains_eos = completion_mask(responses, eos_token_id, pad_token_id)
    ep = episodes[:, None]
    responses = torch.where(ep, responses, cut)
    mask = torch.where(ep, loss_mask, mask)
    contains_eos = torch.where(episodes, ended, contains_eos)
    if mask_truncated:
        mask = mask & contains_eos[:, None]
    return responses, mask, contains_eos


def distill_advantages(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float = 1.0,
    task_advantages: torch.Tensor | None = None,
    reward_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (Thinking Machines' recipe; NeMo-RL's ``opd`` estimator): per-token advantages
    ``A_t = coef * (log teacher(y_t) - log student(y_t)) + reward_coef * A_task``.

    student_logprobs (the sampling policy's, detached), teacher_logprobs, mask: (B, L) on the student's own samples;
    task_advantages: (B,) per sequence or (B, L) per token (the stage's estimator on the reward), or None. The
    distillation term is the negative per-token reverse KL ``KL(student || teacher)`` estimated on the sampled token,
    with discount 0 (each token's own gap, no reward-to-go) and no group normalisation: its scale is the KL's. Returns
    ``(advantages, reverse_kl)``, both (B, L) and 0 outside ``mask``; ``reverse_kl = student - teacher``.
    """
    mask = mask.bool()
    zero = _zero(student_logprobs).float()
    # select before subtracting: padding may hold -inf (or anything) in either tensor
    student = torch.where(mask, student_logprobs.detach().float(), zero)
    reverse_kl = student - torch.where(mask, teacher_logprobs.float(), zero)
    adv = -coef * reverse_kl
    if task_advantages is not None and reward_coef != 0.0:
        task = task_advantages.detach().float()
        adv = adv + reward_coef * (task.unsqueeze(1) if task.dim() == 1 else task)
    return torch.where(mask, adv, zero), reverse_kl


def critic_free_advantages(
    estimator: str,
    scores: torch.Tensor,
    group: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    rloo_convention: str = "trl",
    kl_estimator: str = "kl",
    beta: float = 0.0,
    scale_rewards: ScaleRewards = "group",
    whiten: bool = False,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, per-token KL) of a batch for the stage's ``estimator``: GRPO / Dr. GRPO group-normalised (the KL
    goes into the loss instead), RLOO with TRL's convention (the summed KL folded into the reward before the
    baseline), else OpenRLHF's RLOO / REINFORCE++ (+baseline). Log-probs must be 0 outside ``mask``."""
    kl = kl_estimate(old_logprobs, ref_logprobs, kl_estimator)  # 0 outside the mask: both inputs are 0 there
    if estimator in ("grpo", "dr_grpo"):
        return grpo_advantages(scores, group, scale_rewards), kl
    if estimator == "rloo" and rloo_convention == "trl":
        advantages, _ = rloo_trl_advantages(
            scores, group, masked_sum(kl, mask, dim=1), beta, normalize_advantages=whiten
        )
        return advantages, kl
    advantages, _ = openrlhf_advantages(
        scores, group, old_logprobs, ref_logprobs, mask, estimator, beta, kl_estimator, gamma, whiten=whiten
    )
    return advantages, kl


# ---------------------------------------------------------------- one critic-free update, assembled
# The trainer runs the model passes (the old log-probs, the minibatch updates over epochs); what lies between them is
# here: which tokens count, what the update trains toward, and each micro-batch's share of a minibatch's loss.


class CompletionMasks(NamedTuple):
    """A critic-free batch's completions as the update sees them (:func:`critic_free_masks`)."""

    responses: torch.Tensor  # (B, L) cut after the first EOS; episode rows whole
    mask: torch.Tensor  # (B, L) bool: the tokens the loss counts
    every_token: torch.Tensor  # (B, L) bool: every token the model wrote, truncated completions included
    contains_eos: torch.Tensor  # (B,) bool: ended in EOS (an episode: the environment ended it)


def critic_free_masks(
    responses: torch.Tensor,
    eos_token_id: int | None,
    pad_token_id: int,
    *,
    mask_truncated: bool = False,
    loss_mask: torch.Tensor | None = None,
    episodes: torch.Tensor | None = None,
    ended: torch.Tensor | None = None,
) -> CompletionMasks:
    """:func:`completion_mask`, or with ``episodes`` (B,) bool and their ``loss_mask`` (B, L) and ``ended`` (B,)
    :func:`episode_completion_mask`. ``mask_truncated`` (TRL's ``mask_truncated_completions``) takes the
    completions that did not end out of ``mask``, not out of ``every_token`` (the tokens the mismatch compares)."""
    if episodes is None:
        responses, every_token, contains_eos = completion_mask(responses, eos_token_id, pad_token_id)
    else:
        if loss_mask is None or ended is None:
            raise ValueError("episodes need their loss_mask and ended flags")
        responses, every_token, contains_eos = episode_completion_mask(
            responses, loss_mask, episodes, ended, eos_token_id, pad_token_id
        )
    mask = every_token & contains_eos[:, None] if mask_truncated else every_token
    return CompletionMasks(responses, mask, every_token, contains_eos)


@dataclass(frozen=True)
class CriticFreeSettings:
    """What a critic-free update is configured with, as plain values (the trainer fills it from its config)."""

    estimator: str  # grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline
    beta: float = 0.0  # the KL coefficient: folded into the reward (RLOO, REINFORCE++) or a loss term (GRPO)
    kl_estimator: str = "k3"
    rloo_convention: str = "trl"
    scale_rewards: ScaleRewards = "group"
    whiten: bool = False
    gamma: float = 1.0
    missing_eos_penalty: float | None = None
    distill_coef: float = 0.0  # > 0: on-policy distillation from the reference model (:func:`distill_advantages`)
    distill_reward_coef: float = 0.0
    loss_type: LossType = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: Literal["token", "sequence"] = "token"
    use_bias_correction_kl: bool = True
    top_entropy_quantile: float = 1.0
    entropy_coeff: float = 0.0
    max_completion_length: int | None = None
    dual_clip: float | None = None
    tis_cap: float | None = None

    @property
    def trl_rloo(self) -> bool:
        """RLOO with TRL's convention: one ratio and one advantage per sequence (:func:`rloo_trl_loss`)."""
        return self.estimator == "rloo" and self.rloo_convention == "trl"

    @property
    def loss_beta(self) -> float:
        """The KL term's weight in the loss: GRPO's; the other estimators have the KL in the reward already."""
        return self.beta if self.estimator in ("grpo", "dr_grpo") else 0.0

    @property
    def weighting(self) -> MicroWeighting:
        """How the policy loss averages over a minibatch, so that micro-batch losses add up to the minibatch's
        (TRL's gradient accumulation): per row, a sum over a constant (DAPO's num_items), or per token."""
        if self.trl_rloo or self.loss_type in ("grpo", "dr_grpo"):
            return "rows"
        return "sum" if self.loss_type == "dapo" else "tokens"


class CriticFreeTargets(NamedTuple):
    """What the minibatch updates of a critic-free batch train toward (:func:`critic_free_targets`)."""

    mask: torch.Tensor  # (B, L) bool: the loss mask
    scores: torch.Tensor  # (B,) after the missing-EOS penalty
    old_logprobs: torch.Tensor  # (B, L) the policy's before the update, 0 outside the mask
    ref_logprobs: torch.Tensor  # (B, L) the reference's (distillation: the teacher's), 0 outside the mask
    advantages: torch.Tensor  # (B,) per sequence or (B, L) per token
    kl: torch.Tensor  # (B, L) the estimator's KL of the old policy to the reference, per token
    reverse_kl: torch.Tensor | None  # (B, L) distillation's KL(student || teacher) per token; None without it


def critic_free_targets(
    s: CriticFreeSettings,
    scores: torch.Tensor,
    group: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    masks: CompletionMasks,
) -> CriticFreeTargets:
    """The batch's targets: scores (B,) less the missing-EOS penalty, the old and reference log-probs (B, L) selected
    to the loss mask, the estimator's advantages (:func:`critic_free_advantages`) and, with ``distill_coef > 0``,
    the distillation advantages on top (:func:`distill_advantages`; the reference is the teacher)."""
    mask = masks.mask
    scores = penalize_missing_eos(scores, masks.contains_eos, s.missing_eos_penalty)
    zero = torch.zeros((), device=mask.device)
    ref = torch.where(mask, ref_logprobs, zero)
    old = torch.where(mask, old_logprobs, zero)
    advantages, kl = critic_free_advantages(
        s.estimator,
        scores,
        group,
        old,
        ref,
        mask,
        rloo_convention=s.rloo_convention,
        kl_estimator=s.kl_estimator,
        beta=s.beta,
        scale_rewards=s.scale_rewards,
        whiten=s.whiten,
        gamma=s.gamma,
    )
    reverse_kl = None
    if s.distill_coef > 0:
        advantages, reverse_kl = distill_advantages(
            old, ref, mask, coef=s.distill_coef, task_advantages=advantages, reward_coef=s.distill_reward_coef
        )
    return CriticFreeTargets(mask, scores, old, ref, advantages, kl, reverse_kl)


def critic_free_micro_loss(
    s: CriticFreeSettings,
    t: CriticFreeTargets,
    rows: torch.Tensor,
    whole: torch.Tensor,
    logprobs: torch.Tensor,
    entropies: torch.Tensor,
    *,
    minibatches: int,
    behavior_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of micro-batch ``rows`` of minibatch ``whole`` (row indices into the batch), weighted to its share of
    the minibatch's loss, and its stats.

    logprobs (with grad), entropies: (b, L) of the micro-batch under the current policy; behavior_logprobs: (B, L)
    the sampling policy's for truncated importance sampling, or None; minibatches: how many the batch splits into
    (DAPO's ``num_items``: the batch's loss tokens per minibatch, as TRL). The policy loss is :func:`rloo_trl_loss`
    for RLOO with TRL's convention, else :func:`grpo_loss` over the top-entropy tokens (``top_entropy_quantile``, of
    each forward pass as TRL's); the entropy bonus is a token mean over the same tokens. stats: ``loss/policy``,
    its magnitude ``loss/policy_abs``, ``policy/entropy`` and the policy loss's own, as ``policy/<name>``.
    """
    mask = t.mask[rows]
    entropy_mask = None
    if s.top_entropy_quantile < 1.0:
        entropy_mask = top_entropy_mask(entropies, mask, s.top_entropy_quantile)
    pg_loss, pg_stats = _policy_loss(s, t, rows, logprobs, entropy_mask, minibatches, behavior_logprobs)
    kept = mask if entropy_mask is None else entropy_mask
    loss = micro_weight(s.weighting, mask, t.mask[whole]) * pg_loss
    if s.entropy_coeff:
        loss = loss - s.entropy_coeff * micro_weight("tokens", kept, t.mask[whole]) * masked_mean(entropies, kept)
    stats = {
        "loss/policy": pg_loss.detach(),
        "loss/policy_abs": pg_loss.detach().abs(),  # averaged over micro-batches: MindSpeed-LLM's logged actor loss
        "policy/entropy": masked_mean(entropies.detach(), mask),
        **{f"policy/{k}": v for k, v in pg_stats.items() if k != "policy_loss"},
    }
    return loss, stats


def _policy_loss(
    s: CriticFreeSettings,
    t: CriticFreeTargets,
    rows: torch.Tensor,
    logprobs: torch.Tensor,
    entropy_mask: torch.Tensor | None,
    minibatches: int,
    behavior: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`critic_free_micro_loss`'s policy-gradient term, unweighted."""
    mask = t.mask[rows]
    if s.trl_rloo:  # sequence sums over the whole batch, then the rows: the same numbers in any micro-batch split
        return rloo_trl_loss(
            logprobs,
            masked_sum(t.old_logprobs, t.mask, dim=1)[rows],
            t.advantages[rows],
            mask,
            epsilon=s.epsilon,
            epsilon_high=s.epsilon_high,
            tis_cap=s.tis_cap,
            behavior_sequence_logprobs=None if behavior is None else masked_sum(behavior, t.mask, dim=1)[rows],
        )
    return grpo_loss(
        logprobs,
        t.old_logprobs[rows],
        t.advantages[rows],
        mask,
        loss_type=s.loss_type,
        epsilon=s.epsilon,
        epsilon_high=s.epsilon_high,
        importance_sampling_level=s.importance_sampling_level,
        ref_logprobs=t.ref_logprobs[rows],
        beta=s.loss_beta,
        kl_estimator=s.kl_estimator,
        use_bias_correction_kl=s.use_bias_correction_kl,
        entropy_mask=entropy_mask,
        max_completion_length=s.max_completion_length,
        num_items=t.mask.sum() / minibatches,
        dual_clip=s.dual_clip,
        behavior_logprobs=None if behavior is None else behavior[rows],
        tis_cap=s.tis_cap,
    )


def critic_free_metrics(t: CriticFreeTargets) -> dict[str, torch.Tensor]:
    """The batch's ``objective/*`` figures (the KL summed over each completion, averaged; the mean score and
    advantage) and, when distilling, ``distill/reverse_kl``: KL(student || teacher) per token before the update."""
    out = {
        "objective/kl": masked_sum(t.kl, t.mask, dim=1).mean(),
        "objective/scores": t.scores.mean(),
        "objective/advantages_mean": t.advantages.float().mean(),
    }
    if t.reverse_kl is not None:
        out["distill/reverse_kl"] = masked_mean(t.reverse_kl, t.mask)
    return out
