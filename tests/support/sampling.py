"""Responses sampled from a trainer's own actor, for records built without a rollout replica (imports torch, so it is
not in ``tests.support``'s namespace: ``from tests.support.sampling import actor_samples``)."""

from __future__ import annotations

import torch


def actor_samples(engine, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``ids`` (rows of equal-length prompts) each followed by exactly ``new_tokens`` tokens sampled from
    ``engine.actor`` at temperature 1 (``top_k`` off, no stop at EOS), as transformers' generate returns them."""
    with torch.no_grad():
        return engine.actor.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            top_k=0,
            pad_token_id=engine.pad_id,
            eos_token_id=None,
        )
