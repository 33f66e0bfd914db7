"""The SFT (next-token) loss of PPO-ptx: the pre-training objective mixed into the actor loss (InstructGPT;
OpenRLHF's ``ptx_coef``)."""

from __future__ import annotations

import torch

from rlhf.algo.logprobs import logprobs_from_logits
from rlhf.algo.masked import masked_mean


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of each next token.

    logits: (B, T, V) of ``input_ids`` (B, T); mask: (B, T) True where a token is real. Position t predicts token
    t + 1; the mean runs over the predicted tokens that are real.
    """
    logp = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])
    return -masked_mean(logp, mask[:, 1:])


def best_of_group(scores: torch.Tensor, group: torch.Tensor, min_score: float | None = None) -> torch.Tensor:
    """Rejection sampling's pick: the row of the highest score in each group (the first on a tie), groups in
    ascending order; a group whose best score is below ``min_score`` gives none. scores, group: (B,) -> (G',) long."""
    kept = []
    for g in torch.unique(group):  # sorted
        rows = (group == g).nonzero().squeeze(1)
        best = rows[torch.argmax(scores[rows])]  # argmax: the first of equal maxima
        if min_score is None or scores[best].item() >= min_score:
            kept.append(best)
    return torch.stack(kept) if kept else torch.empty(0, dtype=torch.long, device=scores.device)
