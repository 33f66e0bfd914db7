"""Online DPO assembled (TRL's ``OnlineDPOTrainer``): the pairs of a rollout batch and each micro-batch's loss.

Each pair is two samples of one prompt, in block layout ``[p0..pP-1, p0..pP-1]`` (2P rows): the chosen answer is the
one with the higher score (ties: the first). The trainer runs the forward passes and the optimizer steps; the DPO loss
itself is :func:`rlhf.algo.losses.dpo_loss`, on log-probs summed over each completion through its EOS.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from rlhf.algo.critic_free import episode_completion_mask
from rlhf.algo.losses import dpo_loss, micro_weight, select_chosen_rejected
from rlhf.algo.masked import masked_mean, masked_sum
from rlhf.algo.ppo import truncate_at_stop
from rlhf.algo.shaping import penalize_missing_eos


class DpoPairs(NamedTuple):
    """A batch's pairs as the loss sees them (:func:`online_dpo_pairs`)."""

    responses: torch.Tensor  # (2P, L) cut after the first EOS; episode rows whole
    mask: torch.Tensor  # (2P, L) bool: each completion's tokens through its EOS (an episode's: its loss mask)
    scores: torch.Tensor  # (2P,) after the missing-EOS penalty
    chosen: torch.Tensor  # (P,) the row of each pair's chosen answer
    rejected: torch.Tensor  # (P,)
    ref_logprobs: torch.Tensor  # (2P, L)
    ref_sums: torch.Tensor  # (2P,) summed over the mask

    def rows(self, pairs: torch.Tensor) -> torch.Tensor:
        """The rows of ``pairs``' chosen answers, then of their rejected ones."""
        return torch.cat([self.chosen[pairs], self.rejected[pairs]])


def online_dpo_pairs(
    responses: torch.Tensor,
    scores: torch.Tensor,
    ref_logprobs: torch.Tensor,
    eos_token_id: int | None,
    pad_token_id: int,
    *,
    missing_eos_penalty: float | None = None,
    loss_mask: torch.Tensor | None = None,
    episodes: torch.Tensor | None = None,
    ended: torch.Tensor | None = None,
) -> DpoPairs:
    """The pairs of 2P rows in block layout (responses, ref_logprobs: (2P, L); scores: (2P,)). A completion counts
    through its first EOS (the pad token excluded, as TRL's mask); with ``episodes`` (2P,) bool, an episode row
    counts its ``loss_mask`` and has ended when the environment ended it (``ended``), as
    :func:`~rlhf.algo.critic_free.episode_completion_mask`."""
    if episodes is None:
        responses = truncate_at_stop(responses, eos_token_id, pad_token_id)
        mask = responses != pad_token_id
        contains_eos = (responses == eos_token_id).any(1)
    else:
        if loss_mask is None or ended is None:
            raise ValueError("episodes need their loss_mask and ended flags")
        responses, mask, contains_eos = episode_completion_mask(
            responses, loss_mask, episodes, ended, eos_token_id, pad_token_id
        )
    scores = penalize_missing_eos(scores, contains_eos, missing_eos_penalty)
    chosen, rejected = select_chosen_rejected(scores, responses.shape[0] // 2)
    return DpoPairs(responses, mask, scores, chosen, rejected, ref_logprobs, masked_sum(ref_logprobs, mask, dim=1))


def online_dpo_micro_loss(
    d: DpoPairs,
    pairs: torch.Tensor,
    whole: torch.Tensor,
    logprobs: torch.Tensor,
    entropies: torch.Tensor,
    *,
    beta: float,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
    entropy_coeff: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of micro-batch ``pairs`` of minibatch ``whole`` (pair indices), weighted to its share of the
    minibatch's loss (a mean over pairs), and its stats.

    logprobs (with grad), entropies: (2p, L) of ``d.rows(pairs)``. With ``entropy_coeff`` the seeds' entropy bonus,
    a token mean over both answers of the minibatch's pairs. stats: ``loss/dpo``, ``policy/entropy``,
    ``objective/kl`` (the summed log-ratio to the reference, per answer) and :func:`dpo_loss`'s.
    """
    rows = d.rows(pairs)
    mask = d.mask[rows]
    sums = masked_sum(logprobs, mask, dim=1)
    n = len(pairs)
    loss, dpo_stats = dpo_loss(
        sums[:n], sums[n:], d.ref_sums[d.chosen[pairs]], d.ref_sums[d.rejected[pairs]], beta=beta, loss_type=loss_type
    )
    total = micro_weight("rows", pairs, whole) * loss
    entropy = masked_mean(entropies, mask)
    if entropy_coeff:
        total = total - entropy_coeff * micro_weight("tokens", mask, d.mask[d.rows(whole)]) * entropy
    kl = masked_sum(logprobs.detach() - d.ref_logprobs[rows], mask, dim=1).mean()
    stats = {"loss/dpo": loss.detach(), "policy/entropy": entropy.detach(), "objective/kl": kl, **dpo_stats}
    return total, stats
