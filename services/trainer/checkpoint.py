"""Atomic trainer checkpoints: the policy in Hugging Face format plus everything needed to resume exactly.

Layout of ``<save>/step_<N>/``::

    policy/               save_pretrained + tokenizer: transformers and vLLM load it as is
    critic/               the PPO critic (sequence classification), when there is one
    optim.safetensors     optimizer tensors (Adam moments), flattened as "<opt>.<param index>.<key>"
    state.json            step, policy version, optimizer scalars, KL coefficient, data position, RNG seeds,
                          and the job ids already trained on (so a restart trains nothing twice)

A checkpoint is written to ``step_<N>.tmp`` and renamed into place, then ``latest`` is replaced atomically: a crash
at any moment leaves the previous checkpoint intact. Nothing is pickled: safetensors and JSON only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


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


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(root: str | Path, engine, extra: dict[str, Any]) -> Path:
    """Write step_<N> for the current step; ``extra`` (data cursor, trained job ids, ...) goes in state.json."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{engine.step_count}"
    tmp = root / f"step_{engine.step_count}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    engine.actor.save_pretrained(tmp / "policy", safe_serialization=True)
    engine.tokenizer.save_pretrained(tmp / "policy")
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
        "step": engine.step_count,
        "policy_version": engine.policy_version,
        "kl_coef": engine.kl_ctrl.value,
        "stage": engine.stage,
        "optimizers": optim_meta,
        **extra,
    }
    (tmp / "state.json").write_text(json.dumps(state))
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_checkpoint(path: str | Path, engine) -> dict[str, Any]:
    """Restore weights, optimizers, RNG and counters into ``engine``; returns state.json (for the caller's extras)."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    if state["stage"] != engine.stage:
        raise ValueError(f"checkpoint {path} was trained with stage {state['stage']}, config says {engine.stage}")
    from safetensors.torch import load_file as load_weights

    engine.actor.load_state_dict(_hf_weights(path / "policy", load_weights), strict=False)
    tensors = load_file(path / "optim.safetensors")
    _restore_optimizer("actor", engine.actor_opt, tensors, state["optimizers"]["actor"])
    if engine.critic is not None and (path / "critic").is_dir():
        engine.critic.load_state_dict(_hf_weights(path / "critic", load_weights), strict=False)
        _restore_optimizer("critic", engine.critic_opt, tensors, state["optimizers"]["critic"])
    torch.set_rng_state(tensors["rng.torch"])
    engine.generator.set_state(tensors["rng.generator"])
    engine.step_count = state["step"]
    engine.policy_version = state["policy_version"]
    engine.kl_ctrl.value = state["kl_coef"]
    return state


def _hf_weights(directory: Path, load) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        weights.update(load(f))
    return weights
