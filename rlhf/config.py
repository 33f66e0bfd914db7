"""The experiment config: one YAML file per run, validated by pydantic.

The sections and algorithm field names are those of MindSpeed-LLM's Ray PPO / online DPO configs (the seed documents):
``training``, ``actor_rollout_ref.{actor_rollout, ref}``, ``critic``, ``reward``, ``algorithm``, ``resource_pool``,
plus ``data`` for what this system adds. Every field has a default and a description; an unknown key is
an error that names it (``ConfigError``): a Megatron-only key copied from a MindSpeed config is reported, not ignored.
Service settings (ports, addresses, tokens) do not live here: they come from ``RLHF_*`` environment variables.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from rlhf import config_compat
from rlhf.config_rules import (
    check_algorithm,
    check_rollout,
    distill_problems,
    environment_problems,
    eval_problems,
    inherit_role_defaults,
    lora_notes,
    mindspeed_default_notes,
    not_built_message,
    optimization_problems,
    rejection_sampling_problems,
    role_problems,
    shared_backbone_problems,
    stage_notes,
)
from rlhf.config_sections import (
    ActorRolloutConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    ConfigError,
    CriticConfig,
    DataConfig,
    EnvironmentConfig,
    EvalConfig,
    ResourcePoolConfig,
    RewardConfig,
    ScorerConfig,
    Section,
    TrainingConfig,
    TrainingServiceConfig,
)
from rlhf.stages import Stage


def logits_temperature(sampled: float) -> float:
    """What log-probs of tokens sampled at temperature ``sampled`` divide the logits by: ``sampled``, or 1 for greedy
    sampling (0)."""
    return sampled if sampled > 0 else 1.0


class ExperimentConfig(Section):
    run_id: str = Field(
        "default", description="names the Redis keys and the run directory", pattern=r"^[A-Za-z0-9_.-]+$"
    )
    training: TrainingConfig = Field(TrainingConfig(), description="options common to all roles")
    actor_rollout_ref: ActorRolloutRefConfig = Field(
        ActorRolloutRefConfig(), description="actor, rollout and reference"
    )
    critic: CriticConfig = Field(CriticConfig(), description="PPO critic")
    reward: RewardConfig = Field(RewardConfig(), description="reward scorers")
    algorithm: AlgorithmConfig = Field(AlgorithmConfig(), description="advantages, KL and losses")
    resource_pool: ResourcePoolConfig = Field(ResourcePoolConfig(), description="devices per role")
    data: DataConfig = Field(DataConfig(), description="prompt data set")
    eval: EvalConfig = Field(EvalConfig(), description="evaluation on held-out prompts during training")
    environment: EnvironmentConfig = Field(EnvironmentConfig(), description="multi-turn episodes (environment service)")
    training_service: TrainingServiceConfig = Field(
        TrainingServiceConfig(), description="the training service (tinker SDK API) under rlhf up"
    )
    # Keys of a MindSpeed config that do not apply here, one line each (config_compat); warned about once at start-up
    _notes: list[str] = PrivateAttr(default_factory=list)
    # MindSpeed keys read as a field here (actor_rollout.data_path as data.path), said at start-up beside the notes
    _mapped: list[str] = PrivateAttr(default_factory=list)
    # Fields a MindSpeed-style config leaves out whose default here differs from MindSpeed's; in the same warning
    _default_notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def notes(self) -> list[str]:
        return list(self._notes)

    @property
    def mapped_notes(self) -> list[str]:
        return list(self._mapped)

    @property
    def default_notes(self) -> list[str]:
        return list(self._default_notes)

    @property
    def actor(self) -> ActorRolloutConfig:
        return self.actor_rollout_ref.actor_rollout

    @property
    def max_new_tokens(self) -> int:
        a = self.actor
        return a.max_new_tokens or max(1, (a.seq_length or self.training.seq_length) - a.max_prompt_length)

    def sampling_defaults(self) -> dict[str, Any]:
        """``actor_rollout`` as sampling values, decided here only: the prompt jobs the trainer publishes carry them,
        and the rollout service fills the fields a request leaves unset with them. Temperature 0 is greedy
        (``do_sample: false``)."""
        a = self.actor
        return {
            "temperature": a.temperature if a.do_sample else 0.0,
            "top_p": a.top_p,
            "top_k": a.top_k,
            "max_tokens": self.max_new_tokens,
            "stop": tuple(a.stop),
        }

    @property
    def sample_temperature(self) -> float:
        """The temperature of the distribution the rollout samples from, as log-probs divide the logits by it: the
        sampling temperature, 1 for greedy samples. The trainer's log-probs and the reference service's default."""
        return logits_temperature(self.sampling_defaults()["temperature"])

    @property
    def logprob_temperature(self) -> float | None:
        """What divides the logits for the trainer's and the reference's log-probs: None for the sampling temperature
        (TRL's PPO, GRPO, RLOO), 1.0 for ray_online_dpo (TRL's OnlineDPOTrainer never divides)."""
        return self.training.stage.traits.logprob_temperature

    @property
    def critic_free_estimator(self) -> str:
        """The estimator of a critic-free stage: grpo, dr_grpo, rloo, reinforce_plus_plus(_baseline)."""
        stage = self.training.stage
        if not stage.traits.group_advantages:
            raise ValueError(f"{stage} is not a critic-free stage")
        return stage.traits.estimators[self.algorithm.adv_estimator]

    @model_validator(mode="after")
    def _cross_checks(self) -> ExperimentConfig:
        if self.reward.load is not None:
            self.reward.scorers = [ScorerConfig(type="model", load=self.reward.load)]
        inherit_role_defaults(self)
        stage = self.training.stage
        if stage.traits.pairs and self.actor.n_samples_per_prompt not in (1, 2):
            raise ValueError(f"actor_rollout_ref.actor_rollout.n_samples_per_prompt must be 2 for {stage}")
        # Combinations that load but cannot learn: reported together, before any service starts.
        problems = []
        k = self.algorithm.kl_ctrl
        if k.type == "adaptive" and k.target_kl is None:
            problems.append("algorithm.kl_ctrl.type is adaptive but kl_ctrl.target_kl is not set (the KL it steers to)")
        t = self.training
        if t.weight_sync_interval - 1 > t.max_staleness:
            # between pushes rollout serves weights up to interval - 1 updates old: every such sample would be
            # dropped as stale, and the ring would train nothing
            problems.append(
                f"training.weight_sync_interval {t.weight_sync_interval} leaves rollout up to "
                f"{t.weight_sync_interval - 1} updates behind between pushes, more than training.max_staleness "
                f"{t.max_staleness} allows (those samples would all be dropped as stale): set max_staleness >= "
                f"{t.weight_sync_interval - 1} or weight_sync_interval <= {t.max_staleness + 1}"
            )
        d = self.algorithm.distill
        pure_distill = d.coef > 0 and d.reward_coef == 0  # per-token teacher advantages: no group compared
        if stage.traits.group_advantages and self.actor.n_samples_per_prompt < 2 and not pure_distill:
            problems.append(
                f"training.stage {stage} compares the samples of each prompt, but "
                "actor_rollout.n_samples_per_prompt is 1: every advantage is 0 and nothing is learnt; set 2 or more"
            )
        if stage.traits.pairs and not self.actor.do_sample:
            problems.append(
                f"{stage} with actor_rollout.do_sample false generates two identical answers per prompt (no "
                "preference to learn); set do_sample: true"
            )
        problems += optimization_problems(self)
        problems += eval_problems(self)
        problems += environment_problems(self)
        problems += distill_problems(self)
        problems += rejection_sampling_problems(self)
        problems += shared_backbone_problems(self)
        problems += role_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        check_algorithm(stage, self.algorithm)
        check_rollout(self)
        if stage == Stage.RLOO and self.algorithm.rloo_convention == "trl" and self.actor.dual_clip:
            raise ValueError("actor_rollout.dual_clip is not used by ray_rloo with rloo_convention trl")
        return self


def _section_fields(loc: tuple) -> list[str]:
    """The valid keys of the section an error location points into."""
    model: Any = ExperimentConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(part, str) else None
        if field is None:
            if isinstance(part, int) and model is ScorerConfig:
                continue
            return []
        ann = field.annotation
        if ann is not None and getattr(ann, "__origin__", None) is list:
            ann = ann.__args__[0]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _closest_key(name: str, fields: list[str]) -> str | None:
    """The valid key a misspelt ``name`` most likely meant. A mini-batch size (samples per optimizer step) and a
    micro-batch size (samples per forward/backward) differ in meaning, not only in spelling: one is never offered
    for the other."""
    words = set(name.split("_"))
    pool = [
        f
        for f in fields
        if not ({"micro", "mini"} & words and {"micro", "mini"} & set(f.split("_")) != {"micro", "mini"} & words)
    ]
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.6)
    return close[0] if close else None


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid experiment config {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden" and not_built_message(key):
            msg = not_built_message(key)
        elif e["type"] == "extra_forbidden":
            close = _closest_key(str(e["loc"][-1]), _section_fields(e["loc"]))
            msg = "unknown key (not used by rlhf-pipeline)" + (f"; did you mean '{close}'?" if close else "")
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any] | None, source: str = "<dict>") -> ExperimentConfig:
    """Validate a config mapping: MindSpeed/Megatron-only keys are mapped or noted (``cfg.notes``), everything else
    must be a field; raises ConfigError naming each bad key."""
    raw = data or {}
    try:
        data, notes, mapped = config_compat.translate(raw)
        cfg = ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None
    except ValueError as err:
        raise ConfigError(f"invalid experiment config {source}: {err}") from None
    cfg._notes = notes + stage_notes(cfg) + lora_notes(cfg)
    cfg._mapped = mapped
    if config_compat.mindspeed_style(raw):
        cfg._default_notes = mindspeed_default_notes(cfg)
    return cfg


def config_warning(cfg: ExperimentConfig) -> str | None:
    """The one start-up warning: the MindSpeed keys read as another field (the data source); every key the config
    sets that does not apply here, and why; and every default a MindSpeed-style config relies on that differs here."""
    parts = [config_compat.format_mapped(cfg.mapped_notes), config_compat.format_notes(cfg.notes)]
    if cfg.default_notes:
        parts.append("defaults that differ from MindSpeed-LLM's:\n" + "\n".join(f"  {n}" for n in cfg.default_notes))
    return "\n".join(p for p in parts if p) or None


def read_config_data(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The raw mapping of a YAML config file with command-line ``overrides`` applied (:func:`apply_overrides`), not
    yet validated; raises ConfigError for an unreadable file, bad YAML or a malformed override."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {err}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    return apply_overrides(data or {}, overrides)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read and validate a YAML experiment config (with command-line ``overrides``); raises ConfigError naming the
    bad key."""
    source = str(path) + (f" with overrides {' '.join(overrides)}" if overrides else "")
    return parse_config(read_config_data(path, overrides), source)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Hydra-style overrides, as MindSpeed-LLM's launch takes them: ``section.key=value`` sets a field (the dotted
    key of the YAML file, a list index as a number: ``reward.scorers.0.weight=2``), the value parsed as YAML
    (``true``, ``1e-6``, ``[2]``, ``null``); ``+key=value`` / ``++key=value`` are the same (Hydra's add / force);
    ``~key`` removes a key. Returns a new mapping; the result is validated like a file by :func:`parse_config`, so
    an unknown key or a bad value is an error naming it."""
    out = copy.deepcopy(data)
    for item in overrides:
        delete = item.startswith("~")
        key, eq, text = item.lstrip("~+").partition("=")
        key = key.strip()
        if not key or (not eq and not delete) or (eq and delete) or any(not p for p in key.split(".")):
            raise ConfigError(
                f"command-line override {item!r}: expected KEY=VALUE with a dotted key and a YAML value "
                "(e.g. training.train_iters=5), or ~KEY to remove a key"
            )
        try:
            value = yaml.safe_load(text) if eq else None
        except yaml.YAMLError as err:
            raise ConfigError(f"command-line override {key}: the value {text!r} is not valid YAML ({err})") from None
        if isinstance(value, str) and re.fullmatch(r"[-+]?\d+[eE][-+]?\d+", value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string; Hydra, and a user, mean the number
        parts = key.split(".")
        node: Any = out
        for depth, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                node = node[_list_index(node, part, ".".join(parts[: depth + 1]))]
                continue
            if node.get(part) is None:  # absent, or an empty section (``critic:`` with nothing under it)
                if delete:
                    break
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict | list):
                raise ConfigError(
                    f"command-line override {key}: {'.'.join(parts[: depth + 1])} is a value, not a section"
                )
        else:
            last = parts[-1]
            if isinstance(node, list):
                index = _list_index(node, last, key)
                if delete:
                    node.pop(index)
                else:
                    node[index] = value
            elif delete:
                node.pop(last, None)
            else:
                node[last] = value
    return out


def _list_index(node: list, part: str, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"command-line override {key}: a list of {len(node)} here; give an index 0-{len(node) - 1}")
    return int(part)
