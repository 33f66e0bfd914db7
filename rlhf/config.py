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
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from rlhf import config_compat

STAGES = ("ray_ppo", "ray_online_dpo", "ray_grpo", "ray_rloo", "ray_reinforce_plus_plus")


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the offending key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _f(default: Any, description: str, **kw: Any) -> Any:
    return Field(default, description=description, **kw)


class TrainingConfig(Section):
    stage: Literal[STAGES] = _f("ray_ppo", "training algorithm: ray_ppo, ray_online_dpo, ray_grpo, ray_rloo, ...")
    global_batch_size: int = _f(
        8, "prompts per training step (the rollout batch; each gives n_samples_per_prompt samples)", gt=0
    )
    seq_length: int = _f(1024, "maximum prompt + response length in tokens", gt=1)
    train_iters: int = _f(100, "training steps (optimizer updates of one rollout batch each) to run", gt=0)
    tokenizer_name_or_path: str | None = _f(None, "tokenizer directory; default: the actor's")
    seed: int = _f(1234, "random seed for data order, sampling and initialisation")
    lr: float = _f(1e-6, "actor learning rate", gt=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    clip_grad: float = _f(1.0, "gradient-norm clip (<= 0 disables)")
    lr_decay_style: Literal["constant", "linear", "cosine"] = _f(
        "constant", "learning-rate schedule after warm-up, per training step: constant, linear or cosine to min_lr"
    )
    lr_warmup_fraction: float = _f(
        0.0, "fraction of train_iters over which the learning rate rises linearly from 0 (Megatron's)", ge=0, lt=1
    )
    min_lr: float = _f(0.0, "learning rate at the last step of a linear or cosine schedule (actor)", ge=0)
    micro_batch_size: int | None = _f(
        None,
        "default micro_batch_size of every role (actor_rollout, ref, critic, reward) whose section does not set "
        "its own, as in MindSpeed-LLM's training section",
        gt=0,
    )
    no_load_optim: bool = _f(False, "on resume, restore the weights but start the optimizers (AdamW moments) afresh")
    no_load_rng: bool = _f(False, "on resume, do not restore the random-number generators (reseeded from seed)")
    bf16: bool = _f(
        False, "bf16 autocast compute over fp32 master weights and AdamW state; weights pushed to rollout as bf16"
    )
    device: Literal["auto", "cpu", "cuda", "npu"] = _f("auto", "device for the trainer's models")
    padding_free: bool = _f(
        False,
        "pack each batch's sequences without padding (positions per sequence, attention within each sequence) for "
        "the actor's, critic's, reference's and reward model's passes; pays when lengths vary (rlhf.packing)",
    )
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
    weight_sync_interval: int = _f(
        1, "push weights to rollout every N updates (rollout then lags up to N - 1: needs max_staleness >= N - 1)", gt=0
    )
    max_mismatch_kl: float | None = _f(
        0.01,
        "the run stops (exit 3) when mismatch/kl, the k3 KL(rollout || trainer) of the log-probs of tokens sampled by "
        "the weights the trainer holds (fp32: ~1e-13; bf16 LLMs: ~1e-3), is over this ... (null: never)",
        gt=0,
    )
    mismatch_patience: int = _f(
        3,
        "... for this many steps in a row (with top_p/top_k it only warns: truncated log-probs differ by design)",
        gt=0,
    )
    log_interval: int = _f(1, "print progress every N steps", gt=0)
    log_completions_interval: int = _f(
        10,
        "every N steps, a table of sample completions (prompt, response, reward) in completions.jsonl and the "
        "trackers (0: never)",
        ge=0,
    )


class ActorRolloutConfig(Section):
    load: str = _f("tiny:policy", "actor/rollout model: a folder, a Hugging Face id (HF cache), or tiny:policy")
    save: str | None = _f(
        None,
        "also write the actor as a Hugging Face folder here at every checkpoint (the policy is always in the "
        "checkpoint under training.save)",
    )
    do_sample: bool = _f(
        True,
        "sample (true) or decode greedily (false) during rollout. MindSpeed-LLM's default is false; this one is true "
        "(every shipped config and the critic-free stages sample), and a MindSpeed-style config that leaves it out "
        "gets a start-up warning",
    )
    temperature: float = _f(1.0, "sampling temperature; also divides logits for log-probs", gt=0)
    top_p: float = _f(1.0, "nucleus sampling", gt=0, le=1)
    top_k: int = _f(-1, "top-k sampling (-1 disables)")
    max_prompt_length: int = _f(512, "prompt budget in tokens: longer prompts are truncated from the left", gt=0)
    max_new_tokens: int | None = _f(None, "response budget in tokens; default seq_length - max_prompt_length", gt=0)
    n_samples_per_prompt: int = _f(1, "samples per prompt (GRPO/RLOO group size; 2 for online DPO)", gt=0)
    ppo_mini_batch_size: int = _f(
        1,
        "samples (responses, not prompts: a rollout batch has global_batch_size x n_samples_per_prompt of them) per "
        "actor optimizer step, over all trainer processes; MindSpeed-LLM's ray_ppo counts the same rows, per data-"
        "parallel rank. Online DPO: 2 samples = 1 pair, so pairs = this / 2, at least 1 (MindSpeed doubles its value: "
        "there it counts pairs)",
        gt=0,
    )
    micro_batch_size: int | None = _f(
        None,
        "samples per forward/backward; a minibatch's gradients accumulate over its micro-batches before the "
        "step (default: training.micro_batch_size, else the whole minibatch at once)",
        gt=0,
    )
    ppo_epochs: int = _f(1, "passes of the actor over each rollout batch", gt=0)
    clip_ratio: float = _f(0.2, "PPO clip epsilon", ge=0, lt=1)
    clip_ratio_high: float | None = _f(None, "upper clip epsilon (DAPO clip-higher); default clip_ratio")
    dual_clip: float | None = _f(None, "dual-clip constant c > 1 for negative advantages")
    tis_cap: float | None = _f(2.0, "truncated importance-sampling cap for stale samples (null = off)")
    shuffle_minibatch: bool = _f(False, "shuffle samples between minibatches (actor and critic)")
    entropy_coeff: float = _f(0.0, "entropy bonus coefficient in the actor loss (token mean entropy)", ge=0)
    freezing_actor_steps: int = _f(
        0, "ray_ppo: the actor is not updated for the first N training steps while the critic learns (OpenRLHF)", ge=0
    )
    ptx_coef: float = _f(
        0.0, "PPO-ptx: weight of the SFT (next-token) loss on data.pretrain_data added to the actor loss", ge=0
    )
    engine: Literal["vllm", "hf"] = _f("vllm", "rollout engine")
    stop: list[str] = _f([], "stop strings for generation")
    apply_chat_template: bool = _f(True, "wrap prompts in the tokenizer's chat template when it has one")
    lr: float | None = _f(None, "actor learning rate (overrides training.lr)")
    # LoRA (seed 001's peft LoraConfig: r, lora_alpha, lora_dropout, target_modules)
    lora_r: int = _f(
        0, "LoRA rank of the actor's adapters (0: full fine-tuning); rollout gets the merged weights", ge=0
    )
    lora_alpha: float = _f(16.0, "LoRA alpha: the adapter's update is scaled by alpha / r", gt=0)
    lora_dropout: float = _f(
        0.0, "LoRA dropout; only 0: the policy-gradient losses compare two forward passes (TRL disables it too)", ge=0
    )
    lora_target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "names of the actor's linear modules that get adapters",
    )
    # per-role optimizer settings (MindSpeed puts them in the role section); null: the training section's value
    weight_decay: float | None = _f(None, "actor AdamW weight decay (default training.weight_decay)", ge=0)
    adam_beta1: float | None = _f(None, "actor AdamW beta1 (default training.adam_beta1)", ge=0, lt=1)
    adam_beta2: float | None = _f(None, "actor AdamW beta2 (default training.adam_beta2)", ge=0, lt=1)
    clip_grad: float | None = _f(None, "actor gradient-norm clip, <= 0 disables (default training.clip_grad)")
    lr_decay_style: Literal["constant", "linear", "cosine"] | None = _f(
        None, "actor schedule (default training.lr_decay_style)"
    )
    lr_warmup_fraction: float | None = _f(None, "actor warm-up (default training.lr_warmup_fraction)", ge=0, lt=1)
    min_lr: float | None = _f(None, "actor final learning rate (default training.min_lr)", ge=0)
    num_gpus_for_train: int | None = _f(
        None,
        "rlhf up: trainer processes, one per device (an FSDP2 group under torchrun when > 1; the "
        "--trainer-procs default)",
        ge=1,
    )
    num_gpus_for_infer: int | None = _f(
        None, "rlhf up: accelerators for rollout: replicas = this / tensor_model_parallel_size", ge=1
    )
    dtype: Literal["float32", "bfloat16", "float16"] = _f("float32", "rollout dtype")
    # vLLM engine settings (vLLM's engine-argument names; tensor parallelism under the seeds' Megatron name)
    max_model_len: int | None = _f(
        None, "rollout context length (prompt + response tokens); default the model's; vllm and hf engines", gt=1
    )
    gpu_memory_utilization: float | None = _f(
        None,
        "vllm: fraction of the device's memory vLLM may take (default vLLM's 0.9); lower it to share a GPU",
        gt=0,
        le=1,
    )
    tensor_model_parallel_size: int = _f(1, "vllm: devices the rollout engine shards the model over", ge=1, le=64)
    enforce_eager: bool | None = _f(
        None,
        "vllm: run eagerly; null: eagerly except on CUDA without staged_weight_swap (vLLM's in-place reload "
        "keeps captured CUDA graphs valid); false: CUDA graphs / compile (faster decode, slower start)",
    )
    staged_weight_swap: bool | None = _f(
        None,
        "vllm: load each weight update into a second copy of the model while generation goes on, then swap "
        "the two between two steps (the pause is the swap, not the load; a second copy of the weights in memory); "
        "null: on the CPU, true: on any device (needs enforce_eager), false: load inside the pause",
    )


class RefConfig(Section):
    load: str | None = _f(None, "reference model; default the actor's initial weights")
    temperature: float | None = _f(None, "temperature for reference log-probs; default the rollout temperature")
    micro_batch_size: int = _f(16, "sequences per reference forward (default training.micro_batch_size, else 16)", gt=0)


class ActorRolloutRefConfig(Section):
    actor_rollout: ActorRolloutConfig = _f(ActorRolloutConfig(), "actor and rollout")
    ref: RefConfig = _f(RefConfig(), "reference policy")


class CriticConfig(Section):
    load: str | None = _f(None, "critic initialisation: a sequence-classification model (default the reward model)")
    cliprange_value: float = _f(0.2, "value clip range (<= 0 disables)")
    critic_mini_batch_size: int = _f(1, "samples per critic optimizer step (the unit of ppo_mini_batch_size)", gt=0)
    micro_batch_size: int | None = _f(
        None,
        "samples per critic forward/backward; a critic minibatch's gradients accumulate over its micro-batches "
        "before the step, weighted to equal one pass over the minibatch (default: training.micro_batch_size, else "
        "the whole minibatch at once)",
        gt=0,
    )
    critic_update_epochs: int = _f(1, "passes of the critic over each rollout batch", gt=0)
    save: str | None = _f(None, "also write the critic as a Hugging Face folder here at every checkpoint")
    vf_coef: float = _f(
        1.0,
        "multiplies the value loss before the critic's backward (seed 001's value_loss_rate). The critic has its own "
        "AdamW, separate from the actor's, so this only scales the critic's gradient: it matters against clip_grad "
        "and Adam's epsilon, and is not a weight between the actor's and the critic's losses",
        gt=0,
    )
    # per-role optimizer settings, as the actor's (MindSpeed's role sections override training); null: training's
    lr: float | None = _f(None, "critic learning rate (default training.lr)", gt=0)
    weight_decay: float | None = _f(None, "critic AdamW weight decay (default training.weight_decay)", ge=0)
    adam_beta1: float | None = _f(None, "critic AdamW beta1 (default training.adam_beta1)", ge=0, lt=1)
    adam_beta2: float | None = _f(None, "critic AdamW beta2 (default training.adam_beta2)", ge=0, lt=1)
    clip_grad: float | None = _f(None, "critic gradient-norm clip, <= 0 disables (default training.clip_grad)")
    lr_decay_style: Literal["constant", "linear", "cosine"] | None = _f(
        None, "critic schedule (default training.lr_decay_style)"
    )
    lr_warmup_fraction: float | None = _f(None, "critic warm-up (default training.lr_warmup_fraction)", ge=0, lt=1)
    min_lr: float | None = _f(None, "critic final learning rate (default training.min_lr)", ge=0)


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
    micro_batch_size: int = _f(
        16, "sequences per reward-model forward (default training.micro_batch_size, else 16)", gt=0
    )
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
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"] = _f(
        "kl",
        "per-token KL estimator (default k3, low_var_kl, for ray_grpo as TRL's GRPO; kl, k1, otherwise); "
        "full (ray_ppo): the exact KL over the vocabulary, from a reference copy the trainer holds (one more model "
        "in its memory)",
    )
    kl_ctrl: KLCtrlConfig = _f(KLCtrlConfig(), "KL coefficient (TRL's beta)")
    missing_eos_penalty: float = _f(
        0.0, "subtracted from the score of responses without EOS (MindSpeed also accepts it under actor_rollout)", ge=0
    )
    normalize_reward: bool = _f(
        False,
        "scores become (score - running mean) / running std over every score seen so far, this batch "
        "included (OpenRLHF's reward normalisation; the statistics are checkpointed)",
    )
    reward_clip_range: tuple[float, float] | None = _f(
        None, "clip scores (after normalisation) to [low, high] (OpenRLHF's reward_clip_range); null: no clipping"
    )
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
    """Accelerators per role under ``rlhf up`` (one list entry per node; rlhf up runs on one node). Each service
    process sees only its own devices (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES), handed out in order: trainer,
    rollout replicas, reference, reward. Without resource_pool or num_gpus_* in the config every service sees every
    device; no effect on a CPU-only machine or under Kubernetes (there the chart's resources place each role)."""

    actor_rollout: list[int] = _f(
        [1], "devices for the trainer and rollout together: num_gpus_for_train + num_gpus_for_infer"
    )
    ref: list[int] = _f([1], "devices for the reference service")
    critic: list[int] = _f(
        [0],
        "must be [0]: the critic trains inside the trainer process on the trainer's devices (count its memory in "
        "num_gpus_for_train); a device count of its own is refused",
    )
    reward: list[int] = _f([1], "devices for the reward service")


class DataConfig(Section):
    path: str = _f(
        "builtin:arithmetic",
        "prompt data set: a .jsonl, .json (a list of records) or .parquet file, or builtin:arithmetic",
    )
    map_keys: dict[str, str] = _f(
        {"prompt": "prompt", "label": "label", "text": "text"},
        "our key -> column in the file (prompt, label; text: the pretrain_data column)",
    )
    pretrain_data: str | None = _f(
        None, "PPO-ptx SFT texts (.jsonl, .json or .parquet, column map_keys.text), used when ptx_coef > 0"
    )
    system: str | None = _f(None, "system message prepended when the chat template is applied")
    shuffle: bool = _f(True, "shuffle the prompt order each epoch")
    max_samples: int | None = _f(None, "use only the first N prompts", gt=0)


def logits_temperature(sampled: float) -> float:
    """What log-probs of tokens sampled at temperature ``sampled`` divide the logits by: ``sampled``, or 1 for greedy
    sampling (0)."""
    return sampled if sampled > 0 else 1.0


class ExperimentConfig(Section):
    run_id: str = _f("default", "names the Redis keys and the run directory", pattern=r"^[A-Za-z0-9_.-]+$")
    training: TrainingConfig = _f(TrainingConfig(), "options common to all roles")
    actor_rollout_ref: ActorRolloutRefConfig = _f(ActorRolloutRefConfig(), "actor, rollout and reference")
    critic: CriticConfig = _f(CriticConfig(), "PPO critic")
    reward: RewardConfig = _f(RewardConfig(), "reward scorers")
    algorithm: AlgorithmConfig = _f(AlgorithmConfig(), "advantages, KL and losses")
    resource_pool: ResourcePoolConfig = _f(ResourcePoolConfig(), "devices per role")
    data: DataConfig = _f(DataConfig(), "prompt data set")
    # Keys of a MindSpeed config that do not apply here, one line each (config_compat); warned about once at start-up
    _notes: list[str] = PrivateAttr(default_factory=list)
    # Fields a MindSpeed-style config leaves out whose default here differs from MindSpeed's; in the same warning
    _default_notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def notes(self) -> list[str]:
        return list(self._notes)

    @property
    def default_notes(self) -> list[str]:
        return list(self._default_notes)

    @property
    def actor(self) -> ActorRolloutConfig:
        return self.actor_rollout_ref.actor_rollout

    @property
    def max_new_tokens(self) -> int:
        a = self.actor
        return a.max_new_tokens or max(1, self.training.seq_length - a.max_prompt_length)

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
        _inherit_micro_batch_size(self)
        if self.training.stage == "ray_online_dpo" and self.actor.n_samples_per_prompt not in (1, 2):
            raise ValueError("actor_rollout_ref.actor_rollout.n_samples_per_prompt must be 2 for ray_online_dpo")
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
        problems += _optimization_problems(self)
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


def _inherit_micro_batch_size(cfg: ExperimentConfig) -> None:
    """MindSpeed's ``training.micro_batch_size`` is every role's default: copied into each role section that does not
    set its own. Kept out of ``model_fields_set``: an inherited value is not one the user set in that section (the
    per-stage "not read" notes and the micro > mini check look at explicit values only)."""
    value = cfg.training.micro_batch_size
    if value is None:
        return
    for section in (cfg.actor, cfg.actor_rollout_ref.ref, cfg.critic, cfg.reward):
        if "micro_batch_size" not in section.model_fields_set:
            section.micro_batch_size = value
            section.model_fields_set.discard("micro_batch_size")


def _optimization_problems(cfg: ExperimentConfig) -> list[str]:
    """Options that only make sense together: what to change, one line each."""
    a, c, t, stage, problems = cfg.actor, cfg.critic, cfg.training, cfg.training.stage, []
    lr = a.lr or t.lr
    min_lr = t.min_lr if a.min_lr is None else a.min_lr
    if min_lr > lr:
        problems.append(f"the actor's min_lr {min_lr} is above its lr {lr}; lower min_lr")
    # An inherited training.micro_batch_size larger than a minibatch is harmless (one pass over the minibatch); the
    # same value set in the role's own section is a mistake worth naming.
    if "micro_batch_size" in a.model_fields_set and (a.micro_batch_size or 0) > a.ppo_mini_batch_size:
        problems.append(
            f"actor_rollout.micro_batch_size {a.micro_batch_size} is larger than ppo_mini_batch_size "
            f"{a.ppo_mini_batch_size} (micro-batches split a minibatch); lower it or leave it unset"
        )
    if stage == "ray_ppo":
        critic_lr = c.lr or t.lr
        critic_min_lr = t.min_lr if c.min_lr is None else c.min_lr
        if critic_min_lr > critic_lr:
            problems.append(
                f"the critic's min_lr {critic_min_lr} is above its lr {critic_lr}; set critic.min_lr (its default "
                "is training.min_lr) at or below critic.lr"
            )
        if "micro_batch_size" in c.model_fields_set and (c.micro_batch_size or 0) > c.critic_mini_batch_size:
            problems.append(
                f"critic.micro_batch_size {c.micro_batch_size} is larger than critic_mini_batch_size "
                f"{c.critic_mini_batch_size} (micro-batches split a minibatch); lower it or leave it unset"
            )
    if cfg.resource_pool.critic != [0]:
        problems.append(
            f"resource_pool.critic {cfg.resource_pool.critic}: the critic trains inside the trainer process, on the "
            "trainer's devices, so it cannot have devices of its own here; remove the key (or set [0]) and count "
            "the critic's memory in actor_rollout.num_gpus_for_train"
        )
    if a.freezing_actor_steps:
        if stage != "ray_ppo":
            problems.append("actor_rollout.freezing_actor_steps lets the critic warm up: only ray_ppo has a critic")
        elif a.freezing_actor_steps >= t.train_iters:
            problems.append(
                f"actor_rollout.freezing_actor_steps {a.freezing_actor_steps} >= training.train_iters "
                f"{t.train_iters}: the actor would never train"
            )
    if a.lora_dropout > 0:
        problems.append(
            "actor_rollout.lora_dropout must be 0: dropout makes the new and old log-probs of the same tokens differ, "
            "which the ratio and KL terms read as policy change (TRL's PPO disables it as well)"
        )
    if a.lora_r == 0 and {"lora_alpha", "lora_target_modules"} & a.model_fields_set:
        problems.append("actor_rollout.lora_alpha / lora_target_modules are read only with lora_r > 0; set lora_r")
    if a.ptx_coef > 0 and cfg.data.pretrain_data is None:
        problems.append("actor_rollout.ptx_coef > 0 needs data.pretrain_data (the SFT texts)")
    if a.ptx_coef == 0 and cfg.data.pretrain_data is not None:
        problems.append("data.pretrain_data is only read for PPO-ptx: set actor_rollout.ptx_coef > 0 or remove it")
    if a.ptx_coef > 0 and stage == "ray_online_dpo":
        problems.append(
            "actor_rollout.ptx_coef: PPO-ptx mixes the SFT loss into a policy-gradient stage, not ray_online_dpo"
        )
    clip = cfg.algorithm.reward_clip_range
    if clip is not None and not clip[0] < clip[1]:
        problems.append(f"algorithm.reward_clip_range {list(clip)} must be [low, high] with low < high")
    if cfg.algorithm.kl_penalty == "full" and stage != "ray_ppo":
        problems.append(
            f"algorithm.kl_penalty full (TRL PPO's whole-vocabulary KL) is built for ray_ppo only, not {stage}; use "
            "kl (k1) or low_var_kl (k3), which estimate the same KL from the sampled tokens"
        )
    if a.num_gpus_for_infer is not None and a.num_gpus_for_infer % a.tensor_model_parallel_size:
        problems.append(
            f"actor_rollout.num_gpus_for_infer {a.num_gpus_for_infer} is not a multiple of "
            f"tensor_model_parallel_size {a.tensor_model_parallel_size} (each replica takes that many)"
        )
    rp = cfg.resource_pool
    for role in ("actor_rollout", "ref", "reward"):
        counts = getattr(rp, role)
        if len(counts) != 1 or counts[0] < 0:
            problems.append(f"resource_pool.{role} {counts}: rlhf up runs on one machine; give one device count")
    both = a.num_gpus_for_train is not None and a.num_gpus_for_infer is not None
    if (
        both
        and "actor_rollout" in rp.model_fields_set
        and rp.actor_rollout[0] != a.num_gpus_for_train + a.num_gpus_for_infer
    ):
        problems.append(
            f"resource_pool.actor_rollout {rp.actor_rollout} is not num_gpus_for_train + "
            f"num_gpus_for_infer ({a.num_gpus_for_train} + {a.num_gpus_for_infer})"
        )
    return problems


# explicitly set fields a stage does not read: noted in the start-up warning (shared configs set them for every stage)
_NOT_READ_BY = {
    "ray_online_dpo": {
        "actor_rollout": ("clip_ratio", "clip_ratio_high", "dual_clip", "tis_cap"),
        "algorithm": (
            "adv_estimator",
            "gamma",
            "lam",
            "kl_penalty",
            "kl_ctrl",
            "whiten_rewards",
            "whiten_advantages",
            "score_position",
        ),
        "critic": tuple(CriticConfig.model_fields),
    },
    "ray_ppo": {"algorithm": ("dpo_beta", "dpo_loss_type")},
    "ray_grpo": {"algorithm": ("lam", "whiten_rewards", "score_position", "dpo_beta", "dpo_loss_type")},
    "ray_rloo": {"algorithm": ("lam", "whiten_rewards", "score_position", "dpo_beta", "dpo_loss_type")},
    "ray_reinforce_plus_plus": {"algorithm": ("lam", "whiten_rewards", "score_position", "dpo_beta", "dpo_loss_type")},
}
for _stage in _CRITIC_FREE:
    _NOT_READ_BY[_stage]["critic"] = tuple(CriticConfig.model_fields)
_NOT_READ_WHY = {
    "ray_online_dpo": "the DPO loss has no ratio clip, advantages, KL penalty or critic; its KL strength is "
    "algorithm.dpo_beta",
    "ray_ppo": "the DPO fields are read by ray_online_dpo only",
}


def _stage_notes(cfg: ExperimentConfig) -> list[str]:
    stage, notes = cfg.training.stage, []
    sections = {"actor_rollout": cfg.actor, "algorithm": cfg.algorithm, "critic": cfg.critic}
    for section, names in _NOT_READ_BY.get(stage, {}).items():
        explicit = sections[section].model_fields_set
        for name in names:
            if name in explicit:
                why = _NOT_READ_WHY.get(stage, "a critic-free stage has no critic, GAE or DPO loss")
                notes.append(
                    f"{'actor_rollout_ref.' if section == 'actor_rollout' else ''}{section}.{name}: "
                    f"not read by {stage} ({why})"
                )
    return notes


# rollout fields only the vllm engine reads: set explicitly with engine hf they would be ignored, so they are errors
VLLM_ONLY_FIELDS = ("gpu_memory_utilization", "tensor_model_parallel_size", "enforce_eager", "staged_weight_swap")


def _check_rollout(cfg: ExperimentConfig) -> None:
    a = cfg.actor
    if a.engine == "hf":
        for name in VLLM_ONLY_FIELDS:
            if name in a.model_fields_set:
                raise ValueError(
                    f"actor_rollout_ref.actor_rollout.{name} is read by the vllm engine only; "
                    "remove it or set engine: vllm"
                )
    if a.staged_weight_swap and a.enforce_eager is False:
        raise ValueError(
            "actor_rollout_ref.actor_rollout.staged_weight_swap needs enforce_eager: true (CUDA graphs "
            "capture the live weights' addresses, so the swapped-in copy would not be used); set one "
            "of them to false"
        )
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
        if e["type"] == "extra_forbidden":
            close = _closest_key(str(e["loc"][-1]), _section_fields(e["loc"]))
            msg = "unknown key (not used by rlhf-pipeline)" + (f"; did you mean '{close}'?" if close else "")
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any] | None, source: str = "<dict>") -> ExperimentConfig:
    """Validate a config mapping: MindSpeed/Megatron-only keys are mapped or noted (``cfg.notes``), everything else
    must be a field; raises ConfigError naming each bad key."""
    raw = data or {}
    try:
        data, notes = config_compat.translate(raw)
        cfg = ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None
    except ValueError as err:
        raise ConfigError(f"invalid experiment config {source}: {err}") from None
    cfg._notes = notes + _stage_notes(cfg)
    if config_compat.mindspeed_style(raw):
        cfg._default_notes = _mindspeed_default_notes(cfg)
    return cfg


def _mindspeed_default_notes(cfg: ExperimentConfig) -> list[str]:
    """Fields a MindSpeed-style config leaves out whose default here is not MindSpeed's. do_sample keeps its default
    true (every shipped config, the critic-free stages and the rollout service's REST defaults sample); a MindSpeed
    user who expects greedy rollouts from the omission is told instead."""
    out = []
    if "do_sample" not in cfg.actor.model_fields_set and cfg.training.stage == "ray_ppo":
        out.append(
            "actor_rollout_ref.actor_rollout.do_sample is not set: it defaults to true here (rollout samples at "
            "temperature), false in MindSpeed-LLM (greedy decoding); set it to choose and silence this line"
        )
    return out


def config_warning(cfg: ExperimentConfig) -> str | None:
    """The one start-up warning: every key the config sets that does not apply here, and why; and every default a
    MindSpeed-style config relies on that differs here."""
    parts = [config_compat.format_notes(cfg.notes)]
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
