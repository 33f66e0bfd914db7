"""Learning-rate schedules by training step (Megatron's ``lr_decay_style`` / ``lr_warmup_fraction`` / ``min_lr``)."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, total_steps: int, warmup_fraction: float, style: str) -> float:
    """Learning rate of training step ``step`` (0-based) out of ``total_steps``.

    Warm-up: ``lr * (step + 1) / W`` for the first ``W = round(warmup_fraction * total_steps)`` steps (the first step
    already moves, as Megatron's). Then, with ``r = (step - W) / (total_steps - 1 - W)`` going 0 -> 1 up to the last
    step: ``constant`` lr; ``linear`` lr - (lr - min_lr) r; ``cosine`` min_lr + (lr - min_lr) (1 + cos(pi r)) / 2.
    """
    if style not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr_decay_style {style!r}; expected constant, linear or cosine")
    warmup = round(warmup_fraction * total_steps)
    if step < warmup:
        return lr * (step + 1) / warmup
    if style == "constant":
        return lr
    span = max(total_steps - 1 - warmup, 1)
    r = min(max((step - warmup) / span, 0.0), 1.0)
    if style == "linear":
        return lr - (lr - min_lr) * r
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * r))
