"""Masked statistics over padded (batch, time) tensors.

``mask`` is bool or 0/1 float, broadcastable to ``values``. Formulas follow TRL's PPO trainer (unbiased variance,
``rsqrt(var + 1e-8)``) so that whitened advantages match it; the edge cases TRL leaves to NaN are defined here.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set. values, mask: (B, L) -> scalar, or (B,) with ``dim=1``.

    Masked entries are selected away, not multiplied by 0, so an inf or NaN there (a padded log-prob) stays out.
    """
    picked = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the set positions of ``mask``.

    values, mask: (B, L). ``dim=None`` -> scalar token-mean over the batch; ``dim=1`` -> (B,) per-row means.
    A selection with no set position has mean 0 (TRL returns NaN), so an all-masked row cannot poison a loss.
    """
    total = masked_sum(values, mask, dim)
    mask = mask.bool().expand_as(values).to(values.dtype)
    count = mask.sum() if dim is None else mask.sum(dim)
    return torch.where(count > 0, total / count.clamp(min=torch.finfo(values.dtype).tiny), torch.zeros_like(total))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of ``values`` (all of them together): scalar.

    Unbiased (N / (N - 1)) by default, as TRL. With a single set entry the Bessel factor is 1 (as MindSpeed-LLM) and the
    variance is 0 instead of TRL's inf/NaN. Raises ``ValueError`` when nothing is set.
    """
    count = mask.to(values.dtype).sum()
    if count.item() == 0:
        raise ValueError("masked_var: the mask selects no element")
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased and count.item() > 1:
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, unbiased: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise the masked entries to zero mean and unit variance: ``(x - mean) * rsqrt(var + eps)``.

    values, mask: (B, L) -> (B, L). With ``shift_mean=False`` the mean is added back (TRL's reward whitening).
    Entries outside the mask are transformed too; callers zero them if they need to.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=unbiased)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def compact(values: torch.Tensor, mask: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
    """Each row's entries under ``mask``, moved to the row's start in order, ``fill`` after them (same shape).

    An episode's model tokens sit between environment tokens; a recursion over "the next token" (GAE) must step from
    one model token to the next, so it runs on the compacted rows and :func:`expand` puts the results back."""
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # masked positions first, in order
    kept = torch.arange(mask.shape[1], device=mask.device)[None, :] < mask.sum(1, keepdim=True)
    return torch.where(kept, values.gather(1, order), torch.full_like(values, fill))


def expand(values: torch.Tensor, mask: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
    """The inverse of :func:`compact`: each row's first ``mask.sum()`` entries back at the positions under ``mask``,
    ``fill`` elsewhere."""
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    out = torch.empty_like(values).scatter_(1, order, values)
    return torch.where(mask, out, torch.full_like(values, fill))
