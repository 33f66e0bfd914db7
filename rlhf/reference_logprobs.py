"""Per-token log-probs of given responses under a causal LM, computed as the reference service computes them: each
item's prompt + response right-padded, items grouped by length into micro-batches, ``log_softmax(logits / T)``
gathered at the response tokens in float32. The reference service (services/reference/engine.py) and the trainer's
in-process step (services/trainer/in_process.py) both call :func:`response_logprobs`, so the two agree exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.algo import logprobs_from_logits
from rlhf.models import causal_lm_logits

# The (B, T, V) logits of one micro-batch stay within this (a 128k vocabulary makes full-length logits the largest
# tensor by far)
LOGITS_BUDGET_BYTES = 2 << 30


def micro_batches(lengths: Sequence[int], micro_batch_size: int, vocab_size: int) -> list[list[int]]:
    """Item indices in consecutive groups of the length-sorted items: at most ``micro_batch_size`` rows, and logits
    within :data:`LOGITS_BUDGET_BYTES`."""
    per_token = max(1, vocab_size) * 4 * 2  # float32 logits + the log-softmax temporary
    groups: list[list[int]] = []
    cur: list[int] = []
    for k in sorted(range(len(lengths)), key=lambda k: lengths[k]):  # ascending: the newest item sets the width
        width = lengths[k]
        if cur and (len(cur) >= micro_batch_size or (len(cur) + 1) * width * per_token > LOGITS_BUDGET_BYTES):
            groups.append(cur)
            cur = []
        cur.append(k)
    if cur:
        groups.append(cur)
    return groups


def response_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    temperature: float,
    micro_batch_size: int,
    packed: bool = False,
) -> list[torch.Tensor]:
    """Each item's response log-probs (float32, on the CPU) under ``model`` at ``temperature``: position t of the
    prompt + response predicts token t + 1. ``packed``: the padding-free forward (``training.padding_free``)."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    out: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    with torch.inference_mode():
        for idx in micro_batches([len(s) for s in seqs], micro_batch_size, vocab):
            width = max(len(seqs[k]) for k in idx)
            batch = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
            for r, k in enumerate(idx):
                batch[r, : len(seqs[k])] = torch.tensor(seqs[k], dtype=torch.long)
            batch = batch.to(device)
            logits = causal_lm_logits(model, batch, pad_token_id, packed)
            lp = logprobs_from_logits(logits[:, :-1], batch[:, 1:], temperature).float().cpu()
            for r, k in enumerate(idx):
                p, n = len(prompts[k]), len(responses[k])
                out[k] = lp[r, p - 1 : p - 1 + n]
    return out
