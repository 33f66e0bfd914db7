"""The trainer's optimizers: AdamW settings per role, the learning-rate schedule, gradient clipping and
micro-batch splitting.

Kept apart from the update step (engine.py) so the step reads as the algorithm: which AdamW settings a role gets,
what its learning rate is at a step, what a gradient's norm is (over every rank's shards), and how a minibatch splits
into micro-batches whose weighted losses (``rlhf.algo.losses.micro_weight``) add up to the minibatch's loss (so k
micro-batches give the gradient of one pass over the whole minibatch).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlhf import distributed as dist
from rlhf.algo.losses import micro_weight as micro_weight  # re-exported: the stages' micro-batch weights
from rlhf.algo.schedule import lr_at
from rlhf.config import ExperimentConfig


@dataclass(frozen=True)
class RoleOptim:
    lr: float
    min_lr: float
    weight_decay: float
    betas: tuple[float, float]
    clip_grad: float
    decay_style: str
    warmup_fraction: float


def _pick(role_value, default):
    return default if role_value is None else role_value


def actor_optim(cfg: ExperimentConfig) -> RoleOptim:
    return _role_optim(cfg.actor, cfg.training)


def critic_optim(cfg: ExperimentConfig) -> RoleOptim:
    return _role_optim(cfg.critic, cfg.training)


def _role_optim(r, t) -> RoleOptim:
    """A role's settings (actor or critic): its own section's (MindSpeed's per-role fields) where set, else the
    training section's."""
    return RoleOptim(
        lr=r.lr or t.lr,
        min_lr=_pick(r.min_lr, t.min_lr),
        weight_decay=_pick(r.weight_decay, t.weight_decay),
        betas=(_pick(r.adam_beta1, t.adam_beta1), _pick(r.adam_beta2, t.adam_beta2)),
        clip_grad=_pick(r.clip_grad, t.clip_grad),
        decay_style=_pick(r.lr_decay_style, t.lr_decay_style),
        warmup_fraction=_pick(r.lr_warmup_fraction, t.lr_warmup_fraction),
    )


def adamw(model: torch.nn.Module, role: RoleOptim, fused: bool) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    return torch.optim.AdamW(params, lr=role.lr, betas=role.betas, weight_decay=role.weight_decay, fused=fused)


def set_lr(opt: torch.optim.Optimizer, role: RoleOptim, step: int, total_steps: int) -> float:
    """Set every parameter group of ``opt`` to the scheduled rate of training step ``step`` (0-based); returns it.
    Stateless (a function of the step), so a resumed run continues the schedule from its step count."""
    value = lr_at(
        step,
        lr=role.lr,
        min_lr=role.min_lr,
        total_steps=total_steps,
        warmup_fraction=role.warmup_fraction,
        style=role.decay_style,
    )
    for group in opt.param_groups:
        group["lr"] = value
    return value


def micro_batches(rows: torch.Tensor, size: int | None) -> Iterator[torch.Tensor]:
    """Split a minibatch's row indices into micro-batches of ``size`` (None: one, the whole minibatch)."""
    if size is None or size >= len(rows):
        yield rows
        return
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


def clip(model: torch.nn.Module, max_norm: float) -> float:
    """Clip ``model``'s gradient to ``max_norm`` (0 or None: only measure it); returns the norm before clipping, NaN
    when it is not finite."""
    if max_norm and max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    else:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads and hasattr(grads[0], "full_tensor"):  # sharded (FSDP2): the norm over every rank's shards
            norm = torch.nn.utils.get_total_norm(grads)
        else:
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    value = float(dist.full_value(norm))
    return value if math.isfinite(value) else float("nan")


class Joint:
    """Optimizers stepped as one: ``critic.shared_backbone``'s actor and value head, whose joint loss has one
    backward (each keeps its own settings and state, so checkpoints hold them as for a separate critic)."""

    def __init__(self, *opts: torch.optim.Optimizer):
        self.opts = opts

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.opts:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.opts:
            opt.step()


def append_stats(acc: dict[str, list[float]], values: dict[str, float]) -> None:
    """A micro-batch's stats onto the step's lists (a step reports each one's mean)."""
    for k, v in values.items():
        acc.setdefault(k, []).append(float(v))
