"""Trainer-inference consistency: how far the rollout engine's sampling log-probs are from the trainer's.

For tokens sampled by the same weights, the engine's log-prob and the trainer's recomputation differ only by numerics
(kernels, dtype, batch shape): ~0 in fp32, small in bf16. A large value means the samples did not come from the
weights their version names (a replica that acknowledged a push but serves other weights), or that the two sides do
not compute the same distribution (another temperature, top-p/top-k truncation, penalties).
"""

from __future__ import annotations

import torch

from rlhf.algo.kl import kl_estimate
from rlhf.algo.masked import masked_sum


def logprob_mismatch(
    logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """k3 estimate of KL(sampler || trainer) and the largest per-token log-prob difference over the masked tokens.

    logprobs: (B, L) the trainer's log-probs of the sampled tokens, at the sampling temperature, under the weights
    the samples' version names; sampling_logprobs: (B, L) the engine's; mask: (B, L) bool, the response tokens
    (padding unset); rows: (B,) bool, the rows to compare (on-policy, with sampling log-probs; default all).

    With ``d = logprobs - sampling_logprobs``, per token ``exp(d) - 1 - d``: Schulman's k3 with the sampler as the
    distribution the tokens were drawn from (``kl_estimate(sampling_logprobs, logprobs, "k3")``), unbiased for
    KL(sampler || trainer) and never negative. Computed in float32 at least.

    Returns (float tensors):
      ``kl``          ()    the token mean of k3 (0 when no token is compared)
      ``max_abs``     ()    max |d| (0 when no token is compared)
      ``tokens``      ()    tokens compared
      ``row_kl_sum``  (B,)  each row's sum of k3 (to attribute the mismatch to the rows' sources)
      ``row_tokens``  (B,)  each row's tokens compared
    """
    mask = mask.bool() if rows is None else mask.bool() & rows.bool()[:, None]
    k3 = kl_estimate(sampling_logprobs, logprobs, "k3")
    zero = torch.zeros((), dtype=k3.dtype, device=k3.device)
    # selected, not multiplied: a padded -inf log-prob must not make a NaN
    diff = torch.where(mask, logprobs.to(k3.dtype) - sampling_logprobs.to(k3.dtype), zero).abs()
    row_kl_sum = masked_sum(k3, mask, dim=1)
    row_tokens = mask.sum(1).to(k3.dtype)
    tokens = row_tokens.sum()
    kl = torch.where(tokens > 0, row_kl_sum.sum() / tokens.clamp(min=1), zero)
    max_abs = diff.max() if diff.numel() else zero
    return {"kl": kl, "max_abs": max_abs, "tokens": tokens, "row_kl_sum": row_kl_sum, "row_tokens": row_tokens}
