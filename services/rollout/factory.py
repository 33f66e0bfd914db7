"""Which rollout engine runs and how it is built: ``actor_rollout_ref.actor_rollout.engine`` (``vllm`` | ``hf``),
overridden by ``RLHF_ROLLOUT_ENGINE``; the deployment's overrides of rollout fields; the vLLM engine's arguments.
Apart from :mod:`services.rollout.engine`, which both engines import, so that nothing imports in a circle."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.config import parse_config
from rlhf.config_rules import VLLM_ONLY_FIELDS
from services.rollout.engine import EngineBase
from services.rollout.engine_types import EngineHooks
from services.rollout.hf_adapters import max_adapters_from_env
from services.rollout.options import default_options
from services.rollout.vllm_weights import inplace_load_bytes_from_env

if TYPE_CHECKING:  # pragma: no cover
    from rlhf.config import ExperimentConfig

log = logging.getLogger("rlhf.rollout")

ENGINE_ENV_VAR = "RLHF_ROLLOUT_ENGINE"
ENGINES = ("vllm", "hf")


def engine_kind(cfg: ExperimentConfig, env: dict[str, str] | None = None) -> str:
    """The engine to run: ``RLHF_ROLLOUT_ENGINE`` when set, else ``actor_rollout_ref.actor_rollout.engine``."""
    env = os.environ if env is None else env
    kind = (env.get(ENGINE_ENV_VAR) or "").strip().lower() or cfg.actor.engine
    if kind not in ENGINES:
        raise ValueError(f"{ENGINE_ENV_VAR}={kind!r}: the rollout engine must be one of {', '.join(ENGINES)}")
    return kind


# Deployment overrides of rollout config fields: a rollout that shares its GPU is a property of the deployment, not
# of the experiment (compose.gpu.yaml sets these), so the same config file serves both.
ROLLOUT_ENV_OVERRIDES = {
    "RLHF_ROLLOUT_GPU_MEMORY_UTILIZATION": "gpu_memory_utilization",
    "RLHF_ROLLOUT_MAX_MODEL_LEN": "max_model_len",
}


def apply_rollout_env(cfg: ExperimentConfig, env: Mapping[str, str] | None = None) -> ExperimentConfig:
    """Set the rollout fields named in :data:`ROLLOUT_ENV_OVERRIDES` from ``env`` (empty = unset), validated as the
    config's own fields are (ConfigError naming the variable and the field). Returns a new config."""
    env = os.environ if env is None else env
    data = cfg.model_dump(exclude_unset=True)
    actor = data.setdefault("actor_rollout_ref", {}).setdefault("actor_rollout", {})
    changed = {}
    for var, field in ROLLOUT_ENV_OVERRIDES.items():
        value = (env.get(var) or "").strip()
        if value:
            actor[field] = value
            changed[var] = value
    if not changed:
        return cfg
    # a bad value raises ConfigError naming the field and, through the source, the variable that set it
    return parse_config(data, source=f"(with {', '.join(f'{k}={v}' for k, v in changed.items())})")


def vllm_engine_kwargs(cfg: ExperimentConfig) -> dict[str, Any]:
    """vLLM engine arguments from ``actor_rollout`` (beyond model, dtype and seed): what the engine is built with."""
    a = cfg.actor
    kw: dict[str, Any] = {"tensor_parallel_size": a.tensor_model_parallel_size}
    if a.enforce_eager is not None:  # null: the engine decides by its device (VllmEngine.default_enforce_eager)
        kw["enforce_eager"] = a.enforce_eager
    if a.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = a.gpu_memory_utilization
    return kw


def make_engine(
    cfg: ExperimentConfig,
    *,
    kind: str | None = None,
    device: str | None = None,
    hooks: EngineHooks | None = None,
    **kw: Any,
) -> EngineBase:
    """Build (not start) the engine the config asks for."""
    from rlhf.models import resolve_model_path

    kind = kind or engine_kind(cfg)
    path = resolve_model_path(cfg.actor.load)
    engine = _build(kind, cfg, path, device, hooks, **kw)
    engine.defaults = default_options(cfg)
    return engine


def _build(
    kind: str, cfg: ExperimentConfig, path: Path, device: str | None, hooks: EngineHooks | None, **kw: Any
) -> EngineBase:
    from rlhf.lora import pushes_adapter

    if pushes_adapter(cfg.actor) and kind != "vllm":  # the trainer will push adapters, which only vLLM serves
        raise ValueError(
            f"{ENGINE_ENV_VAR}={kind}: actor_rollout.lora_sync sends LoRA adapters, which the {kind} engine cannot "
            "serve; set actor_rollout.lora_sync: merged"
        )
    if kind == "vllm":
        from services.rollout.vllm_engine import VllmEngine
        from services.rollout.vllm_lora import LoraSpec

        a = cfg.actor
        if pushes_adapter(a):
            kw.setdefault("lora", LoraSpec(a.lora_r, a.lora_alpha, tuple(a.lora_target_modules)))
        kw.setdefault("max_model_len", cfg.actor.max_model_len)
        kw.setdefault("inplace_load_bytes", inplace_load_bytes_from_env())  # ValueError naming the variable
        kw["engine_kwargs"] = {**vllm_engine_kwargs(cfg), **kw.get("engine_kwargs", {})}
        kw.setdefault("staged_swap", cfg.actor.staged_weight_swap)
        kw.setdefault("partial_rollouts", cfg.actor.partial_rollouts)
        kw.setdefault("max_adapters", max_adapters_from_env(default=0))  # named adapters: off unless asked (LoRA cost)
        return VllmEngine(
            path, model_name=cfg.actor.load, dtype=cfg.actor.dtype, seed=cfg.training.seed, hooks=hooks, **kw
        )
    if kind == "hf":
        from services.rollout.hf_engine import HFEngine

        kw.setdefault("max_model_len", cfg.actor.max_model_len)
        kw.setdefault("max_adapters", max_adapters_from_env())  # ValueError naming the variable
        kw.setdefault("partial_rollouts", cfg.actor.partial_rollouts)
        ignored = sorted(f for f in VLLM_ONLY_FIELDS if f in cfg.actor.model_fields_set)
        if ignored:  # the config refuses these with engine hf; here RLHF_ROLLOUT_ENGINE=hf overrode engine: vllm
            log.warning(
                "rollout: %s=hf: actor_rollout %s apply to the vllm engine only and are not used",
                ENGINE_ENV_VAR,
                ", ".join(ignored),
            )
        return HFEngine(
            path, model_name=cfg.actor.load, dtype=cfg.actor.dtype, device=device or "auto", hooks=hooks, **kw
        )
    raise ValueError(f"unknown rollout engine {kind!r}: use one of {', '.join(ENGINES)}")
