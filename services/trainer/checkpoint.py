"""Atomic trainer checkpoints: the policy in Hugging Face format plus everything needed to resume exactly.

:func:`save_checkpoint` writes ``<save>/step_<N>/`` (policy, critic, optimizer state or its shards, ``state.json``,
``manifest.json`` last) in a private folder, renames it into place and replaces ``latest`` atomically;
:func:`load_checkpoint` restores it. The caller keeps to one writer at a time. Nothing is pickled.

Design (the layout, what a crash leaves): docs/running.md#checkpoints and docs/reliability.md#the-guarantees.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlhf.checkpoints import (  # the readers, shared with rollout; fsync_files, shared with services.training
    MANIFEST,
    fsync_files,
    incomplete_reason,
    latest_checkpoint,
)
from rlhf.layout import CheckpointLayout
from rlhf.lora import adapter_state_dict, merged_state_dict
from services.trainer.models import NO_LOAD_OPTIM_IN_GROUP

__all__ = ["MANIFEST", "incomplete_reason", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def _optimizer_state(name: str, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {}
    state = opt.state_dict()
    for idx, pstate in state["state"].items():
        for key, value in pstate.items():
            if torch.is_tensor(value):
                tensors[f"{name}.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _restore_optimizer(name: str, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    prefix = f"{name}."
    for key, value in tensors.items():
        if key.startswith(prefix):
            idx, field = key[len(prefix) :].split(".", 1)
            state.setdefault(int(idx), {})[field] = value
    for key, value in meta["scalars"].items():
        idx, field = key.split(".", 1)
        state.setdefault(int(idx), {})[field] = value
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(root: str | Path, engine, extra: dict[str, Any]) -> Path:
    """Write step_<N> for the current step; ``extra`` (data cursor, trained job ids, ...) goes in state.json."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{engine.state.step}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=root))
    if engine.group is not None:  # every rank writes its shards (the folder must be on storage they all see)
        engine.save_group(tmp)
        tensors, optim_meta = {}, {"format": "dcp"}
    else:
        save_policy(engine, tmp / "policy")
        if engine.cfg.actor.lora_r:  # the adapters: what a LoRA run trains (the base comes from the load folder)
            save_file(adapter_state_dict(engine.actor), tmp / "adapter.safetensors")
        tensors, meta = _optimizer_state("actor", engine.actor_opt)
        optim_meta = {"actor": meta}
        if engine.critic is not None:
            engine.critic.save_pretrained(tmp / "critic", safe_serialization=True)
            critic_tensors, optim_meta["critic"] = _optimizer_state("critic", engine.critic_opt)
            tensors.update(critic_tensors)
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.generator"] = engine.generator.get_state()
    save_file(tensors, tmp / "optim.safetensors")
    state = {
        **engine.state.to_checkpoint(),  # step, policy_version, kl_coef, version_segments
        "stage": engine.stage,
        "optimizers": optim_meta,
        "reward_moments": None if engine.reward_moments is None else engine.reward_moments.state(),
        **extra,
    }
    (tmp / "state.json").write_text(json.dumps(state))
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"step": engine.state.step, "files": files}))
    fsync_files(tmp, recursive=True, folder=False)  # every file of the tree; the rename below is not flushed
    if final.exists():  # a second checkpoint of the same step: move the old one aside, never delete it first
        old = Path(tempfile.mkdtemp(prefix=f"{final.name}.old-", dir=root))
        os.replace(final, old / final.name)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    latest_tmp = root / f"latest.tmp-{os.getpid()}"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    for stale in root.glob("step_*.tmp-*"):  # left by a writer that crashed
        shutil.rmtree(stale, ignore_errors=True)
    export_models(engine, final / "policy")
    return final


def save_policy(engine, directory: Path) -> None:
    """The actor as a Hugging Face folder; a LoRA actor as its merged model (loads in transformers and vLLM)."""
    if engine.cfg.actor.lora_r:
        directory.mkdir(parents=True, exist_ok=True)
        config = engine.actor.get_base_model().config
        config.save_pretrained(directory)
        if getattr(config, "quantization_config", None) is not None:  # the weights below are dequantized (QLoRA)
            written = json.loads((directory / "config.json").read_text())
            written.pop("quantization_config", None)
            (directory / "config.json").write_text(json.dumps(written, indent=2))
        # in the checkpoint layout, as save_pretrained writes it: a tie's alias once, fused tensors split back
        merged = engine.export.layout.to_checkpoint(merged_state_dict(engine.actor))
        save_file(
            {k: v.contiguous() for k, v in merged.items()}, directory / "model.safetensors", metadata={"format": "pt"}
        )
    else:
        engine.actor.save_pretrained(directory, safe_serialization=True)
    engine.tokenizer.save_pretrained(directory)


def export_models(engine, policy_dir: Path) -> None:
    """Write the actor (and the critic) as Hugging Face folders to ``actor_rollout.save`` / ``critic.save`` when set
    (the seeds' save fields): the latest weights, replaced whole (written beside, then renamed over). In a trainer
    group the actor is the checkpoint's gathered ``policy_dir`` (the critic is refused there: it stays sharded)."""
    cfg = engine.cfg
    targets = [(cfg.actor.save, engine.actor), (cfg.critic.save, engine.critic)]
    for dest, model in targets:
        if dest is None or model is None:
            continue
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        if model is engine.actor and engine.group is not None:
            shutil.copytree(policy_dir, tmp, dirs_exist_ok=True)
        elif model is engine.actor:
            save_policy(engine, tmp)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
            engine.tokenizer.save_pretrained(tmp)
        old = None
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / dest.name)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | Path, engine) -> dict[str, Any]:
    """Restore weights, optimizers, RNG and counters into ``engine``; returns state.json (for the caller's extras)."""
    path = Path(path)
    reason = incomplete_reason(path)
    if reason is not None:
        raise ValueError(f"checkpoint {path} is incomplete and cannot be loaded: {reason}")
    state = json.loads((path / "state.json").read_text())
    if state["stage"] != engine.stage:
        raise ValueError(f"checkpoint {path} was trained with stage {state['stage']}, config says {engine.stage}")
    if engine.critic is not None and not ((path / "critic").is_dir() or (path / "sharded").is_dir()):
        raise ValueError(f"checkpoint {path} has no critic/, but stage {engine.stage} trains one")
    if engine.group is not None:
        engine.load_group(path)  # every rank runs restore()
    else:
        restore(path, engine)
    return state


def restore(path: Path, engine) -> None:
    """Load a complete checkpoint folder into ``engine`` (this process's part of it, in a group): written at any
    world size, read at any world size."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    tensors = load_file(path / "optim.safetensors")
    # MindSpeed's no_load_optim / no_load_rng, per role (training's where the role sets none): fresh AdamW moments,
    # generators left as seeded. The actor and the critic draw from one generator, so their no_load_rng agree (config)
    a, c = engine.cfg.actor, engine.cfg.critic
    if engine.group is None and not (path / "sharded").is_dir():  # the single-process format, as always
        if engine.cfg.actor.lora_r:
            _load_adapter(engine.actor, path / "adapter.safetensors")
        else:
            _load_weights(engine.actor, path / "policy")
        if not a.no_load_optim:
            _restore_optimizer("actor", engine.actor_opt, tensors, state["optimizers"]["actor"])
        if engine.critic is not None:
            _load_weights(engine.critic, path / "critic")
            if not c.no_load_optim:
                _restore_optimizer("critic", engine.critic_opt, tensors, state["optimizers"]["critic"])
    else:
        if a.no_load_optim or (engine.critic is not None and c.no_load_optim):
            raise ValueError(NO_LOAD_OPTIM_IN_GROUP)
        _load_full_weights(engine.actor, path / "policy")
        if (path / "sharded").is_dir():
            _read_sharded(path / "sharded", engine)
        else:  # a single-process checkpoint into a group: each rank takes its shards of the full state
            _set_full_optimizer(engine.actor, engine.actor_opt, "actor", tensors, state["optimizers"]["actor"])
            if engine.critic is not None:
                _load_full_weights(engine.critic, path / "critic")
                _set_full_optimizer(engine.critic, engine.critic_opt, "critic", tensors, state["optimizers"]["critic"])
    if not a.no_load_rng:
        torch.set_rng_state(tensors["rng.torch"])
        engine.generator.set_state(tensors["rng.generator"])
    moments = state.get("reward_moments")
    if engine.reward_moments is not None and moments:
        engine.reward_moments = type(engine.reward_moments)(**moments)
    engine.state.restore(state)


# ------------------------------------------------------------------ the multi-process (FSDP2) format
def _sharded_state(engine) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"actor_optim": get_optimizer_state_dict(engine.actor, engine.actor_opt)}
    if engine.critic is not None:
        state["critic"] = get_model_state_dict(engine.critic)
        state["critic_optim"] = get_optimizer_state_dict(engine.critic, engine.critic_opt)
    return state


def _load_adapter(model: torch.nn.Module, file: Path) -> None:
    """Load a LoRA run's adapters; every adapter tensor of ``model`` must come from ``file``."""
    if not file.is_file():
        raise ValueError(f"{file.parent} has no adapter.safetensors, but the config trains LoRA adapters (lora_r)")
    weights = load_file(file)
    wanted = {k for k in model.state_dict() if ".lora_" in k}
    if set(weights) != wanted:
        raise ValueError(
            f"{file} does not match the adapters: missing {sorted(wanted - set(weights))[:5]}, "
            f"unexpected {sorted(set(weights) - wanted)[:5]}"
        )
    model.load_state_dict(weights, strict=False)


def write_sharded(path: Path, engine) -> None:
    """Every rank of a group: the policy gathered into Hugging Face format (rank 0 writes it), and the sharded state
    through torch.distributed.checkpoint (each rank writes its own shards)."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(engine.actor, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if engine.group.is_driver:
        engine.actor.save_pretrained(path / "policy", state_dict=full, safe_serialization=True)
        engine.tokenizer.save_pretrained(path / "policy")
    del full
    save(_sharded_state(engine), checkpoint_id=str(path / "sharded"))


def _read_sharded(directory: Path, engine) -> None:
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _sharded_state(engine)
    load(state, checkpoint_id=str(directory))  # resharded to this world size (plain tensors at world size 1)
    set_optimizer_state_dict(engine.actor, engine.actor_opt, state["actor_optim"])
    if engine.critic is not None:
        set_model_state_dict(engine.critic, state["critic"])
        set_optimizer_state_dict(engine.critic, engine.critic_opt, state["critic_optim"])


def _load_full_weights(model: torch.nn.Module, directory: Path) -> None:
    """A Hugging Face folder into a model that may be sharded: every rank reads the full tensors and keeps its
    shards. The folder is in the checkpoint layout (:func:`_live_weights`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    weights = _live_weights(model, directory)
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))


def _live_weights(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The safetensors of a save_pretrained folder under ``model``'s live names (:mod:`rlhf.layout`: a tie's alias is
    written once and comes back through the parameter it is tied to; fused tensors are rebuilt from the checkpoint's
    parts). Every checkpoint tensor of the model must be there, and nothing else: a tensor left out would silently
    keep its initial weights."""
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(f))
    if not weights:
        raise ValueError(f"{directory} holds no weights (*.safetensors)")
    live = model.state_dict()
    layout = CheckpointLayout(model, live)
    names = {name for name, _, _ in layout.specs()}
    missing, unexpected = sorted(names - set(weights)), sorted(set(weights) - names)
    if missing or unexpected:
        raise ValueError(f"{directory} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return layout.to_live(weights, live)


def _set_full_optimizer(model, opt, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """The single-process format (states keyed by parameter index) as a full, name-keyed optimizer state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [n for n, _ in model.named_parameters()]  # the optimizer's parameter order
    state: dict[str, dict[str, Any]] = {}
    prefix = f"{name}."
    for key, value in tensors.items():
        if key.startswith(prefix):
            idx, field = key[len(prefix) :].split(".", 1)
            state.setdefault(names[int(idx)], {})[field] = value
    for key, value in meta["scalars"].items():
        idx, field = key.split(".", 1)
        state.setdefault(names[int(idx)], {})[field] = value
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in meta["param_groups"]]
    set_optimizer_state_dict(
        model, opt, {"state": state, "param_groups": groups}, options=StateDictOptions(full_state_dict=True)
    )


def _load_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load a save_pretrained folder into ``model`` (see :func:`_live_weights`)."""
    if hasattr(model, "load_folder"):  # a value head on the actor (models.ValueHeadOnActor): its own file
        model.load_folder(directory)
        return
    model.load_state_dict(_live_weights(model, directory), strict=False)
