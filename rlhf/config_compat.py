"""What a MindSpeed-LLM (Megatron) config carries that this system has no field for: mapped or explained.

A seed config (``ppo_trainer_llama32_1b.yaml``, the online DPO test config) holds keys that configure Megatron
itself: its parallel layout, loss scaling, data loader and model-structure files. :func:`translate` runs before
validation and, for each such key, either moves its value to the field of the same concept here (a rename) or takes
it out and keeps one line saying why it does not apply; those lines become ONE warning at start-up
(``ExperimentConfig.notes``). Any other unknown key stays in and is an error naming the closest valid key.
"""

from __future__ import annotations

import copy
from typing import Any

# Keys of any role section (training, actor_rollout, ref, critic, reward) that only configure Megatron.
_MEGATRON_ONLY = {
    "pipeline_model_parallel_size": "no pipeline parallelism here: models run whole (rollout shards with vLLM tensor "
    "parallelism, actor_rollout.tensor_model_parallel_size)",
    "sequence_parallel": "Megatron sequence parallelism; transformers/vLLM models here have no such split",
    "context_parallel_size": "Megatron context parallelism; not used by transformers/vLLM models here",
    "expert_model_parallel_size": "Megatron expert parallelism; not used by transformers/vLLM models here",
    "num_layer_list": "Megatron pipeline stage layout; no pipeline parallelism here",
    "use_distributed_optimizer": "Megatron's sharded optimizer; the trainer keeps one AdamW",
    "distributed_backend": "the torch.distributed backend follows the device (nccl on CUDA, hccl on Ascend)",
    "initial_loss_scale": "fp16 loss scaling; training.bf16 needs none (fp32 master weights)",
    "loss_scale": "fp16 loss scaling; training.bf16 needs none (fp32 master weights)",
    "use_kv_cache": "rollout decodes with vLLM's paged KV cache (always on)",
    "use_mcore_models": "models are Hugging Face folders, not Megatron-core checkpoints",
    "use_flash_attn": "attention kernels are chosen by transformers / vLLM",
    "finetune": "training starts from the load folder's weights; resuming is training.load",
    "no_shared_storage": "checkpoints are written by the one trainer process",
    "is_instruction_dataset": "prompts are read from data.path (chat template: actor_rollout.apply_chat_template)",
    "variable_seq_lengths": "batches are always padded to their longest sequence",
    "pad_to_multiple_of": "batches are padded to their longest sequence, not to a multiple",
    "data_path": "a Megatron preprocessed (.bin/.idx) prefix; prompts come from data.path (which reads such a "
    "prefix too)",
    "split": "train/valid/test split of Megatron data; every prompt of data.path is used for training",
    "prompt_type": "prompts use the tokenizer's own chat template (actor_rollout.apply_chat_template)",
    "num_samples_per_step": "MindSpeed's prompts per generate call; vLLM batches every queued prompt continuously "
    "(prompts per step: training.global_batch_size)",
    "model": "names a model-structure file from defaults; the structure here is the load folder's config.json",
}
# Role sections whose tensor parallelism has no equivalent here (the actor's maps to the rollout engine's).
_NO_TP_ROLES = ("ref", "reward", "critic", "training")
_TP_REASON = (
    "{role} runs in one transformers process (no tensor parallelism; the rollout engine's is "
    "actor_rollout.tensor_model_parallel_size)"
)

# Same concept, another section: (section, key) -> (target section, key)
_RENAMES = {
    ("actor_rollout", "missing_eos_penalty"): ("algorithm", "missing_eos_penalty"),
}


def _sections(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The role sections of a raw config by short name (only those that are mappings)."""
    out = {}
    for name in ("training", "critic", "reward", "algorithm", "data"):
        if isinstance(data.get(name), dict):
            out[name] = data[name]
    arr = data.get("actor_rollout_ref")
    if isinstance(arr, dict):
        for name in ("actor_rollout", "ref"):
            if isinstance(arr.get(name), dict):
                out[name] = arr[name]
    return out


def _path(section: str) -> str:
    return f"actor_rollout_ref.{section}" if section in ("actor_rollout", "ref") else section


def _put(data: dict[str, Any], section: str, key: str, value: Any, source: str) -> None:
    """Set ``section.key`` unless set there already to another value (then the two keys contradict)."""
    if section in ("actor_rollout", "ref"):
        target = data.setdefault("actor_rollout_ref", {}).setdefault(section, {})
    else:
        target = data.setdefault(section, {})
    if key in target and target[key] != value:
        raise ValueError(f"{source} ({value!r}) contradicts {_path(section)}.{key} ({target[key]!r}); keep one")
    target[key] = value


def translate(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``raw`` with MindSpeed/Megatron keys mapped or taken out -> (data to validate, one note per key taken out).

    Raises ValueError for a value this system cannot honour (a mapped key that contradicts its target, a tokenizer
    type other than Hugging Face's)."""
    data = copy.deepcopy(raw)
    notes: list[str] = []
    if "defaults" in data:
        data.pop("defaults")
        notes.append(
            "defaults: MindSpeed's hydra list of model-structure files; each model's structure is read "
            "from its load folder's config.json"
        )
    data_set = isinstance(data.get("data"), dict) and "path" in data["data"]
    for section, body in _sections(data).items():
        where = _path(section)
        for key in list(body):
            if key == "data_path" and section not in ("algorithm", "data") and not data_set:
                # noted only, it would train on the built-in demo prompts: never silently
                raise ValueError(
                    f"{where}.data_path ({body[key]!r}) is MindSpeed's preprocessed prompt data, but prompts come "
                    f"from data.path, which is not set; set data.path (e.g. data.path={body[key]}: its "
                    "_packed_input_ids_document.bin/.idx are read) or point it at a .jsonl/.json/.parquet file or "
                    "reasoning_gym:<task>"
                )
            if key in _MEGATRON_ONLY and section not in ("algorithm", "data"):
                body.pop(key)
                notes.append(f"{where}.{key}: {_MEGATRON_ONLY[key]}")
            elif key == "tensor_model_parallel_size" and section in _NO_TP_ROLES:
                body.pop(key)
                notes.append(f"{where}.{key}: {_TP_REASON.format(role=section)}")
            elif key == "tokenizer_type" and section == "training":
                value = body.pop(key)
                if value != "PretrainedFromHF":
                    raise ValueError(
                        f"training.tokenizer_type {value!r}: only PretrainedFromHF (a Hugging Face "
                        "tokenizer folder, training.tokenizer_name_or_path) is supported"
                    )
            elif (section, key) in _RENAMES:
                target, tkey = _RENAMES[(section, key)]
                _put(data, target, tkey, body.pop(key), f"{where}.{key}")
            elif section == "actor_rollout" and key in ("shuffle", "no_shuffle"):
                value = body.pop(key)
                _put(data, "data", "shuffle", bool(value) if key == "shuffle" else not value, f"{where}.{key}")
    _map_dpo_args(data)
    return data, notes


# MindSpeed-LLM's online DPO loss reads Megatron arguments (--dpo-beta, default 0.1, and --dpo-loss-type), which its
# configs set in training or a role section; its algorithm.kl_ctrl is read by the PPO and GRPO trainers only.
_DPO_ARGS = ("dpo_beta", "dpo_loss_type")


def _map_dpo_args(data: dict[str, Any]) -> None:
    """MindSpeed's ``dpo_beta`` / ``dpo_loss_type`` in ``training`` or ``actor_rollout`` -> ``algorithm``'s (the
    actor's section wins over training's, as MindSpeed merges a role's arguments over the common ones); a different
    explicit ``algorithm`` value is an error naming both keys."""
    sections = _sections(data)
    for key in _DPO_ARGS:
        found = [(s, sections[s].pop(key)) for s in ("training", "actor_rollout") if key in sections.get(s, {})]
        if found:
            section, value = found[-1]
            _put(data, "algorithm", key, value, f"{_path(section)}.{key}")


def mindspeed_style(raw: dict[str, Any]) -> bool:
    """Whether a raw config reads as one written for MindSpeed-LLM: it has the hydra ``defaults`` list, a
    ``resource_pool`` section, or a key this module maps or takes out. Such a config expects MindSpeed's defaults
    where it leaves a field out (see :func:`default_notes`)."""
    if "defaults" in raw or "resource_pool" in raw:
        return True
    for section, body in _sections(raw).items():
        for key in body:
            if (
                (key in _MEGATRON_ONLY and section not in ("algorithm", "data"))
                or (key == "tensor_model_parallel_size" and section in _NO_TP_ROLES)
                or (key == "tokenizer_type" and section == "training")
                or (section, key) in _RENAMES
                or (section == "actor_rollout" and key in ("shuffle", "no_shuffle"))
            ):
                return True
    return False


def format_notes(notes: list[str]) -> str | None:
    """The one start-up warning for every key taken out, or None."""
    if not notes:
        return None
    return "config keys accepted but not applicable here:\n" + "\n".join(f"  {n}" for n in notes)
