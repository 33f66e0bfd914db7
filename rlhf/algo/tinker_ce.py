"""Placeholder for :mod:`rlhf.algo.tinker_losses` (written on another branch): the tinker SDK's ``cross_entropy`` only,
with the same signature, so that the training service runs before that module is merged. Once it is, the service
imports ``tinker_loss`` from there and this file goes.

``cross_entropy`` as the SDK documents it: ``loss = -(weights * logprobs).sum()`` over one datum's tokens (a sum, not a
mean: the caller scales ``weights``); metric ``loss:sum``.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_NAMES = ("cross_entropy",)


def tinker_loss(
    name: str, logprobs: Tensor, inputs: dict[str, Tensor], config: dict | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Loss of one datum: ``logprobs`` [T] are the model's log-probs of ``inputs["target_tokens"]``."""
    if name != "cross_entropy":
        raise ValueError(f"loss_fn {name!r} is not built yet; this build has: {', '.join(LOSS_NAMES)}")
    if config:
        raise ValueError(f"cross_entropy takes no loss_fn_config (got {sorted(config)})")
    weights = inputs.get("weights")
    if weights is None:
        weights = torch.ones_like(logprobs)
    loss = -(weights.to(logprobs.dtype) * logprobs).sum()
    return loss, {"loss:sum": float(loss.detach())}
