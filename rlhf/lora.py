"""LoRA training of the actor with Hugging Face ``peft`` (the library TRL uses; the ``lora`` extra).

The rollout engine serves a plain model, so what leaves the trainer is always the merged weights ``W + (alpha / r) B A``
under the base model's own parameter names (:func:`merged_state_dict`); the optimizer only sees the adapter.
"""

from __future__ import annotations

import torch


def wrap_lora(model: torch.nn.Module, r: int, alpha: float, target_modules: list[str]) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``target_modules`` (module-name suffixes); only the adapters train.
    No LoRA dropout: RL losses compare log-probs of two forward passes, which dropout would make differ (TRL also
    disables dropout in its PPO models)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("actor_rollout.lora_r needs peft: pip install 'rlhf-pipeline[lora]'") from None
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = sorted(set(target_modules) - present)
    if unknown:
        raise ValueError(f"actor_rollout.lora_target_modules {unknown} name no module of the actor")
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(target_modules), bias="none", task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the merged model under the base model's names: each adapted ``W`` becomes ``W + delta``; the
    adapter tensors themselves are left out. Computed without touching ``model`` (no merge/unmerge in place)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and hasattr(module, "get_delta_weight"):
            deltas[f"{name}.weight"] = module.get_delta_weight(module.active_adapters[0]).detach()
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        value = value.detach()
        out[key] = value + deltas[key].to(value.dtype) if key in deltas else value
    return out


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable adapter tensors under the wrapped model's names (what a checkpoint needs besides the base)."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".lora_" in k}
