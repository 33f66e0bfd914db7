"""The experiment config: one YAML file per run, validated by pydantic.

The sections and algorithm field names are those of MindSpeed-LLM's Ray PPO / online DPO configs (the seed documents):
``training``, ``actor_rollout_ref.{actor_rollout, ref}``, ``critic``, ``reward``, ``algorithm``, ``resource_pool``,
plus ``data`` for what this system adds. Every field has a default and a description; an unknown key is
an error that names it (``ConfigError``): a Megatron-only key copied from a MindSpeed config is reported, not ignored.
Service settings (ports, addresses, tokens) do not live here: they come from ``RLHF_*`` environment variables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

STAGES = ("ray_ppo", "ray_online_dpo", "ray_grpo", "ray_rloo", "ray_reinforce_plus_plus")


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the offending key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _f(default: Any, description: str, **kw: Any) -> Any:
    return Field(default, description=description, **kw)


class TrainingConfig(Section):
    stage: Literal[STAGES] = _f("ray_ppo", "training algorithm: ray_ppo, ray_online_dpo, ray_grpo, ray_rloo, ...")
    global_batch_size: int = _f(8, "prompts per training step (rollout batch)", gt=0)
    seq_length: int = _f(1024, "maximum prompt + response tokens", gt=1)
    train_iters: int = _f(100, "training steps to run", gt=0)
    tokenizer_name_or_path: str | None = _f(None, "tokenizer directory; default: the actor's")
    seed: int = _f(1234, "random seed for data order, sampling and initialisation")
    lr: float = _f(1e-6, "actor learning rate", gt=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    clip_grad: float = _f(1.0, "gradient-norm clip (<= 0 disables)")
    lr_decay_style: Literal["constant", "linear", "cosine"] = _f("constant", "learning-rate schedule")
    lr_warmup_fraction: float = _f(0.0, "fraction of train_iters spent warming up", ge=0, le=1)
    bf16: bool = _f(
        False, "bf16 autocast compute over fp32 master weights and AdamW state; weights pushed to rollout as bf16"
    )
    device: Literal["auto", "cpu", "cuda", "npu"] = _f("auto", "device for the trainer's models")
    activation_checkpointing: bool = _f(
        False, "recompute each decoder layer's activations in backward instead of keeping them (less memory, more time)"
    )
    collective_timeout_s: float = _f(
        600.0, "multi-process trainer (torchrun): seconds a collective may wait before the group fails", gt=0
    )
    save_interval: int = _f(10, "checkpoint every N steps", gt=0)
    save: str = _f("runs/checkpoints", "checkpoint directory")
    load: str | None = _f(None, "checkpoint directory to resume from (default: the newest under save)")
    max_staleness: int = _f(0, "policy versions a sample may lag (0 = synchronous on-policy)", ge=0)
    weight_sync_interval: int = _f(1, "push weights to rollout every N updates", gt=0)
    log_interval: int = _f(1, "print progress every N steps", gt=0)
    log_completions_interval: int = _f(
        10,
        "every N steps, a table of sample completions (prompt, response, reward) in completions.jsonl and the "
        "trackers (0: never)",
        ge=0,
    )


class ActorRolloutConfig(Section):
    load: str = _f("tiny:policy", "actor/rollout model: a folder, a Hugging Face id (HF cache), or tiny:policy")
    save: str | None = _f(None, "where to write the trained actor (default: under training.save)")
    do_sample: bool = _f(True, "sample (True) or decode greedily (False) during rollout")
    temperature: float = _f(1.0, "sampling temperature; also divides logits for log-probs", gt=0)
    top_p: float = _f(1.0, "nucleus sampling", gt=0, le=1)
    top_k: int = _f(-1, "top-k sampling (-1 disables)")
    max_prompt_length: int = _f(512, "prompts longer than this are truncated from the left", gt=0)
    max_new_tokens: int | None = _f(None, "response budget; default seq_length - max_prompt_length", gt=0)
    num_samples_per_step: int = _f(1, "prompts per generation call", gt=0)
    n_samples_per_prompt: int = _f(1, "samples per prompt (GRPO/RLOO group size; 2 for online DPO)", gt=0)
    ppo_mini_batch_size: int = _f(1, "rows per actor optimizer step", gt=0)
    micro_batch_size: int | None = _f(None, "rows per forward/backward (gradient accumulation); default the minibatch")
    ppo_epochs: int = _f(1, "passes of the actor over each rollout batch", gt=0)
    clip_ratio: float = _f(0.2, "PPO clip epsilon", ge=0, lt=1)
    clip_ratio_high: float | None = _f(None, "upper clip epsilon (DAPO clip-higher); default clip_ratio")
    dual_clip: float | None = _f(None, "dual-clip constant c > 1 for negative advantages")
    tis_cap: float | None = _f(2.0, "truncated importance-sampling cap for stale samples (null = off)")
    shuffle_minibatch: bool = _f(False, "shuffle rows between minibatches")
    entropy_coeff: float = _f(0.0, "entropy bonus coefficient in the actor loss", ge=0)
    engine: Literal["vllm", "hf"] = _f("vllm", "rollout engine")
    stop: list[str] = _f([], "stop strings for generation")
    apply_chat_template: bool = _f(True, "wrap prompts in the tokenizer's chat template when it has one")
    lr: float | None = _f(None, "actor learning rate (overrides training.lr)")
    dtype: Literal["float32", "bfloat16", "float16"] = _f("float32", "rollout dtype")
    # vLLM engine settings (vLLM's engine-argument names; tensor parallelism under the seeds' Megatron name)
    max_model_len: int | None = _f(
        None, "rollout context length (prompt + response tokens); default the model's; vllm and hf engines", gt=1
    )
    gpu_memory_utilization: float | None = _f(
        None, "vllm: fraction of the device's memory vLLM may take (default vLLM's 0.9); lower it to share a GPU",
        gt=0, le=1,
    )  # fmt: skip
    tensor_model_parallel_size: int = _f(1, "vllm: devices the rollout engine shards the model over", ge=1, le=64)
    enforce_eager: bool = _f(True, "vllm: run eagerly (false: CUDA graphs / compile: faster decode, slower start)")


class RefConfig(Section):
    load: str | None = _f(None, "reference model; default the actor's initial weights")
    temperature: float | None = _f(None, "temperature for reference log-probs; default the rollout temperature")
    micro_batch_size: int = _f(16, "sequences per reference forward", gt=0)


class ActorRolloutRefConfig(Section):
    actor_rollout: ActorRolloutConfig = _f(ActorRolloutConfig(), "actor and rollout")
    ref: RefConfig = _f(RefConfig(), "reference policy")


class CriticConfig(Section):
    load: str | None = _f(None, "critic initialisation: a sequence-classification model (default the reward model)")
    cliprange_value: float = _f(0.2, "value clip range (<= 0 disables)")
    critic_mini_batch_size: int = _f(1, "rows per critic optimizer step", gt=0)
    critic_update_epochs: int = _f(1, "passes of the critic over each rollout batch", gt=0)
    lr: float | None = _f(None, "critic learning rate (default training.lr)")
    vf_coef: float = _f(1.0, "value-loss weight when actor and critic share one optimizer step", gt=0)


class ScorerConfig(Section):
    type: Literal["model", "rule", "remote"] = _f("rule", "model: reward model; rule: a Python function; remote: HTTP")
    name: str | None = _f(
        None,
        "rule name from the registry, or module:function for a user function (imported from the working directory)",
    )
    load: str | None = _f(None, "reward model directory (type model), or tiny:reward")
    url: str | None = _f(None, "remote scorer URL speaking OpenRLHF's /get_reward format (type remote)")
    weight: float = _f(1.0, "weight of this scorer in the combined reward")
    timeout_s: float = _f(30.0, "per-call timeout (remote)", gt=0)
    retries: int = _f(2, "retries after a failed remote call", ge=0)
    kwargs: dict[str, Any] = _f({}, "extra keyword arguments for a rule function")

    @model_validator(mode="after")
    def _check(self) -> ScorerConfig:
        needed = {"model": "load", "rule": "name", "remote": "url"}[self.type]
        if getattr(self, needed) is None:
            raise ValueError(f"a scorer of type {self.type!r} needs '{needed}'")
        return self


class RewardConfig(Section):
    scorers: list[ScorerConfig] = _f([ScorerConfig(type="model", load="tiny:reward")], "scorers, combined by weight")
    micro_batch_size: int = _f(16, "sequences per reward-model forward", gt=0)
    load: str | None = _f(None, "shorthand for one model scorer (MindSpeed's reward.load)")
    max_failed_fraction: float = _f(
        0.5,
        "the run stops, naming the scorer, when more than this fraction of a step's samples failed scoring ...",
        ge=0,
        le=1,
    )
    failed_patience: int = _f(3, "... for this many steps in a row (a short outage is waited out)", gt=0)


class KLCtrlConfig(Section):
    type: Literal["fixed", "adaptive"] = _f("fixed", "KL coefficient controller")
    kl_coef: float = _f(0.05, "KL penalty coefficient (initial value when adaptive)", ge=0)
    target_kl: float | None = _f(None, "adaptive: target KL per sequence")
    horizon: int = _f(10000, "adaptive: horizon in samples", gt=0)


class AlgorithmConfig(Section):
    adv_estimator: Literal[
        "gae", "grpo", "group_norm", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "dr_grpo"
    ] = _f("gae", "advantage estimator")
    gamma: float = _f(1.0, "discount factor", ge=0, le=1)
    lam: float = _f(0.95, "GAE lambda", ge=0, le=1)
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = _f(
        "kl", "per-token KL estimator (default k3, low_var_kl, for ray_grpo as TRL's GRPO; kl, k1, otherwise)"
    )
    kl_ctrl: KLCtrlConfig = _f(KLCtrlConfig(), "KL coefficient (TRL's beta)")
    missing_eos_penalty: float = _f(0.0, "subtracted from the score of responses without EOS", ge=0)
    whiten_rewards: bool = _f(False, "whiten per-token rewards over the batch before GAE")
    whiten_advantages: bool = _f(
        True,
        "whiten advantages over the batch: ray_ppo (TRL), ray_reinforce_plus_plus (OpenRLHF, plain variance), "
        "ray_rloo (TRL's normalize_advantages; default off there); ray_grpo uses scale_rewards instead",
    )
    score_position: Literal["trl", "last_token"] = _f("trl", "where the score is added: TRL (first pad) or last token")
    # The critic-free family (ray_grpo, ray_rloo, ray_reinforce_plus_plus) with TRL 1.12's option names. TRL's
    # epsilon, epsilon_high, num_iterations and beta are actor_rollout.clip_ratio, clip_ratio_high, ppo_epochs and
    # kl_ctrl.kl_coef here (the MindSpeed-LLM names of the same quantities).
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = _f(
        "dapo",
        "critic-free loss aggregation (TRL's loss_type): grpo per-sequence mean, bnpo token mean of the minibatch, "
        "dr_grpo sum / (rows x max_new_tokens), dapo sum / mean tokens per minibatch of the rollout batch; "
        "default dr_grpo when adv_estimator is dr_grpo",
    )
    scale_rewards: Literal["group", "batch", "none"] = _f(
        "group",
        "ray_grpo: divide advantages by the std of the prompt's group, of the batch, or not (TRL's scale_rewards); "
        "default none when adv_estimator is dr_grpo",
    )
    use_bias_correction_kl: bool = _f(True, "ray_grpo: weight the KL term by the importance ratio (TRL, DeepSeek-V3.2)")
    importance_sampling_level: Literal["token", "sequence"] = _f(
        "token", "ray_grpo / ray_reinforce_plus_plus: one ratio per token, or per sequence (GSPO; TRL's name)"
    )
    mask_truncated_completions: bool = _f(False, "critic-free: completions without EOS drop out of the loss (TRL)")
    top_entropy_quantile: float = _f(
        1.0, "ray_grpo: the policy loss keeps only the top quantile of tokens by entropy (TRL; 1 keeps all)", ge=0, le=1
    )
    rloo_convention: Literal["trl", "openrlhf"] = _f(
        "trl",
        "ray_rloo: trl folds beta x KL (k1 summed over the sequence) into the reward before the leave-one-out "
        "baseline and clips one ratio per sequence (TRL's RLOOTrainer); openrlhf puts the baseline on the score, "
        "adds the per-token KL penalty after it and uses the token-level clipped loss (OpenRLHF's rloo)",
    )
    dpo_beta: float = _f(0.1, "online DPO beta", gt=0)
    dpo_loss_type: Literal["sigmoid", "ipo"] = _f("sigmoid", "online DPO loss")


class ResourcePoolConfig(Section):
    actor_rollout: list[int] = _f([1], "devices per node for the actor/rollout")
    ref: list[int] = _f([1], "devices per node for the reference")
    critic: list[int] = _f([1], "devices per node for the critic")
    reward: list[int] = _f([1], "devices per node for the reward model")


class DataConfig(Section):
    path: str = _f("builtin:arithmetic", "prompt data set: a .jsonl or .parquet file, or builtin:arithmetic")
    map_keys: dict[str, str] = _f({"prompt": "prompt", "label": "label"}, "our key -> column in the file")
    system: str | None = _f(None, "system message prepended when the chat template is applied")
    shuffle: bool = _f(True, "shuffle the prompt order each epoch")
    max_samples: int | None = _f(None, "use only the first N prompts", gt=0)


class ExperimentConfig(Section):
    run_id: str = _f("default", "names the Redis keys and the run directory", pattern=r"^[A-Za-z0-9_.-]+$")
    defaults: list[Any] = _f([], "MindSpeed-LLM hydra defaults list; accepted and ignored")
    training: TrainingConfig = _f(TrainingConfig(), "options common to all roles")
    actor_rollout_ref: ActorRolloutRefConfig = _f(ActorRolloutRefConfig(), "actor, rollout and reference")
    critic: CriticConfig = _f(CriticConfig(), "PPO critic")
    reward: RewardConfig = _f(RewardConfig(), "reward scorers")
    algorithm: AlgorithmConfig = _f(AlgorithmConfig(), "advantages, KL and losses")
    resource_pool: ResourcePoolConfig = _f(ResourcePoolConfig(), "devices per role")
    data: DataConfig = _f(DataConfig(), "prompt data set")

    @property
    def actor(self) -> ActorRolloutConfig:
        return self.actor_rollout_ref.actor_rollout

    @property
    def max_new_tokens(self) -> int:
        a = self.actor
        return a.max_new_tokens or max(1, self.training.seq_length - a.max_prompt_length)

    @property
    def logprob_temperature(self) -> float | None:
        """What divides the logits for the trainer's and the reference's log-probs: None for the sampling temperature
        (TRL's PPO, GRPO, RLOO), 1.0 for ray_online_dpo (TRL's OnlineDPOTrainer never divides)."""
        return 1.0 if self.training.stage == "ray_online_dpo" else None

    @property
    def critic_free_estimator(self) -> str:
        """The estimator of a critic-free stage: grpo, dr_grpo, rloo, reinforce_plus_plus(_baseline)."""
        stage, est = self.training.stage, self.algorithm.adv_estimator
        if stage == "ray_grpo":
            return "dr_grpo" if est == "dr_grpo" else "grpo"
        if stage == "ray_rloo":
            return "rloo"
        if stage == "ray_reinforce_plus_plus":
            return est if est == "reinforce_plus_plus_baseline" else "reinforce_plus_plus"
        raise ValueError(f"{stage} is not a critic-free stage")

    @model_validator(mode="after")
    def _cross_checks(self) -> ExperimentConfig:
        if self.reward.load is not None:
            self.reward.scorers = [ScorerConfig(type="model", load=self.reward.load)]
        if self.training.stage == "ray_online_dpo" and self.actor.n_samples_per_prompt not in (1, 2):
            raise ValueError("actor_rollout_ref.actor_rollout.n_samples_per_prompt must be 2 for ray_online_dpo")
        # Combinations that load but cannot learn: reported together, before any service starts.
        problems = []
        k = self.algorithm.kl_ctrl
        if k.type == "adaptive" and k.target_kl is None:
            problems.append("algorithm.kl_ctrl.type is adaptive but kl_ctrl.target_kl is not set (the KL it steers to)")
        if self.training.stage in _CRITIC_FREE and self.actor.n_samples_per_prompt < 2:
            problems.append(
                f"training.stage {self.training.stage} compares the samples of each prompt, but "
                "actor_rollout.n_samples_per_prompt is 1: every advantage is 0 and nothing is learnt; set 2 or more"
            )
        if self.training.stage == "ray_online_dpo" and not self.actor.do_sample:
            problems.append(
                "ray_online_dpo with actor_rollout.do_sample false generates two identical answers per prompt (no "
                "preference to learn); set do_sample: true"
            )
        if problems:
            raise ValueError("; ".join(problems))
        _check_algorithm(self.training.stage, self.algorithm)
        _check_rollout(self)
        if self.training.stage == "ray_rloo" and self.algorithm.rloo_convention == "trl" and self.actor.dual_clip:
            raise ValueError("actor_rollout.dual_clip is not used by ray_rloo with rloo_convention trl")
        return self


# adv_estimator values each stage accepts ("gae", the default, means the stage's own estimator)
_STAGE_ESTIMATORS = {
    "ray_ppo": ("gae",),
    "ray_online_dpo": ("gae",),
    "ray_grpo": ("gae", "grpo", "group_norm", "dr_grpo"),
    "ray_rloo": ("gae", "rloo"),
    "ray_reinforce_plus_plus": ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
}
_CRITIC_FREE = ("ray_grpo", "ray_rloo", "ray_reinforce_plus_plus")
# the critic-free fields -> the stages that read them: one set for another stage is an error, never ignored.
# (The older fields, e.g. dpo_beta or lam, are not checked: shared configs set them for every stage.)
_ALGORITHM_FIELD_STAGES = {
    "loss_type": ("ray_grpo", "ray_rloo", "ray_reinforce_plus_plus"),
    "scale_rewards": ("ray_grpo",),
    "use_bias_correction_kl": ("ray_grpo",),
    "importance_sampling_level": ("ray_grpo", "ray_reinforce_plus_plus"),
    "mask_truncated_completions": _CRITIC_FREE,
    "top_entropy_quantile": ("ray_grpo",),
    "rloo_convention": ("ray_rloo",),
}
# TRL's (or OpenRLHF's) defaults where a stage's differs from the field default; an explicit value always wins
_STAGE_DEFAULTS = {
    "ray_grpo": {"kl_coef": 0.0, "kl_penalty": "low_var_kl"},  # TRL GRPOConfig: beta 0.0; its KL term is k3
    "ray_rloo": {"whiten_advantages": False},  # TRL RLOOConfig: beta 0.05 (the field default), no normalisation
    "ray_reinforce_plus_plus": {"kl_coef": 0.01, "loss_type": "bnpo"},  # OpenRLHF: init_kl_coef, token mean
}


# rollout fields only the vllm engine reads: set explicitly with engine hf they would be ignored, so they are errors
VLLM_ONLY_FIELDS = ("gpu_memory_utilization", "tensor_model_parallel_size", "enforce_eager")


def _check_rollout(cfg: ExperimentConfig) -> None:
    a = cfg.actor
    if a.engine == "hf":
        for name in VLLM_ONLY_FIELDS:
            if name in a.model_fields_set:
                raise ValueError(f"actor_rollout_ref.actor_rollout.{name} is read by the vllm engine only; "
                                 "remove it or set engine: vllm")  # fmt: skip
    if a.max_model_len is not None and a.max_model_len < a.max_prompt_length + cfg.max_new_tokens:
        raise ValueError(
            f"actor_rollout_ref.actor_rollout.max_model_len {a.max_model_len} is shorter than max_prompt_length + "
            f"the response budget ({a.max_prompt_length} + {cfg.max_new_tokens}); raise it or lower "
            "max_prompt_length / max_new_tokens (training.seq_length)"
        )


def _check_algorithm(stage: str, alg: AlgorithmConfig) -> None:
    if alg.adv_estimator not in _STAGE_ESTIMATORS[stage]:
        raise ValueError(
            f"algorithm.adv_estimator {alg.adv_estimator!r} does not apply to training.stage {stage}; "
            f"use one of {_STAGE_ESTIMATORS[stage]}"
        )
    explicit = set(alg.model_fields_set)
    for name in sorted(explicit):
        stages = _ALGORITHM_FIELD_STAGES.get(name)
        if stages is not None and stage not in stages:
            raise ValueError(f"algorithm.{name} is not used by training.stage {stage} (only by {', '.join(stages)})")
    if stage == "ray_rloo" and alg.rloo_convention == "trl" and "loss_type" in explicit:
        raise ValueError(
            "algorithm.loss_type is not used by ray_rloo with rloo_convention trl (one ratio per sequence)"
        )
    defaults = dict(_STAGE_DEFAULTS.get(stage, {}))
    if stage == "ray_grpo" and alg.adv_estimator == "dr_grpo":  # Dr. GRPO = TRL's loss_type dr_grpo, scale_rewards none
        defaults.update(loss_type="dr_grpo", scale_rewards="none")
    if stage == "ray_rloo" and alg.rloo_convention == "openrlhf":
        defaults["loss_type"] = "bnpo"
    for name, value in defaults.items():
        if name == "kl_coef":
            if "kl_coef" not in alg.kl_ctrl.model_fields_set:
                alg.kl_ctrl.kl_coef = value
        elif name not in explicit:
            setattr(alg, name, value)


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid experiment config {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown key (not used by rlhf-pipeline)" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any] | None, source: str = "<dict>") -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_config(path: str | Path) -> ExperimentConfig:
    """Read and validate a YAML experiment config; raises ConfigError naming the bad key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {err}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    return parse_config(data, str(path))
