"""Evaluation metrics on held-out prompts (the ``eval`` section): the arithmetic, apart from how the samples are made.

Per prompt, ``n`` samples, each with a reward or ``None`` when its score failed (an error, never a reward of 0, and
counted as not passing): ``eval/reward_mean``, ``eval/pass@k`` (k = n) and, with n > 1, ``eval/pass@1`` (the Codex
paper's unbiased estimate, :func:`pass_at_k`), ``eval/response_length_mean``, ``eval/failed_fraction``.
Definitions: docs/training.md (the ``eval`` section).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for ``c`` passing samples of ``n`` (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (n {n}, c {c}, k {k})")
    return 1.0 - comb(n - c, k) / comb(n, k)


def eval_metrics(
    rewards: Sequence[Sequence[float | None]], lengths: Sequence[Sequence[int]], pass_threshold: float
) -> dict[str, float]:
    """The ``eval/*`` metrics of one evaluation: ``rewards[i][j]`` / ``lengths[i][j]`` of sample j of prompt i
    (``None``: the score failed); every prompt has the same number of samples n."""
    if not rewards or len(rewards) != len(lengths):
        raise ValueError(f"{len(rewards)} prompts' rewards, {len(lengths)} prompts' lengths")
    n = len(rewards[0])
    if n == 0 or any(len(r) != n or len(ln) != n for r, ln in zip(rewards, lengths, strict=True)):
        raise ValueError("every prompt needs the same number (> 0) of samples, rewards and lengths")
    scored = [x for r in rewards for x in r if x is not None]
    total = n * len(rewards)
    passing = [sum(x is not None and x >= pass_threshold for x in r) for r in rewards]
    out = {
        "eval/prompts": float(len(rewards)),
        "eval/samples": float(total),
        "eval/reward_mean": sum(scored) / len(scored) if scored else float("nan"),
        f"eval/pass@{n}": sum(c > 0 for c in passing) / len(rewards),
        "eval/response_length_mean": sum(x for ln in lengths for x in ln) / total,
        "eval/failed_fraction": (total - len(scored)) / total,
    }
    if n > 1:
        out["eval/pass@1"] = sum(pass_at_k(n, c, 1) for c in passing) / len(rewards)
    return out
