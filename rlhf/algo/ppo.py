"""PPO rollout post-processing: from sampled responses and model outputs to rewards, advantages and returns.

The conventions are TRL's PPO trainer (trl 1.10-1.12, ``trl.experimental.ppo``), which the parity tests check number
for number: responses are truncated after the stop token, ``ell`` is the index of the last kept token, log-probs past
``ell`` are ignored, values are kept one column further (``ell + 1``, where TRL places the score).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlhf.algo.advantages import gae
from rlhf.algo.kl import kl_penalized_rewards
from rlhf.algo.masked import compact, expand, masked_whiten
from rlhf.algo.shaping import penalize_missing_eos, subtract_reward_baseline


def first_true_indices(flags: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row of a (B, L) bool tensor; L when there is none. -> (B,) long."""
    length = flags.shape[-1]
    idx = torch.arange(length, device=flags.device).expand_as(flags)
    return torch.where(flags.bool(), idx, torch.full_like(idx, length)).min(-1).values


def truncate_at_stop(responses: torch.Tensor, stop_token_id: int | None, pad_token_id: int) -> torch.Tensor:
    """Replace every token after the first ``stop_token_id`` with ``pad_token_id`` (the stop token is kept)."""
    if stop_token_id is None:
        return responses
    stop_at = first_true_indices(responses == stop_token_id)
    idx = torch.arange(responses.shape[1], device=responses.device)
    return responses.masked_fill(idx[None, :] > stop_at[:, None], pad_token_id)


def sequence_lengths(responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """``ell``: index of the last non-pad token before the first pad, -1 for an empty row. (B, L) -> (B,)."""
    return first_true_indices(responses == pad_token_id) - 1


@dataclass
class PPORollout:
    """The per-token tensors one PPO update consumes. All (B, L) unless noted."""

    responses: torch.Tensor  # truncated at the stop token, padded with pad_token_id
    num_eos_tokens: torch.Tensor  # () EOS tokens in the raw (untruncated) responses, as TRL logs it
    sequence_lengths: torch.Tensor  # (B,) ell
    padding_mask: torch.Tensor  # t > ell: not a response token
    padding_mask_p1: torch.Tensor  # t > ell + 1: outside the value/return span
    logprobs: torch.Tensor  # old (rollout policy) log-probs, 0 on padding
    ref_logprobs: torch.Tensor  # 0 on padding
    values: torch.Tensor  # 0 past ell + 1
    scores: torch.Tensor  # (B,) after the missing-EOS penalty
    contains_eos: torch.Tensor  # (B,) bool
    kl: torch.Tensor
    non_score_reward: torch.Tensor
    rewards: torch.Tensor  # KL penalty plus score (whitened if asked)
    advantages: torch.Tensor  # whitened over the batch, 0 on padding
    returns: torch.Tensor  # from the un-whitened advantages

    @property
    def response_mask(self) -> torch.Tensor:
        return ~self.padding_mask

    @property
    def value_mask(self) -> torch.Tensor:
        return ~self.padding_mask_p1


def ppo_rollout(
    responses: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    *,
    pad_token_id: int,
    eos_token_id: int,
    stop_token_id: int | None = None,
    kl_coef: float = 0.05,
    kl_estimator: str = "k1",
    gamma: float = 1.0,
    lam: float = 0.95,
    missing_eos_penalty: float | None = None,
    whiten_rewards: bool = False,
    whiten_advantages: bool = True,
    score_position: Literal["trl", "last_token"] = "trl",
    kl: torch.Tensor | None = None,
    group: torch.Tensor | None = None,
    reward_baseline: str = "none",
    contains_eos: torch.Tensor | None = None,
) -> PPORollout:
    """Turn one rollout batch into rewards, advantages and returns.

    responses: (B, L) raw sampled ids, right-padded with ``pad_token_id`` (never containing it as a real token);
    logprobs / ref_logprobs: (B, L) log-probs of ``responses`` under the rollout and reference policies;
    values: (B, L) critic values read at the position before each response token; scores: (B,) sequence scores of the
    truncated responses. ``missing_eos_penalty`` checks for ``eos_token_id`` even when another stop id is used (TRL).
    ``kl``: (B, L) per-token KL from elsewhere (the whole-vocabulary ``full_kl``) instead of ``kl_estimator``.
    ``reward_baseline`` (``leave_one_out`` / ``group_mean``, with ``group``: (B,) the prompt of each row): the score
    less the other samples' of its prompt (seed 002's ``r(x, y) - r(x, y_ref)``, :func:`subtract_reward_baseline`),
    after the missing-EOS penalty and before the KL penalty; ``PPORollout.scores`` are then the baselined scores.
    ``contains_eos``: (B,) whether each row ended properly, instead of looking for ``eos_token_id`` (episodes).
    """
    num_eos_tokens = (responses == eos_token_id).sum()
    responses = truncate_at_stop(responses, stop_token_id, pad_token_id)
    ell = sequence_lengths(responses, pad_token_id)
    length = responses.shape[1]
    idx = torch.arange(length, device=responses.device)[None, :]
    padding_mask = idx > ell[:, None]
    padding_mask_p1 = idx > (ell + 1)[:, None]
    logprobs = logprobs.masked_fill(padding_mask, 0.0)
    ref_logprobs = ref_logprobs.masked_fill(padding_mask, 0.0)
    values = values.masked_fill(padding_mask_p1, 0.0)
    if contains_eos is None:
        contains_eos = (responses == eos_token_id).any(dim=1)
    if reward_baseline != "none":
        if group is None:
            raise ValueError(f"reward_baseline {reward_baseline!r} needs group (the prompt of each row)")
        scores = penalize_missing_eos(scores.to(logprobs.dtype), contains_eos, missing_eos_penalty)
        scores, missing_eos_penalty = subtract_reward_baseline(scores, group, reward_baseline), None
    kr = kl_penalized_rewards(
        scores,
        logprobs,
        ref_logprobs,
        ell,
        kl_coef,
        kl_estimator=kl_estimator,
        score_position=score_position,
        contains_eos=contains_eos,
        missing_eos_penalty=missing_eos_penalty,
        kl=kl,
    )
    rewards = kr.rewards
    if whiten_rewards:
        rewards = masked_whiten(rewards, ~padding_mask_p1, shift_mean=False).masked_fill(padding_mask_p1, 0.0)
    advantages, returns = gae(rewards, values, gamma=gamma, lam=lam)
    if whiten_advantages:
        advantages = masked_whiten(advantages, ~padding_mask)
    advantages = advantages.masked_fill(padding_mask, 0.0)
    return PPORollout(
        responses=responses,
        num_eos_tokens=num_eos_tokens,
        sequence_lengths=ell,
        padding_mask=padding_mask,
        padding_mask_p1=padding_mask_p1,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        scores=kr.scores,
        contains_eos=contains_eos,
        kl=kr.kl,
        non_score_reward=kr.non_score_reward,
        rewards=rewards,
        advantages=advantages,
        returns=returns,
    )


def ppo_episode_rollout(
    responses: torch.Tensor,
    loss_mask: torch.Tensor,
    ended: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    *,
    pad_token_id: int,
    kl: torch.Tensor | None = None,
    **kw,
) -> PPORollout:
    """:func:`ppo_rollout` for episodes: only the model's own tokens (``loss_mask``, (B, L) bool) are actions.

    The model tokens of each row are compacted to the row's start, so the KL penalty, the score's position and GAE
    run over them alone (an environment turn between two model turns is not a step of the recursion: its tokens
    were not chosen by the policy), then every result goes back to its token's place, 0 on environment tokens and
    padding. No cut at the first EOS (each model turn ends in one); ``ended``: (B,) whether the environment ended the
    episode (the missing-EOS penalty's "ended properly"). The values span the model tokens and the column after the
    last one (where TRL's score goes), as :func:`ppo_rollout`'s do. A one-turn episode
    (``loss_mask`` = the response, ending in EOS) gives exactly :func:`ppo_rollout`'s result.
    """
    length = loss_mask.shape[1]
    idx = torch.arange(length, device=loss_mask.device)[None, :]
    ell = length - 1 - first_true_indices(loss_mask.flip(1))  # the last model token (length - 1 - length = -1: none)
    span = loss_mask | (idx == (ell + 1)[:, None])  # as ppo_rollout's values: one column past the last action
    c = lambda t: compact(t, span)
    r = ppo_rollout(
        compact(responses.masked_fill(~loss_mask, pad_token_id), span, pad_token_id),
        c(logprobs),
        c(ref_logprobs),
        c(values),
        scores,
        pad_token_id=pad_token_id,
        stop_token_id=None,
        kl=None if kl is None else c(kl),
        contains_eos=ended,
        **kw,
    )
    back = lambda t: expand(t, span)
    return PPORollout(
        responses=responses,
        num_eos_tokens=r.num_eos_tokens,
        sequence_lengths=ell,
        padding_mask=~loss_mask,
        padding_mask_p1=~span,
        logprobs=back(r.logprobs),
        ref_logprobs=back(r.ref_logprobs),
        values=back(r.values),
        scores=r.scores,
        contains_eos=r.contains_eos,
        kl=back(r.kl),
        non_score_reward=back(r.non_score_reward),
        rewards=back(r.rewards),
        advantages=back(r.advantages),
        returns=back(r.returns),
    )


def rollout_metrics(rollout: PPORollout) -> dict[str, float]:
    """The per-batch ``objective/*`` metrics, named and defined as TRL logs them (sums over tokens, means over rows)."""
    mask = rollout.response_mask.float()
    non_score = rollout.non_score_reward.sum(1).mean()
    return {
        "objective/kl": rollout.kl.sum(1).mean().item(),
        "objective/entropy": (-rollout.logprobs * mask).sum(1).mean().item(),
        "objective/non_score_reward": non_score.item(),
        "objective/rlhf_reward": (non_score + rollout.scores.mean()).item(),
        "objective/scores": rollout.scores.mean().item(),
        "val/num_eos_tokens": float(rollout.num_eos_tokens.item()),
    }
