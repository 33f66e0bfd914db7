"""Reward normalisation by running or fixed statistics and reward clipping (OpenRLHF's PPO tricks, seed 002)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RunningMoments:
    """Mean and variance of every value seen so far, merged batch by batch (Chan et al.'s parallel update), in
    float64 so a long run does not drift."""

    def __init__(self, count: float = 0.0, mean: float = 0.0, var: float = 1.0):
        self.count, self.mean, self.var = float(count), float(mean), float(var)

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        b_mean, b_var = x.mean().item(), x.var(unbiased=False).item()
        total = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * n + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        return self.var**0.5

    def state(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "var": self.var}


@dataclass(frozen=True)
class FixedMoments:
    """Statistics given up front: the reward model's training-set mean and std (OpenRLHF's reward model stores them in
    its config.json as ``mean`` and ``std`` and divides by the std as it is, with no epsilon)."""

    mean: float
    std: float

    def __post_init__(self) -> None:
        if not self.std > 0:
            raise ValueError(f"the std of fixed reward statistics must be > 0, got {self.std}")

    def update(self, x: torch.Tensor) -> None:
        """Fixed: nothing to learn from the scores."""


def normalize_and_clip(
    scores: torch.Tensor,
    moments: RunningMoments | FixedMoments | None,
    clip_range: tuple[float, float] | None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """(B,) scores -> ``(scores - mean) / std`` with ``moments`` (running ones already updated with this batch; their
    std gets ``eps`` added, fixed ones are used as given), then clipped to ``clip_range``; either step is skipped when
    its argument is None."""
    if moments is not None:
        std = moments.std if isinstance(moments, FixedMoments) else moments.std + eps
        scores = (scores - moments.mean) / std
    if clip_range is not None:
        scores = scores.clamp(clip_range[0], clip_range[1])
    return scores
