"""Reward shaping every stage applies to a sequence score before its own advantage or preference math."""

from __future__ import annotations

import torch


def penalize_missing_eos(scores: torch.Tensor, contains_eos: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """``scores`` less ``penalty`` where the response has no EOS (TRL's ``missing_eos_penalty``: a truncated
    response is worse than a finished one with the same score). scores: (B,); contains_eos: (B,) bool."""
    if not penalty:
        return scores
    return scores - penalty * (~contains_eos.bool()).to(scores.dtype)
