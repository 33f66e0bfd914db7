"""LoRA training of the actor with Hugging Face ``peft`` (the library TRL uses; the ``lora`` extra).

The optimizer only sees the adapter. What leaves the trainer is either the merged weights ``W + (alpha / r) B A`` under
the base model's own parameter names (:func:`merged_state_dict`: checkpoints, the hf engine) or, with
``actor_rollout.lora_sync`` adapter, only the adapter tensors, which vLLM serves as a LoRA adapter (a push of a few MB
instead of the model; :func:`adapter_push_state_dict`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def wrap_lora(
    model: torch.nn.Module, r: int, alpha: float, target_modules: list[str], dropout: float = 0.0
) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``target_modules`` (module-name suffixes); only the adapters train.
    ``dropout`` is recorded in the adapter's config as given (``actor_rollout.lora_dropout``); the trainer turns
    every dropout module off before training (services.trainer.models), as TRL's RL trainers do: the losses compare
    log-probs of two forward passes, which dropout would make differ."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("actor_rollout.lora_r needs peft: pip install 'rlhf-pipeline[lora]'") from None
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = sorted(set(target_modules) - present)
    if unknown:
        raise ValueError(f"actor_rollout.lora_target_modules {unknown} name no module of the actor")
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the merged model under the base model's names: each adapted ``W`` becomes ``W + delta``; the
    adapter tensors themselves are left out. Computed without touching ``model`` (no merge/unmerge in place)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas, dequantized = {}, {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and hasattr(module, "get_delta_weight"):
            deltas[f"{name}.weight"] = module.get_delta_weight(module.active_adapters[0]).detach()
        elif hasattr(getattr(module, "weight", None), "quant_state"):  # a 4-bit base layer (load_in_4bit)
            dequantized[f"{name}.weight".replace(".base_layer.", ".")] = _dequantize_4bit(module.weight)
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        if ".weight." in key and key.split(".weight.", 1)[0] + ".weight" in dequantized:
            continue  # a 4-bit weight's quantization state (absmax, quant_map, ...): not a tensor of the model
        value = dequantized.get(key, value).detach()
        out[key] = value + deltas[key].to(value.dtype) if key in deltas else value
    return out


def _dequantize_4bit(weight: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes 4-bit weight (``Params4bit``) as the full tensor its matmuls use."""
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(weight.data, weight.quant_state)


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable adapter tensors under the wrapped model's names (what a checkpoint needs besides the base)."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".lora_" in k}


# ------------------------------------------------------------------------------------------- adapter-only pushes
#
# With ``actor_rollout.lora_sync: adapter`` a push carries only the adapter tensors, in PEFT's saved layout
# (``base_model.model.<module>.lora_A.weight``, [r, in]; ``...lora_B.weight``, [out, r]); the vLLM replica writes
# them as an adapter folder and serves it as a LoRA adapter (services/rollout/vllm_lora.py).

ADAPTER_PREFIX = "base_model.model."


def pushes_adapter(actor) -> bool:
    """Whether a push of this actor (``actor_rollout`` config) sends the adapter only: LoRA, and ``lora_sync``
    adapter, or auto with the vllm engine."""
    if not actor.lora_r:
        return False
    return actor.lora_sync == "adapter" or (actor.lora_sync == "auto" and actor.engine == "vllm")


def adapter_push_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors as an adapter push sends them: PEFT's saved names (no adapter name), nothing else."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def adapter_manifest(
    checkpoint: dict[str, tuple[int, ...]], r: int, target_modules: list[str]
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an adapter push must hold, from the base checkpoint's names and shapes: an A
    ([r, in]) and a B ([out, r]) for each 2-D weight of a module named in ``target_modules`` (PEFT matches the
    module name's last part)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in sorted(checkpoint.items()):
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] not in target_modules:
            continue
        out[f"{ADAPTER_PREFIX}{module}.lora_A.weight"] = (r, shape[1])
        out[f"{ADAPTER_PREFIX}{module}.lora_B.weight"] = (shape[0], r)
    if not out:
        raise ValueError(f"actor_rollout.lora_target_modules {target_modules} name no linear weight of the model")
    return out


def write_adapter(
    directory, tensors: dict[str, torch.Tensor], r: int, alpha: float, target_modules: list[str], base: str
) -> None:
    """``tensors`` (an adapter push) as a PEFT adapter folder: ``adapter_model.safetensors`` and the
    ``adapter_config.json`` that vLLM's and PEFT's loaders read."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to("cpu").contiguous() for k, v in tensors.items()}, directory / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": base,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
