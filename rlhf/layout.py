"""The checkpoint layout: a policy's weights under the names and shapes its Hugging Face checkpoint holds.

Weight sync sends what ``save_pretrained`` would write, because that is what a serving engine loads. A live
transformers 5 module differs from its checkpoint by tied weights (one tensor under two names: the alias is not sent)
and conversions (e.g. fused mixture-of-experts tensors); :class:`CheckpointLayout` undoes both the way
``save_pretrained`` does, tensor by tensor, and :meth:`CheckpointLayout.to_live` goes back for the hf engine.

Design: docs/training.md#models-the-architectures-checked.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def _pretrained(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a wrapper (a peft model's base model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


class CheckpointLayout:
    """Live names -> checkpoint names of one model. ``live`` maps the live state dict's names to tensors or
    anything with ``shape`` and ``dtype`` (DTensors: their global shape); only names and shapes are read."""

    def __init__(self, model: torch.nn.Module, live: Mapping[str, torch.Tensor]):
        from transformers.core_model_loading import revert_weight_conversion  # noqa: PLC0415 - transformers: loaded with the first model

        self.model = _pretrained(model)
        self._revert = revert_weight_conversion
        meta = {k: _meta(v) for k, v in live.items()}
        self.aliases = frozenset(tie_aliases(self.model) & set(meta))
        self.plan: dict[str, list[Spec]] = {}  # live name -> its checkpoint tensors (empty: an alias, not sent)
        self.converted: set[str] = set()
        for name, t in meta.items():
            if name in self.aliases:
                self.plan[name] = []
                continue
            out = revert_weight_conversion(self.model, {name: t})
            self.plan[name] = [(n, v.dtype, tuple(v.shape)) for n, v in out.items()]
            if list(out) != [name] or tuple(out[name].shape) != tuple(t.shape):
                self.converted.add(name)
        names = [n for specs in self.plan.values() for n, _, _ in specs]
        if len(names) != len(set(names)):
            raise ValueError(
                "two live tensors convert to the same checkpoint tensor: this model's weight conversion "
                "needs several live tensors at once, which weight sync does not support"
            )

    @property
    def identity(self) -> bool:
        """Nothing to convert or drop: the live state dict is the checkpoint's."""
        return not self.aliases and not self.converted

    def specs(self, dtype_of=None) -> list[Spec]:
        """(name, dtype, shape) of every checkpoint tensor, in the order :meth:`items` yields them. ``dtype_of``:
        the dtype a live tensor is sent in (a bf16 cast), default its own."""
        out = []
        for specs in self.plan.values():
            for name, dtype, shape in specs:
                out.append((name, dtype_of(dtype) if dtype_of else dtype, shape))
        return out

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One live tensor -> its checkpoint tensors (none for a tie's alias; itself when nothing converts)."""
        if name not in self.converted:
            return [] if name in self.aliases else [(name, tensor)]
        return list(self._revert(self.model, {name: tensor}).items())

    def items(self, live: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in live.items():
            yield from self.convert(name, tensor)

    def to_checkpoint(self, live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(self.items(live))

    def to_live(self, tensors: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors -> live names (aliases left out: they share their tensor). ``live``: the live state
        dict, for the shapes and dtypes of converted tensors. A converted tensor is assembled from its checkpoint
        tensors by the element indices the reverse conversion moves (computed once per name)."""
        out: dict[str, torch.Tensor] = {}
        for name, specs in self.plan.items():
            if not specs:
                continue
            if name not in self.converted:
                out[name] = tensors[name]
                continue
            index = self._index(name, live[name])
            flat = torch.empty(live[name].numel(), dtype=tensors[specs[0][0]].dtype)
            for part, _, _ in specs:
                flat[index[part].reshape(-1)] = tensors[part].reshape(-1).to(flat.dtype)
            out[name] = flat.view(tuple(live[name].shape))
        return out

    def _index(self, name: str, like: torch.Tensor) -> dict[str, torch.Tensor]:
        cache = self.__dict__.setdefault("_indices", {})
        if name not in cache:
            n = like.numel()
            ids = torch.arange(n, dtype=torch.int64).view(tuple(like.shape))
            parts = self._revert(self.model, {name: ids})
            seen = torch.cat([p.reshape(-1) for p in parts.values()]).sort().values
            if seen.numel() != n or not torch.equal(seen, torch.arange(n)):
                raise ValueError(
                    f"the checkpoint conversion of {name!r} is not a re-layout of its elements; "
                    "the hf engine cannot load this architecture's checkpoint tensors"
                )
            cache[name] = parts
        return cache[name]


def tie_aliases(model: torch.nn.Module) -> set[str]:
    """Names under which a tied parameter is left out of the checkpoint: of each set of names that share one
    parameter, those a module declares tied (``_tied_weights_keys``: ``lm_head.weight``), keeping one name, as
    ``save_pretrained`` does. Parameters are matched by identity, so a sharded (FSDP2) or LoRA-wrapped model works
    too (LoRA's ``.base_layer.`` is dropped from the names, as its merged weights carry the base names)."""
    model = _pretrained(model)
    declared = []
    for prefix, module in model.named_modules():
        for key in getattr(module, "_tied_weights_keys", None) or ():
            declared.append(f"{prefix}.{key}" if prefix else key)
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name.replace(".base_layer.", "."))
    out: set[str] = set()
    for names in shared.values():
        if len(names) < 2:
            continue
        names = sorted(names)
        tied = [n for n in names if any(re.fullmatch(pat, n) or n == pat for pat in declared)]
        drop = tied if len(tied) < len(names) else tied[1:]
        out.update(drop if drop else names[1:])
    return out


def checkpoint_state_dict(model: torch.nn.Module, live: Mapping[str, torch.Tensor] | None = None):
    """``model``'s state dict (or ``live``) in the checkpoint layout, as ``save_pretrained`` writes it."""
    live = model.state_dict() if live is None else live
    return CheckpointLayout(model, live).to_checkpoint(live)
