"""Named LoRA adapters beside the policy on the ``hf`` engine (``LoadAdapter``; a request names one in ``adapter``).

An adapter is kept as its PEFT tensors (A ``[r, in]``, B ``[out, r]`` per module) and applied per decode batch by
``torch.func.functional_call`` with each adapted weight replaced by ``W + scale B A``: the live model is never
modified, so a weight push, the policy's requests and other adapters' requests are untouched, and any linear module
(``lm_head`` too, tied or not: only the head's use of the tensor is replaced) can be adapted. Rows of different
adapters decode in separate batches. A request pins its adapter until its rows finish; the store evicts the least
recently used unpinned adapter when a load would exceed ``max_adapters``. Design: docs/tinker.md (fleet sampling).
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.lora import ADAPTER_PREFIX
from rlhf.serving.errors import InvalidArgument, NotFound, ResourceExhausted

MAX_ADAPTERS_ENV = "RLHF_ROLLOUT_MAX_ADAPTERS"
DEFAULT_MAX_ADAPTERS = 8
NAME_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def max_adapters_from_env(env: dict[str, str] | None = None, default: int = DEFAULT_MAX_ADAPTERS) -> int:
    """``RLHF_ROLLOUT_MAX_ADAPTERS`` (unset: ``default``; the vllm engine's is 0, named adapters off)."""
    raw = ((os.environ if env is None else env).get(MAX_ADAPTERS_ENV) or "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{MAX_ADAPTERS_ENV}={raw!r}: give the number of named adapters a replica holds, >= 1")
    return int(raw)


@dataclass
class Adapter:
    name: str
    # live module name -> (A [r, in], B [out, r]) on the model's device, float32
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float
    pins: int = 0

    def params(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``{"<module>.weight": W + scale B A}``, for ``functional_call``, from the weights the model holds now
        (computed per decode batch: a weight push may have changed W since the last)."""
        out = {}
        for module, (a, b) in self.modules.items():
            w = model.get_submodule(module).weight
            out[f"{module}.weight"] = (w.float() + self.scale * (b @ a)).to(w.dtype)
        return out


def parse_adapter(
    name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], model: torch.nn.Module
) -> Adapter:
    """Check a PEFT LoRA adapter against ``model`` (names, shapes, options this engine applies) -> Adapter.
    Every refusal is InvalidArgument naming what to change."""
    if not NAME_RE.match(name or ""):
        raise InvalidArgument(f"adapter name {name!r}: 1-128 characters of A-Z a-z 0-9 . _ : @ -", field="name")
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument(f"peft_type {config.get('peft_type')!r}: only LORA adapters", field="adapter_config_json")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise InvalidArgument(f"{key} adapters are not served", field="adapter_config_json")
    if config.get("modules_to_save"):
        raise InvalidArgument("modules_to_save is not served (LoRA tensors only)", field="adapter_config_json")
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise InvalidArgument("adapter_config_json needs r and lora_alpha", field="adapter_config_json") from None
    if r < 1:
        raise InvalidArgument(f"r {r} must be >= 1", field="adapter_config_json")
    scale = alpha / (r**0.5) if config.get("use_rslora") else alpha / r
    device = next(model.parameters()).device
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if not key.startswith(ADAPTER_PREFIX) or suffix is None:
            raise InvalidArgument(
                f"adapter tensor {key!r} is not a LoRA A/B weight ({ADAPTER_PREFIX}<module>.lora_A.weight)",
                field="adapter_safetensors",
            )
        pairs.setdefault(key[len(ADAPTER_PREFIX) : -len(suffix)], {})[suffix[6]] = value
    if not pairs:
        raise InvalidArgument("the adapter holds no tensor", field="adapter_safetensors")
    modules = {}
    for module, ab in sorted(pairs.items()):
        modules[module] = _check_module(model, module, ab, r, device)
    return Adapter(name, modules, scale)


def _check_module(
    model: torch.nn.Module, module: str, ab: dict[str, torch.Tensor], r: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        target = model.get_submodule(module)
    except AttributeError:
        target = None
    w = getattr(target, "weight", None)
    if not isinstance(target, torch.nn.Linear) or w is None or w.dim() != 2:
        raise InvalidArgument(
            f"adapter module {module!r} is no linear module of the model", field="adapter_safetensors"
        )
    if set(ab) != {"A", "B"}:
        raise InvalidArgument(f"adapter module {module!r} needs both lora_A and lora_B", field="adapter_safetensors")
    out_f, in_f = w.shape
    a, b = ab["A"], ab["B"]
    if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
        raise InvalidArgument(
            f"adapter module {module!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected {(r, in_f)} / "
            f"{(out_f, r)} (r {r})",
            field="adapter_safetensors",
        )
    a, b = a.to(device=device, dtype=torch.float32), b.to(device=device, dtype=torch.float32)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise InvalidArgument(f"adapter module {module!r} holds non-finite values", field="adapter_safetensors")
    return a, b


class AdapterStore:
    """The named adapters a replica holds, least recently used first; thread-safe (the decode thread unpins)."""

    def __init__(self, max_adapters: int = DEFAULT_MAX_ADAPTERS, on_evict: Callable[[Any], None] | None = None):
        self.max_adapters = max_adapters
        self._on_evict = on_evict  # called (under the lock) with each adapter dropped unpinned: the vllm engine unloads
        self._held: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def put(self, adapter: Adapter) -> list[str]:
        """Hold ``adapter`` (replacing one of its name: requests pinned to the old one finish on it), evicting the
        least recently used unpinned adapters past ``max_adapters``; returns the names held."""
        with self._lock:
            old = self._held.pop(adapter.name, None)
            if old is not None and old.pins == 0 and self._on_evict is not None:
                self._on_evict(old)
            while len(self._held) >= self.max_adapters:
                victim = next((n for n, a in self._held.items() if a.pins == 0), None)
                if victim is None:
                    raise ResourceExhausted(
                        f"all {self.max_adapters} named adapters are in use by requests; retry when one finishes "
                        f"(or raise {MAX_ADAPTERS_ENV})",
                        field="name",
                    )
                gone = self._held.pop(victim)
                if self._on_evict is not None:
                    self._on_evict(gone)
            self._held[adapter.name] = adapter
            return list(self._held)

    def check(self, name: str) -> None:
        with self._lock:
            if name not in self._held:
                raise NotFound(
                    f"adapter {name!r} is not held by this replica (never loaded, or evicted): LoadAdapter it first",
                    field="adapter",
                )

    def pin(self, name: str) -> Adapter:
        with self._lock:
            adapter = self._held.get(name)
            if adapter is None:
                raise NotFound(f"adapter {name!r} is not held by this replica: LoadAdapter it first", field="adapter")
            self._held.move_to_end(name)
            adapter.pins += 1
            return adapter

    def unpin(self, adapter: Adapter) -> None:
        with self._lock:
            adapter.pins -= 1
