"""Reward shaping every stage applies to a sequence score before its own advantage or preference math."""

from __future__ import annotations

import torch


def penalize_missing_eos(scores: torch.Tensor, contains_eos: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """``scores`` less ``penalty`` where the response has no EOS (TRL's ``missing_eos_penalty``: a truncated
    response is worse than a finished one with the same score). scores: (B,); contains_eos: (B,) bool."""
    if not penalty:
        return scores
    return scores - penalty * (~contains_eos.bool()).to(scores.dtype)


REWARD_BASELINES = ("none", "leave_one_out", "group_mean")


def subtract_reward_baseline(scores: torch.Tensor, group: torch.Tensor, baseline: str = "none") -> torch.Tensor:
    """Seed 002's reward baseline ``r(x, y) - r(x, y_ref)``, ``y_ref`` sampled from the current policy for the same
    prompt: the other samples of the prompt are the ``y_ref``.

    scores, group: (B,) (``group``: which prompt each row answers) -> (B,) in the dtype of ``scores``.
      ``leave_one_out``: ``r_i - mean_{j != i} r_j`` over the prompt's samples (two samples: ``r_1 - r_2``);
      ``group_mean``:    ``r_i - mean_j r_j`` (the row itself included);
      ``none``:          ``scores`` unchanged.
    A prompt with a single sample (the others failed scoring) has no ``y_ref``: its row gets 0 either way.
    """
    if baseline not in REWARD_BASELINES:
        raise ValueError(f"reward baseline must be one of {REWARD_BASELINES}, got {baseline!r}")
    if baseline == "none":
        return scores
    r = scores.double()
    out = torch.zeros_like(r)
    for g in torch.unique(group).tolist():
        rows = (group == g).nonzero().flatten()
        n = rows.numel()
        if n < 2:
            continue
        total = r[rows].sum()
        ref = (total - r[rows]) / (n - 1) if baseline == "leave_one_out" else total / n
        out[rows] = r[rows] - ref
    return out.to(scores.dtype)
