"""Per-token log-probabilities and entropies from logits."""

from __future__ import annotations

import torch


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # Work in float32 at least: bf16 log-softmax loses the precision that ratios and KL need.
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return logits / temperature if temperature != 1.0 else logits


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``tokens``.

    logits: (..., V), tokens: (...) integer -> (...) float32 (or float64 for float64 logits).
    TRL's PPO divides by ``T + 1e-7``; pass that value to reproduce it exactly. Computed as
    ``gather(z) - logsumexp(z)``, which never materialises the full (..., V) log-softmax.
    """
    z = _scaled(logits, temperature)
    picked = torch.gather(z, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position: (..., V) -> (...)."""
    z = _scaled(logits, temperature)
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
