"""The trainer's models as it trains them: the actor (LoRA-wrapped when asked), the PPO critic, the frozen reference
of ``kl_penalty: full``, and the PPO-ptx texts; dropout off, activation checkpointing and FSDP2 sharding applied.

Also the options built for one trainer process only, refused in a torchrun group (:func:`refuse_in_group`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlhf import algo
from rlhf import distributed as dist
from rlhf.config import ExperimentConfig
from rlhf.data import load_texts
from rlhf.lora import wrap_lora
from rlhf.models import (
    empty_causal_lm,
    empty_sequence_classifier,
    load_causal_lm,
    load_policy_base,
    load_sequence_classifier,
    resolve_model_path,
)

# Options built for one trainer process, each with why a torchrun group (FSDP2 shards on every rank) refuses it.
ONE_PROCESS_ONLY = {
    "actor_rollout.lora_r": "the push merges the adapters into the whole base weights held by one process "
    "(rlhf.lora); a sharded merge, push and adapter checkpoint are not built",
    "algorithm.kl_penalty: full": "it keeps an unsharded reference model beside the policy, which every rank would "
    "hold whole; use k1 / k3 (the reference service's log-probs)",
    "actor_rollout.ptx_coef": "PPO-ptx's pretraining texts are read by one cursor, not split across ranks: every rank "
    "would train on the same texts",
    "critic.shared_backbone": "the value head joins the actor's backward on the actor's own modules, which a group "
    "shards; a sharded shared backbone is not built (use a separate critic)",
    "critic.save": "it writes the critic as a Hugging Face folder from the process that holds it whole; in a group the "
    "critic is sharded (its shards are in the group's checkpoints)",
}
# Refused when a group resumes (it only matters then: seed configs set it for their first start too)
NO_LOAD_OPTIM_IN_GROUP = (
    "training.no_load_optim (or the actor's / critic's): a trainer group restores the optimizers' shards with the "
    "weights' from its sharded checkpoint; starting the moments afresh there is not built (resume with one process, "
    "or set it false)"
)


def refuse_in_group(cfg: ExperimentConfig) -> None:
    """Options built for one trainer process only: refused in a torchrun group rather than silently wrong, each with
    its reason (:data:`ONE_PROCESS_ONLY`)."""
    used = {
        "actor_rollout.lora_r": bool(cfg.actor.lora_r),
        "algorithm.kl_penalty: full": cfg.algorithm.kl_penalty == "full",
        "actor_rollout.ptx_coef": cfg.actor.ptx_coef > 0,
        "critic.save": cfg.critic.save is not None,
        "critic.shared_backbone": cfg.critic.shared_backbone,
    }
    why = [f"{key}: {ONE_PROCESS_ONLY[key]}" for key, on in used.items() if on]
    if why:
        raise ValueError(
            "built for a one-process trainer, not a torchrun group: "
            + "; ".join(why)
            + ". Run without torchrun (--trainer-procs 1), or turn these off"
        )


def load_actor(cfg: ExperimentConfig, path: str, device: torch.device, group: dist.Group | None) -> torch.nn.Module:
    # Parameters and AdamW state stay fp32 even with bf16 (master weights): at the configs' lr 5e-7 an update is
    # far below a bf16 weight's resolution, so pure-bf16 weights would hardly move. bf16 is the compute dtype
    # (autocast in every forward) and the dtype pushed to rollout; checkpoints keep fp32.
    if group is not None:  # LoRA is refused in a group (refuse_in_group)
        return dist.load_sharded(
            lambda: empty_causal_lm(path, "float32"),
            lambda: load_causal_lm(path, "cpu", "float32"),
            lambda m: _train_mode(m, cfg),
            cfg.actor.bf16,
            device,
            group,
        )
    a = cfg.actor
    actor = load_policy_base(path, device, "float32", a)  # QLoRA: a frozen 4-bit base (lora_r > 0 checked at load)
    if a.lora_r:  # only the adapters train
        actor = wrap_lora(actor, a.lora_r, a.lora_alpha, a.lora_target_modules, a.lora_dropout)
    _train_mode(actor, cfg)
    return actor


def critic_device(cfg: ExperimentConfig, device: torch.device, group: dist.Group | None) -> torch.device:
    """Where the critic runs: the actor's ``device``, or with ``resource_pool.critic [1]`` a device of its own, the one
    after the actor's among this process's devices (rlhf up makes the trainer see the critic's device after its own,
    services/devices.py). The CPU is one device: there the critic shares it. ValueError when that device does not
    exist (or in a trainer group, where each rank would need one of its own)."""
    if cfg.resource_pool.critic != [1] or device.type == "cpu":
        return device
    if group is not None:
        raise ValueError(
            "resource_pool.critic [1]: a device of the critic's own in a trainer group (num_gpus_for_train > 1) is "
            "not built: each rank holds its shard of the critic on its own device; set resource_pool.critic [0]"
        )
    backend = getattr(torch, device.type)
    index = (device.index if device.index is not None else backend.current_device()) + 1
    count = backend.device_count()
    if index >= count:
        raise ValueError(
            f"resource_pool.critic [1]: the critic's own device would be {device.type}:{index}, after the actor's, "
            f"but this process sees {count} {device.type} device(s); give it one more device (rlhf up does, from "
            "resource_pool) or set resource_pool.critic [0] to share the actor's"
        )
    return torch.device(device.type, index)


def load_critic(
    cfg: ExperimentConfig, device: torch.device, group: dist.Group | None, actor: torch.nn.Module
) -> torch.nn.Module:
    """The PPO critic: a value head on ``actor`` with ``critic.shared_backbone``; else ``critic.load``, else the first
    reward model scorer's model (a value head that starts from the reward model, as TRL's PPO examples do)."""
    if cfg.critic.shared_backbone:  # refused in a group (refuse_in_group)
        return ValueHeadOnActor(actor, device)
    src = cfg.critic.load or next((s.load for s in cfg.reward.scorers if s.type == "model"), None) or "tiny:reward"
    path = resolve_model_path(src)
    if group is not None:
        return dist.load_sharded(
            lambda: empty_sequence_classifier(path),
            lambda: load_sequence_classifier(path, "cpu"),
            lambda m: _train_mode(m, cfg),
            cfg.critic.bf16,
            device,
            group,
        )
    critic = load_sequence_classifier(path, device)
    _train_mode(critic, cfg)
    return critic


class ValueHeadOnActor(torch.nn.Module):
    """PPO's critic as seed 001 builds it (``critic.shared_backbone``; TRL's AutoModelForCausalLMWithValueHead): a
    linear value head on the actor's own backbone. The backbone is the actor's (its LoRA adapters included), held but
    not registered, so this module's parameters and state dict are the head's alone; it has the interface
    ``rlhf.models.score_head_outputs`` reads (``base_model_prefix``, ``score``)."""

    base_model_prefix = "backbone"

    def __init__(self, actor: torch.nn.Module, device: torch.device):
        super().__init__()
        base = actor.get_base_model() if hasattr(actor, "peft_config") else actor
        object.__setattr__(self, "backbone", getattr(base, base.base_model_prefix))  # shared, not a submodule
        self.config = base.config  # the packed (padding-free) path reads the attention settings from it
        self.score = torch.nn.Linear(base.config.hidden_size, 1, bias=False, device=device)

    def save_pretrained(self, directory, safe_serialization: bool = True) -> None:
        """The head alone (``value_head.safetensors``): the backbone is the actor's, saved with it."""

        Path(directory).mkdir(parents=True, exist_ok=True)
        head = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(head, f"{directory}/value_head.safetensors")

    def load_folder(self, directory) -> None:
        self.load_state_dict(load_file(f"{directory}/value_head.safetensors"))


def fixed_reward_stats(cfg: ExperimentConfig) -> algo.FixedMoments | None:
    """``algorithm.reward_norm_stats``: the [mean, std] given, or (``reward_model``) the ``mean`` and ``std`` that
    OpenRLHF's reward-model training writes into the model's config.json; None when not set."""
    stats = cfg.algorithm.reward_norm_stats
    if stats is None:
        return None
    if stats != "reward_model":
        return algo.FixedMoments(float(stats[0]), float(stats[1]))
    spec = cfg.reward.scorers[0].load  # one model scorer of weight 1 (checked at load)
    path = resolve_model_path(spec) / "config.json"
    model_config = json.loads(path.read_text())
    missing = [k for k in ("mean", "std") if not isinstance(model_config.get(k), (int, float))]
    if missing:
        raise ValueError(
            f"algorithm.reward_norm_stats reward_model: {path} has no {' / '.join(repr(k) for k in missing)} (OpenRLHF "
            "writes them when the reward model is trained with --normalize_reward); give the statistics as "
            "algorithm.reward_norm_stats: [mean, std], or use normalize_reward (running statistics)"
        )
    if not model_config["std"] > 0:
        raise ValueError(f"algorithm.reward_norm_stats reward_model: {path} has std {model_config['std']}, not > 0")
    return algo.FixedMoments(float(model_config["mean"]), float(model_config["std"]))


def load_reference(cfg: ExperimentConfig, device: torch.device) -> torch.nn.Module:
    """A frozen reference copy for ``kl_penalty: full`` (TRL): the whole-vocabulary KL needs the reference's logits,
    which the reference service does not send (it returns the sampled tokens' log-probs)."""
    ref_load = cfg.actor_rollout_ref.ref.load
    if ref_load is None:  # the actor's initial weights, loaded as its base is (4 bits with QLoRA)
        ref = load_policy_base(resolve_model_path(cfg.actor.load), device, "float32", cfg.actor).eval()
    else:
        ref = load_causal_lm(resolve_model_path(ref_load), device, "float32").eval()
    ref.requires_grad_(False)
    return ref


def _train_mode(model: torch.nn.Module, cfg: ExperimentConfig) -> None:
    """Train mode with dropout off, and activation checkpointing if asked. In a group this runs on the meta model,
    before :func:`rlhf.distributed.load_sharded` shards it (and before its optimizer is built, so the AdamW state is
    sharded too)."""
    model.train()
    _disable_dropout(model)
    if cfg.training.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _disable_dropout(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


class PtxData:
    """PPO-ptx texts (data.pretrain_data), tokenized once, served in a fixed cycling order: a batch is a (rows, T)
    tensor right-padded with the pad id."""

    def __init__(self, cfg: ExperimentConfig, tokenizer):
        self.pad_id = tokenizer.pad_token_id
        limit = cfg.actor.seq_length  # the actor's longest sequence (MindSpeed's per-role seq_length)
        self.rows = [tokenizer(t, add_special_tokens=True)["input_ids"][:limit] for t in load_texts(cfg.data)]
        self.rows = [r for r in self.rows if len(r) >= 2]
        if not self.rows:
            raise ValueError(f"data.pretrain_data {cfg.data.pretrain_data}: no text of two tokens or more")
        self.offset = 0

    def next_batch(self, n: int) -> torch.Tensor:
        picked = [self.rows[(self.offset + i) % len(self.rows)] for i in range(n)]
        self.offset = (self.offset + n) % len(self.rows)
        out = torch.full((n, max(len(r) for r in picked)), self.pad_id, dtype=torch.long)
        for i, r in enumerate(picked):
            out[i, : len(r)] = torch.tensor(r)
        return out
