"""Padding-free forward passes: a padded batch's real tokens packed into one row, positions restarting per sequence.

``training.padding_free`` turns it on for the trainer's actor and critic passes and the reference service's forward.
The attention runs per sequence on its own slice of the packed row (causal scaled-dot-product attention), and the
result is laid back out as the padded batch (zeros at padding positions), so callers' indexing, masks and losses stay
as they are. The forward convention is :mod:`rlhf.models`': a token equal to ``pad_token_id`` is padding.

Design (costs, what differs, tests, measurements): docs/training.md#precision-packing-and-devices.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

ATTN_NAME = "rlhf_packed_sdpa"
_registered = False


@dataclass
class Packed:
    input_ids: torch.Tensor  # (1, N) the real tokens, row after row
    position_ids: torch.Tensor  # (1, N) 0..n_i-1 within each sequence
    cu_seqlens: torch.Tensor  # (B + 1,) int64 start offsets of the sequences in the packed row (CPU)
    flat_index: torch.Tensor  # (N,) each packed token's index in the flattened (B * T) batch
    shape: tuple[int, int]  # (B, T)


def pack(query_responses: torch.Tensor, pad_token_id: int) -> Packed:
    """The real (non-pad) tokens of a (B, T) batch, in row order, as one packed row."""
    batch, seq_len = query_responses.shape
    real = query_responses != pad_token_id
    lengths = real.sum(1)
    flat_index = real.reshape(-1).nonzero().squeeze(1)
    input_ids = query_responses.reshape(-1)[flat_index].unsqueeze(0)
    position_ids = (real.cumsum(1) - 1).reshape(-1)[flat_index].unsqueeze(0)
    cu = torch.zeros(batch + 1, dtype=torch.long)
    cu[1:] = lengths.cpu().cumsum(0)
    return Packed(input_ids, position_ids, cu, flat_index, (batch, seq_len))


def unpack(packed_out: torch.Tensor, p: Packed) -> torch.Tensor:
    """(1, N, ...) outputs of a packed pass -> (B, T, ...) with zeros at the padding positions (differentiable)."""
    batch, seq_len = p.shape
    rest = packed_out.shape[2:]
    flat = packed_out.new_zeros((batch * seq_len, *rest))
    return flat.index_copy(0, p.flat_index, packed_out[0]).reshape(batch, seq_len, *rest)


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention of each sequence over itself: query/key/value (1, H, N, D) of a packed row, the sequences'
    bounds in ``cu_seq_lens_q``. Returns (1, N, H, D) as transformers' attention functions do."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError("packed attention needs cu_seq_lens_q (call it through rlhf.packing)")
    gqa = key.shape[1] != query.shape[1]
    bounds = cu.tolist()
    outs = []
    # sequences of one length run as one batched call (the common case: many equally long rows)
    start = 0
    while start < len(bounds) - 1:
        n = bounds[start + 1] - bounds[start]
        end = start + 1
        while end < len(bounds) - 1 and bounds[end + 1] - bounds[end] == n:
            end += 1
        s, e, k = bounds[start], bounds[end], end - start
        if n > 0:
            q = query[0, :, s:e].unflatten(1, (k, n)).transpose(0, 1)  # (k, H, n, D)
            kk = key[0, :, s:e].unflatten(1, (k, n)).transpose(0, 1)
            vv = value[0, :, s:e].unflatten(1, (k, n)).transpose(0, 1)
            o = torch.nn.functional.scaled_dot_product_attention(
                q, kk, vv, is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa
            )  # (k, H, n, D)
            outs.append(o.transpose(1, 2).reshape(k * n, o.shape[1], o.shape[3]))  # (k*n, H, D)
        start = end
    return torch.cat(outs, 0).unsqueeze(0), None


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface  # noqa: PLC0415 - transformers: loaded with the first model

        AttentionInterface.register(ATTN_NAME, packed_attention)
        _registered = True


@contextlib.contextmanager
def _packed_attention(model):
    """The model's attention implementation switched to :func:`packed_attention` for one call. Not in transformers'
    mask registry, so the model builds no (B, T, T) mask either. The model must not run on another thread meanwhile
    (the trainer and the reference service use each model from one thread at a time)."""
    _register()
    cfg = model.config
    before = cfg._attn_implementation
    cfg._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        cfg._attn_implementation = before


def _kwargs(p: Packed) -> dict:
    cu = p.cu_seqlens
    return {
        "input_ids": p.input_ids,
        "position_ids": p.position_ids,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int((cu[1:] - cu[:-1]).max()),
        "max_length_k": int((cu[1:] - cu[:-1]).max()),
    }


def packed_causal_lm_logits(model, query_responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """:func:`rlhf.models.causal_lm_logits` without computing on padding: (B, T, V), zeros at padding positions."""
    p = pack(query_responses, pad_token_id)
    with _packed_attention(model):
        logits = model(**_kwargs(p), return_dict=True, use_cache=False).logits
    return unpack(logits, p)


def packed_score_head_outputs(model, query_responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """:func:`rlhf.models.score_head_outputs` without computing on padding: (B, T), zeros at padding positions."""
    p = pack(query_responses, pad_token_id)
    backbone = getattr(model, model.base_model_prefix)
    with _packed_attention(model):
        hidden = backbone(**_kwargs(p), return_dict=True, use_cache=False).last_hidden_state
    return unpack(model.score(hidden).squeeze(-1), p)
