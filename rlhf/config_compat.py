"""What a MindSpeed-LLM (Megatron) config carries that this system has no field for: mapped or explained.

A seed config (``ppo_trainer_llama32_1b.yaml``, the online DPO test config) holds keys that configure Megatron
itself: its parallel layout, loss scaling, data loader and model-structure files. :func:`translate` runs before
validation and, for each such key, either moves its value to the field of the same concept here (a rename: the
actor's ``data_path`` to ``data.path``, ``no_shuffle`` to ``data.shuffle``, ``inference_tensor_model_parallel_size``
to the rollout's tensor parallelism) or takes it out and keeps one line saying why it does not apply; those lines
become ONE warning at start-up (``ExperimentConfig.notes``; the data source is said there too,
``ExperimentConfig.mapped_notes``). The per-role keys MindSpeed merges from ``training`` (``seq_length``, ``bf16``,
``no_load_optim``, ``no_load_rng``) are fields of the role sections. Any other unknown key stays in and is an error
naming the closest valid key.
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
    # MindSpeed declares it as the inference group's TP but builds that group at tensor_model_parallel_size: here
    # both name the rollout engine's, and two different values are an error (_put)
    ("actor_rollout", "inference_tensor_model_parallel_size"): ("actor_rollout", "tensor_model_parallel_size"),
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
        if data.get(section) is None:  # absent, or an empty section (``data:`` with nothing under it)
            data[section] = {}
        target = data[section]
    if key in target and target[key] != value:
        raise ValueError(f"{source} ({value!r}) contradicts {_path(section)}.{key} ({target[key]!r}); keep one")
    target[key] = value


# Keys MindSpeed reads in a role that has no counterpart for it here (the role reads no prompts, keeps no state)
_ROLE_ONLY = {
    "data_path": ("ref", "critic", "reward"),
    "no_shuffle": ("ref", "critic", "reward"),
    "shuffle": ("ref", "critic", "reward"),
    "no_load_optim": ("ref", "reward"),
    "no_load_rng": ("ref", "reward"),
}
_ROLE_ONLY_WHY = {
    "data_path": "only the actor reads prompt data (data.path)",
    "no_shuffle": "only the actor reads prompt data (data.shuffle)",
    "shuffle": "only the actor reads prompt data (data.shuffle)",
    "no_load_optim": "{role} has no optimizer: its service loads the weights of its load folder only",
    "no_load_rng": "{role} keeps no random state in checkpoints: its service loads the weights of its load folder only",
}
# Keys mapped onto one field of another section, whichever of the actor's and the training section's sets them
# (MindSpeed merges training into the actor's section, the actor's value winning)
_DATA_KEYS = ("data_path", "shuffle", "no_shuffle")


def _actor_data_keys(data: dict[str, Any], mapped: list[str]) -> None:
    """The prompt data MindSpeed's actor reads: ``data_path`` (its preprocessed .bin/.idx prefix, or a file) as
    ``data.path`` when that is unset, and ``shuffle`` / ``no_shuffle`` as ``data.shuffle``. MindSpeed merges the
    training section into the actor's, the actor's value winning: so here."""
    sections = _sections(data)
    path: tuple[str, Any] | None = None
    shuffle: tuple[str, bool] | None = None
    for section in ("training", "actor_rollout"):  # the actor's last: it wins
        body = sections.get(section, {})
        mine = [
            (f"{_path(section)}.{key}", bool(body.pop(key)) == (key == "shuffle"))
            for key in ("shuffle", "no_shuffle")
            if key in body
        ]
        if len({v for _, v in mine}) > 1:
            raise ValueError(
                f"{mine[0][0]} and {mine[1][0]} contradict (shuffle {mine[0][1]} vs {mine[1][1]}); keep one"
            )
        shuffle = mine[0] if mine else shuffle
        if "data_path" in body:
            path = (f"{_path(section)}.data_path", body.pop("data_path"))
    if shuffle is not None:
        _put(data, "data", "shuffle", shuffle[1], shuffle[0])
    if path is not None:
        where, value = path
        _put(data, "data", "path", value, where)
        mapped.append(
            f"{where}: {value} is the prompt data (data.path): a MindSpeed preprocessed .bin/.idx prefix "
            "(its _packed_input_ids_document files), or a .jsonl/.json/.parquet file"
        )


def translate(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """``raw`` with MindSpeed/Megatron keys mapped or taken out -> (data to validate, one note per key taken out, one
    line per key read as another field that the run should say it read).

    Raises ValueError for a value this system cannot honour (a mapped key that contradicts its target, a tokenizer
    type other than Hugging Face's)."""
    data = copy.deepcopy(raw)
    notes: list[str] = []
    mapped: list[str] = []
    if "defaults" in data:
        data.pop("defaults")
        notes.append(
            "defaults: MindSpeed's hydra list of model-structure files; each model's structure is read "
            "from its load folder's config.json"
        )
    _actor_data_keys(data, mapped)
    for section, body in _sections(data).items():
        where = _path(section)
        for key in list(body):
            if key in _MEGATRON_ONLY and section not in ("algorithm", "data"):
                body.pop(key)
                notes.append(f"{where}.{key}: {_MEGATRON_ONLY[key]}")
            elif section in _ROLE_ONLY.get(key, ()):
                body.pop(key)
                notes.append(f"{where}.{key}: {_ROLE_ONLY_WHY[key].format(role=section)}")
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
    _map_dpo_args(data)
    return data, notes, mapped


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
                or section in _ROLE_ONLY.get(key, ())
                or (key in _DATA_KEYS and section in ("training", "actor_rollout"))
                or (key == "tensor_model_parallel_size" and section in _NO_TP_ROLES)
                or (key == "tokenizer_type" and section == "training")
                or (section, key) in _RENAMES
            ):
                return True
    return False


def format_notes(notes: list[str]) -> str | None:
    """The one start-up warning for every key taken out, or None."""
    if not notes:
        return None
    return "config keys accepted but not applicable here:\n" + "\n".join(f"  {n}" for n in notes)


def format_mapped(mapped: list[str]) -> str | None:
    """The start-up lines for MindSpeed keys read as another field (the data source above all), or None."""
    if not mapped:
        return None
    return "MindSpeed-LLM keys read as this system's fields:\n" + "\n".join(f"  {m}" for m in mapped)
