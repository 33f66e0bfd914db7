"""The built-in losses of the Tinker training API (``forward_backward(data, loss_fn=..., loss_fn_config=...)``).

One datum is one sequence: ``logprobs[i]`` are the current model's log-probs of datum ``i``'s ``target_tokens``
(shape (N,), or (N, K) for top-K ``cross_entropy``) and ``inputs[i]`` its ``loss_fn_inputs`` as tensors, named as the
``tinker`` SDK names them. Every loss is a sum over tokens and over data, never a mean (Tinker: "for all objectives we
sum the token-level losses over the sequence length"); a client that wants another aggregation scales its
advantages or weights. Formulas, sources and defaults: docs/tinker-losses.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

LOSSES: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")

# loss_fn_inputs each loss takes, all required. A key outside its set is refused, not ignored: Tinker's server refuses
# unknown keys too (tinker-cookbook strips its "mask" key before forward_backward for that reason).
_RL_KEYS = ("target_tokens", "logprobs", "advantages")
_INPUT_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": _RL_KEYS,
    "ppo": _RL_KEYS,
    "cispo": _RL_KEYS,
    "dro": _RL_KEYS,
    "gspo": (*_RL_KEYS, "sequence_ratio_mask"),
}

# loss_fn_config keys and their defaults (None config = these). Clip thresholds bound the ratio itself (0.8, 1.2),
# not an epsilon around 1.
_CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": _CLIP_DEFAULTS,
    # one-sided by default: no lower bound, the coefficient capped at 4 (Tinker's tutorial 202)
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    # Tinker documents no default beta; 0.05 is the value every one of its examples passes
    "dro": {"beta": 0.05},
    "gspo": _CLIP_DEFAULTS,
}

# The SDK's own loss types this module does not implement, and why (said in the error).
_NOT_HERE = {
    "custom": "forward_backward_custom runs the loss on the client: it calls forward, then cross_entropy with "
    "weights = -dLoss/dlogprobs",
    "stable_reinforce": "alpha in Tinker: its docs give no objective, and it reads stability information that "
    "Tinker's sampler records per sequence_id",
}

Metrics = dict[str, float]


def tinker_loss(
    name: str,
    logprobs: Sequence[torch.Tensor],
    inputs: Sequence[Mapping[str, torch.Tensor]],
    config: Mapping[str, object] | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The scalar loss to backpropagate and the metrics Tinker returns for it (``{"loss:sum": ...}``).

    ``logprobs[i]``: datum ``i``'s target log-probs (requires grad), shaped as its ``target_tokens``; ``inputs[i]``:
    its ``loss_fn_inputs`` as tensors; ``config``: ``loss_fn_config`` (None: the defaults). Raises ``ValueError``
    naming the loss, key or datum for an unknown loss, a missing, extra or mis-shaped input, or a bad config value.
    """
    if name not in LOSSES:
        why = f" ({_NOT_HERE[name]})" if name in _NOT_HERE else ""
        raise ValueError(f"unsupported loss_fn {name!r}{why}; supported: {', '.join(LOSSES)}")
    settings = _settings(name, config)
    if len(logprobs) != len(inputs):
        raise ValueError(f"{len(logprobs)} logprob tensors for {len(inputs)} data")
    if not inputs:
        raise ValueError(f"{name}: no data")
    per_datum = _PER_DATUM[name]
    total = None
    for i, (target_logprobs, datum) in enumerate(zip(logprobs, inputs, strict=True)):
        tensors = _checked_inputs(name, i, target_logprobs, datum)
        loss_i = per_datum(target_logprobs, tensors, settings, i)
        total = loss_i if total is None else total + loss_i
    assert total is not None
    return total, {"loss:sum": float(total.detach())}


# Per-datum losses: target log-probs p (requires grad), the datum's inputs cast to p's dtype, the settings.
# q = the sampler's log-probs (inputs["logprobs"]), A = advantages.


def _cross_entropy(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float], i: int) -> torch.Tensor:
    # weights may be any real: forward_backward_custom sends weights = -dLoss/dlogprobs through this loss. A weight-0
    # token is selected away, not multiplied by 0, so a -inf log-prob there stays out of the sum
    weights = x["weights"]
    return -torch.where(weights != 0, p * weights, torch.zeros((), dtype=p.dtype, device=p.device)).sum()


def _importance_sampling(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float], i: int) -> torch.Tensor:
    ratio = torch.exp(p - x["logprobs"])
    return -(ratio * x["advantages"]).sum()


def _ppo(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float], i: int) -> torch.Tensor:
    ratio = torch.exp(p - x["logprobs"])
    return _clipped_surrogate(ratio, x["advantages"], cfg)


def _cispo(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float], i: int) -> torch.Tensor:
    # the clipped ratio is a constant coefficient on log p: clipping bounds a token's gradient, never zeroes it
    ratio = torch.exp(p.detach() - x["logprobs"])
    coefficient = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(coefficient * p * x["advantages"]).sum()


def _dro(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float], i: int) -> torch.Tensor:
    penalty = (p - x["logprobs"]).square()
    return -(p * x["advantages"] - 0.5 * cfg["beta"] * penalty).sum()


def _gspo(p: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float], i: int) -> torch.Tensor:
    # GSPO-token: every token carries the sequence ratio's value (geometric mean of the token ratios over the masked
    # tokens) and the gradient of its own log-prob, so per-token advantages still work
    in_ratio = x["sequence_ratio_mask"] != 0
    if not bool(in_ratio.any()):
        raise ValueError(f"gspo: datum {i}: sequence_ratio_mask marks no token, so the sequence ratio is undefined")
    log_ratio = (p.detach() - x["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + p - p.detach())
    return _clipped_surrogate(ratio, x["advantages"], cfg)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, cfg: dict[str, float]) -> torch.Tensor:
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


_PER_DATUM: dict[str, Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float], int], torch.Tensor]] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
}


def _settings(name: str, config: Mapping[str, object] | None) -> dict[str, float]:
    defaults = _CONFIG_DEFAULTS[name]
    settings = dict(defaults)
    for key, value in (config or {}).items():
        if key not in defaults:
            takes = f"takes {', '.join(sorted(defaults))}" if defaults else "takes no loss_fn_config"
            raise ValueError(f"{name}: unknown loss_fn_config key {key!r}; {name} {takes}")
        # the SDK types config values float | str; a string is no number here
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{name}: loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        settings[key] = float(value)
    if "clip_low_threshold" in settings:
        low, high = settings["clip_low_threshold"], settings["clip_high_threshold"]
        if not 0.0 <= low <= high:
            raise ValueError(
                f"{name}: loss_fn_config needs 0 <= clip_low_threshold <= clip_high_threshold "
                f"(bounds on the ratio itself, e.g. 0.8 and 1.2), got {low} and {high}"
            )
    if settings.get("beta", 0.0) < 0:
        raise ValueError(f"{name}: loss_fn_config['beta'] must be >= 0, got {settings['beta']}")
    return settings


def _checked_inputs(
    name: str, i: int, target_logprobs: torch.Tensor, datum: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Datum ``i``'s inputs, checked against the loss and the target log-probs, cast to their dtype and device."""
    keys = _INPUT_KEYS[name]
    extra = sorted(set(datum) - set(keys))
    if extra:
        raise ValueError(f"{name}: datum {i}: loss_fn_inputs {extra} are not inputs of {name}; it takes {list(keys)}")
    missing = [key for key in keys if key not in datum]
    if missing:
        raise ValueError(f"{name}: datum {i}: missing loss_fn_inputs {missing}; {name} takes {list(keys)}")
    for key in keys:
        if not isinstance(datum[key], torch.Tensor):
            kind = type(datum[key]).__name__
            raise ValueError(f"{name}: datum {i}: loss_fn_inputs[{key!r}] is a {kind}, not a tensor")
    targets = datum["target_tokens"]
    # top-K targets (N, K) are cross_entropy's alone (distillation onto a teacher's K tokens per position)
    ndims = (1, 2) if name == "cross_entropy" else (1,)
    if targets.dim() not in ndims or targets.shape[0] == 0 or (targets.dim() == 2 and targets.shape[1] == 0):
        shape = "(N,) or (N, K)" if name == "cross_entropy" else "(N,)"
        raise ValueError(f"{name}: datum {i}: target_tokens must be non-empty {shape}, got {tuple(targets.shape)}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"{name}: datum {i}: target_tokens must be integer token ids, got {targets.dtype}")
    if not isinstance(target_logprobs, torch.Tensor) or target_logprobs.shape != targets.shape:
        got = tuple(target_logprobs.shape) if isinstance(target_logprobs, torch.Tensor) else type(target_logprobs)
        raise ValueError(f"{name}: datum {i}: target log-probs {got} do not match target_tokens {tuple(targets.shape)}")
    if not target_logprobs.is_floating_point():
        raise ValueError(f"{name}: datum {i}: target log-probs must be floating point, got {target_logprobs.dtype}")
    out = {"target_tokens": targets}
    for key in keys[1:]:
        value = datum[key]
        if value.shape != targets.shape:
            raise ValueError(
                f"{name}: datum {i}: loss_fn_inputs[{key!r}] has shape {tuple(value.shape)}, "
                f"target_tokens {tuple(targets.shape)}"
            )
        if value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{name}: datum {i}: loss_fn_inputs[{key!r}] must be real numbers, got {value.dtype}")
        value = value.to(device=target_logprobs.device, dtype=target_logprobs.dtype)
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name}: datum {i}: loss_fn_inputs[{key!r}] has a NaN or infinite value")
        out[key] = value
    return out
