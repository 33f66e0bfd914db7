"""The experiment config's cross-field rules: what each stage reads and defaults, options that only make sense
together, and what a MindSpeed-style config should hear about. :class:`rlhf.config.ExperimentConfig` applies them
when it validates; each problem is one line saying what to change."""

from __future__ import annotations

from typing import Any

from rlhf.config_sections import DATA_MAP_KEYS, AlgorithmConfig, CriticConfig
from rlhf.environments.registry import UnknownEnvironment, check
from rlhf.stages import CRITIC_FREE, Stage

# The rules take the rlhf.config.ExperimentConfig being validated (it calls them); importing its class here, even
# for the type checker only, would make the two modules import each other.
Config = Any

# vLLM's LoRAConfig.max_lora_rank choices: an engine is started with the smallest one that holds the adapter's rank
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_MAX_LORA_RANK = VLLM_LORA_RANKS[-1]
# the critic-free fields -> the stages that read them: one set for another stage is an error, never ignored.
# (The older fields, e.g. dpo_beta or lam, are not checked: shared configs set them for every stage.)
_ALGORITHM_FIELD_STAGES = {
    "loss_type": CRITIC_FREE,
    "scale_rewards": (Stage.GRPO,),
    "use_bias_correction_kl": (Stage.GRPO,),
    "importance_sampling_level": (Stage.GRPO, Stage.REINFORCE_PLUS_PLUS),
    "mask_truncated_completions": CRITIC_FREE,
    "top_entropy_quantile": (Stage.GRPO,),
    "rloo_convention": (Stage.RLOO,),
    "reward_baseline": (Stage.PPO,),  # the critic-free stages have their own group baselines
    "distill": CRITIC_FREE,  # per-token advantages: the policy-gradient stages without a critic
}
# TRL's (or OpenRLHF's) defaults where a stage's differs from the field default; an explicit value always wins
_STAGE_DEFAULTS = {
    Stage.GRPO: {"kl_coef": 0.0, "kl_penalty": "low_var_kl"},  # TRL GRPOConfig: beta 0.0; its KL term is k3
    Stage.RLOO: {"whiten_advantages": False},  # TRL RLOOConfig: beta 0.05 (the field default), no normalisation
    Stage.REINFORCE_PLUS_PLUS: {"kl_coef": 0.01, "loss_type": "bnpo"},  # OpenRLHF: init_kl_coef, token mean
}


# MindSpeed merges the training section into each role's (the role's own value wins): these keys are read per role
_ROLE_INHERITED = {
    "micro_batch_size": ("actor_rollout", "ref", "critic", "reward"),
    # only the actor's: the others take the actor's sequences, whatever their length (MindSpeed runs them with
    # variable_seq_lengths); set in their own section it is a limit
    "seq_length": ("actor_rollout",),
    "bf16": ("actor_rollout", "ref", "critic", "reward"),
    "no_load_optim": ("actor_rollout", "critic"),
    "no_load_rng": ("actor_rollout", "critic"),
}


def inherit_role_defaults(cfg: Config) -> None:
    """MindSpeed's ``training`` values are every role's defaults: copied into each role section that does not set its
    own. Kept out of ``model_fields_set``: an inherited value is not one the user set in that section (the per-stage
    "not read" notes and the micro > mini check look at explicit values only)."""
    sections = {
        "actor_rollout": cfg.actor,
        "ref": cfg.actor_rollout_ref.ref,
        "critic": cfg.critic,
        "reward": cfg.reward,
    }
    for key, roles in _ROLE_INHERITED.items():
        value = getattr(cfg.training, key)
        if value is None:
            continue
        for role in roles:
            section = sections[role]
            if key not in section.model_fields_set:
                setattr(section, key, value)
                section.model_fields_set.discard(key)


def role_problems(cfg: Config) -> list[str]:
    """Per-role MindSpeed keys that contradict what the run does: a role that could not take the actor's
    sequences, generators the actor and the critic share set apart, a critic device this layout cannot give."""
    a, env, problems = cfg.actor, cfg.environment, []
    # the longest sample the rollout makes: a prompt and a response, or an episode's turns
    budget = (env.max_tokens or env.max_turns * cfg.max_new_tokens) if env.name else cfg.max_new_tokens
    longest = a.max_prompt_length + budget
    roles = [("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref), ("reward", cfg.reward)]
    if cfg.training.stage.traits.critic:
        roles.append(("critic", cfg.critic))
    for where, section in roles:
        if section.seq_length is not None and section.seq_length < longest:
            problems.append(
                f"{where}.seq_length {section.seq_length} is shorter than the samples it receives (max_prompt_length "
                f"{a.max_prompt_length} + response budget {budget} = {longest}); raise it, leave it unset (no limit "
                "but the model's context) or lower actor_rollout.seq_length / max_new_tokens"
            )
    c = cfg.critic
    if cfg.training.stage.traits.critic and bool(c.no_load_rng) != bool(a.no_load_rng):
        problems.append(
            f"critic.no_load_rng {c.no_load_rng} and actor_rollout.no_load_rng {a.no_load_rng} differ: actor and "
            "critic draw their minibatch orders from the trainer's one generator here, restored or not as one; set "
            "them alike"
        )
    pool = cfg.resource_pool.critic
    if pool not in ([0], [1]):
        problems.append(
            f"resource_pool.critic {pool}: the critic runs whole on one device (there is no tensor parallelism in "
            "the trainer here); give [1] for a device of its own or [0] to share the trainer's"
        )
    elif pool == [1] and c.shared_backbone:
        problems.append(
            "resource_pool.critic [1] with critic.shared_backbone: the value head sits on the actor's own backbone, "
            "on the actor's device; remove one of them"
        )
    return problems


def optimization_problems(cfg: Config) -> list[str]:
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
    if stage.traits.critic:
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
    if a.freezing_actor_steps:
        if not stage.traits.critic:
            problems.append("actor_rollout.freezing_actor_steps lets the critic warm up: only ray_ppo has a critic")
        elif a.freezing_actor_steps >= t.train_iters:
            problems.append(
                f"actor_rollout.freezing_actor_steps {a.freezing_actor_steps} >= training.train_iters "
                f"{t.train_iters}: the actor would never train"
            )
    if a.lora_r == 0 and {"lora_alpha", "lora_dropout", "lora_target_modules", "lora_sync"} & a.model_fields_set:
        problems.append(
            "actor_rollout.lora_alpha / lora_dropout / lora_target_modules / lora_sync are read only with lora_r > 0; "
            "set lora_r"
        )
    problems += _qlora_problems(a)
    if a.lora_r and a.lora_sync == "adapter" and a.engine != "vllm":
        problems.append(
            "actor_rollout.lora_sync adapter needs the vllm engine (vLLM serves LoRA adapters; the hf engine takes "
            "the merged weights): set lora_sync merged or auto"
        )
    if a.lora_r > VLLM_MAX_LORA_RANK and a.engine == "vllm" and a.lora_sync != "merged":
        problems.append(
            f"actor_rollout.lora_r {a.lora_r}: vLLM serves adapters of rank at most {VLLM_MAX_LORA_RANK}; "
            "lower lora_r or set lora_sync merged"
        )
    if a.ptx_coef > 0 and cfg.data.pretrain_data is None:
        problems.append("actor_rollout.ptx_coef > 0 needs data.pretrain_data (the SFT texts)")
    if a.ptx_coef == 0 and cfg.data.pretrain_data is not None:
        problems.append("data.pretrain_data is only read for PPO-ptx: set actor_rollout.ptx_coef > 0 or remove it")
    if a.ptx_coef > 0 and stage.traits.pairs:
        problems.append(f"actor_rollout.ptx_coef: PPO-ptx mixes the SFT loss into a policy-gradient stage, not {stage}")
    clip = cfg.algorithm.reward_clip_range
    if clip is not None and not clip[0] < clip[1]:
        problems.append(f"algorithm.reward_clip_range {list(clip)} must be [low, high] with low < high")
    problems += reward_shaping_problems(cfg)
    if cfg.algorithm.kl_penalty == "full" and stage != Stage.PPO:
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


# critic fields of a separate critic model, which critic.shared_backbone has not
_SEPARATE_CRITIC_FIELDS = ("load", "critic_mini_batch_size", "critic_update_epochs", "micro_batch_size", "save")


def shared_backbone_problems(cfg: Config) -> list[str]:
    """A value head on the actor: PPO only; nothing that belongs to a separate critic model."""
    c = cfg.critic
    if not c.shared_backbone:
        return []
    problems = []
    if not cfg.training.stage.traits.critic:
        problems.append(
            f"critic.shared_backbone puts PPO's value head on the actor; stage {cfg.training.stage} has no critic"
        )
    separate = [f"critic.{f}" for f in _SEPARATE_CRITIC_FIELDS if f in c.model_fields_set]
    if separate:
        problems.append(
            f"{', '.join(separate)} describe a separate critic model; with critic.shared_backbone the value head is "
            "on the actor and its loss joins the actor's minibatches (ppo_mini_batch_size, ppo_epochs, "
            "micro_batch_size): remove them"
        )
    if cfg.actor.freezing_actor_steps:
        problems.append(
            "actor_rollout.freezing_actor_steps trains the critic alone first; with critic.shared_backbone the "
            "critic is the actor's backbone: remove one"
        )
    return problems


def rejection_sampling_problems(cfg: Config) -> list[str]:
    """Best of K needs K >= 2 samples per prompt (online DPO always has two)."""
    rs = cfg.algorithm.rejection_sampling
    if not rs.interval:
        set_ = sorted(rs.model_fields_set - {"interval"})
        return [f"algorithm.rejection_sampling.{k} is read only with rejection_sampling.interval > 0" for k in set_]
    if not cfg.training.stage.traits.pairs and cfg.actor.n_samples_per_prompt < 2:
        return [
            "algorithm.rejection_sampling.interval > 0 keeps the best of each prompt's samples, but "
            "actor_rollout.n_samples_per_prompt is 1: set it to K >= 2"
        ]
    return []


def distill_problems(cfg: Config) -> list[str]:
    """On-policy distillation (``algorithm.distill``): the reference model is the teacher, so it must be named, the KL
    penalty to it is off, and the loss must take per-token advantages. What to change, one line each."""
    alg, d, problems = cfg.algorithm, cfg.algorithm.distill, []
    if "distill" in alg.model_fields_set and not cfg.training.stage.traits.group_advantages:
        return [
            f"algorithm.distill is used by the critic-free stages only ({', '.join(CRITIC_FREE)}), not "
            f"training.stage {cfg.training.stage}"
        ]
    if d.coef == 0:
        if "reward_coef" in d.model_fields_set:
            problems.append(
                "algorithm.distill.reward_coef is read only with algorithm.distill.coef > 0 (distillation on); set "
                "distill.coef or remove reward_coef"
            )
        return problems
    if cfg.actor_rollout_ref.ref.load is None:
        problems.append(
            "algorithm.distill.coef > 0 distils from the reference model, but actor_rollout_ref.ref.load is not set "
            "(the reference would be the student's own initial weights): set ref.load to the teacher"
        )
    k = alg.kl_ctrl
    if ("kl_coef" in k.model_fields_set and k.kl_coef > 0) or k.type == "adaptive":
        problems.append(
            f"algorithm.distill.coef > 0 makes the reference model the teacher, and algorithm.kl_ctrl (kl_coef "
            f"{k.kl_coef}, type {k.type}) would also penalise the KL to it: set kl_ctrl.kl_coef: 0 and type: fixed "
            "(the distillation advantage is that KL already), or distill.coef: 0"
        )
    if cfg.training.stage == Stage.RLOO and alg.rloo_convention == "trl":
        problems.append(
            "algorithm.distill needs per-token advantages, but ray_rloo with algorithm.rloo_convention trl trains one "
            "ratio and one advantage per sequence: set rloo_convention: openrlhf"
        )
    return problems


def reward_shaping_problems(cfg: Config) -> list[str]:
    """Fixed reward statistics, running statistics and the PPO reward baseline: what to change, one line each."""
    alg, problems = cfg.algorithm, []
    stats = alg.reward_norm_stats
    if stats is not None and alg.normalize_reward:
        problems.append(
            "algorithm.normalize_reward (running statistics of the RL-time scores) and algorithm.reward_norm_stats "
            "(fixed statistics) both normalise the scores; keep one of them"
        )
    if isinstance(stats, tuple) and not stats[1] > 0:
        problems.append(f"algorithm.reward_norm_stats {list(stats)} must be [mean, std] with std > 0")
    if stats == "reward_model":
        scorers = cfg.reward.scorers
        if len(scorers) != 1 or scorers[0].type != "model" or scorers[0].weight != 1.0:
            problems.append(
                "algorithm.reward_norm_stats reward_model reads the statistics of one reward model's scores, but the "
                "trained-on score is the weighted sum of reward.scorers, which is not one model scorer of weight 1; "
                "give the combined score's statistics as [mean, std]"
            )
    if alg.reward_baseline != "none" and cfg.training.stage == Stage.PPO and cfg.actor.n_samples_per_prompt < 2:
        problems.append(
            f"algorithm.reward_baseline {alg.reward_baseline} subtracts the scores of the prompt's other samples "
            "(y_ref, sampled from the current policy), but actor_rollout.n_samples_per_prompt is 1: set it to 2 or more"
        )
    return problems


# explicitly set fields a stage does not read: noted in the start-up warning (shared configs set them for every stage)
_NOT_READ_BY = {
    Stage.ONLINE_DPO: {
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
    Stage.PPO: {"algorithm": ("dpo_beta", "dpo_loss_type")},
    Stage.GRPO: {"algorithm": ("lam", "whiten_rewards", "score_position", "dpo_beta", "dpo_loss_type")},
    Stage.RLOO: {"algorithm": ("lam", "whiten_rewards", "score_position", "dpo_beta", "dpo_loss_type")},
    Stage.REINFORCE_PLUS_PLUS: {"algorithm": ("lam", "whiten_rewards", "score_position", "dpo_beta", "dpo_loss_type")},
}
for _stage in CRITIC_FREE:
    _NOT_READ_BY[_stage]["critic"] = tuple(CriticConfig.model_fields)
_NOT_READ_WHY = {
    Stage.ONLINE_DPO: "the DPO loss has no ratio clip, advantages, KL penalty or critic; its KL strength is "
    "algorithm.dpo_beta",
    Stage.PPO: "the DPO fields are read by ray_online_dpo only",
}
# A field's own reason, where the stage's would not say enough. Seed 004's online DPO sets kl_ctrl.kl_coef: its beta
# is not that, as in MindSpeed-LLM, whose online DPO loss reads only --dpo-beta.
_NOT_READ_FIELD_WHY = {
    (Stage.ONLINE_DPO, "kl_ctrl"): "the DPO loss has no KL penalty: its beta is algorithm.dpo_beta ({dpo_beta} here), "
    "as MindSpeed-LLM's online DPO takes beta from dpo_beta (default 0.1), never from kl_ctrl.kl_coef",
}


def stage_notes(cfg: Config) -> list[str]:
    stage, notes = cfg.training.stage, []
    sections = {"actor_rollout": cfg.actor, "algorithm": cfg.algorithm, "critic": cfg.critic}
    for section, names in _NOT_READ_BY.get(stage, {}).items():
        explicit = sections[section].model_fields_set
        for name in names:
            if name in explicit:
                why = _NOT_READ_WHY.get(stage, "a critic-free stage has no critic, GAE or DPO loss")
                if (stage, name) in _NOT_READ_FIELD_WHY:
                    why = _NOT_READ_FIELD_WHY[(stage, name)].format(dpo_beta=cfg.algorithm.dpo_beta)
                notes.append(
                    f"{'actor_rollout_ref.' if section == 'actor_rollout' else ''}{section}.{name}: "
                    f"not read by {stage} ({why})"
                )
    return notes


_BNB_FIELDS = ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype")


def _qlora_problems(a) -> list[str]:
    """``load_in_4bit``: a frozen base under LoRA adapters, pushed merged; its ``bnb_4bit_*`` options only with it."""
    if not a.load_in_4bit:
        stray = [f for f in _BNB_FIELDS if f in a.model_fields_set]
        return (
            [f"actor_rollout.{stray[0]} is read only with load_in_4bit: true; set it or remove the key"]
            if stray
            else []
        )
    out = []
    if not a.lora_r:
        out.append(
            "actor_rollout.load_in_4bit needs lora_r > 0: the 4-bit base is frozen and only LoRA adapters train "
            "(QLoRA); set lora_r, or remove load_in_4bit for full fine-tuning"
        )
    elif a.lora_sync == "adapter" or (a.lora_sync == "auto" and a.engine == "vllm"):
        out.append(
            "actor_rollout.load_in_4bit with an adapter-only push (lora_sync adapter, or auto with the vllm engine): "
            "the replica would pair the adapters with its own full-precision base, not the 4-bit one the trainer "
            "trains on; set lora_sync: merged (the dequantized base plus the adapters is pushed)"
        )
    return out


def lora_notes(cfg: Config) -> list[str]:
    """``lora_dropout`` above 0 is accepted (seed 001's LoraConfig sets 0.05) but off while training: said once at
    start-up, so nobody expects the regularisation."""
    a = cfg.actor
    if not (a.lora_r and a.lora_dropout > 0):
        return []
    return [
        f"actor_rollout_ref.actor_rollout.lora_dropout {a.lora_dropout}: recorded in the adapter's config, but off "
        "while training (p = 0), as TRL's RL trainers turn dropout off: the ratio and KL terms compare log-probs of "
        "two forward passes, which dropout would make differ"
    ]


# Keys of seed 001's layout that name something not built: refused with what to use instead, not as unknown keys.
_QUANT_KEYS = (
    "load_in_4bit",
    "load_in_8bit",
    "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant",
    "bnb_4bit_compute_dtype",
    "quantization_config",
)
_QUANT_WHY = (
    "4-bit / 8-bit (QLoRA, bitsandbytes) loading is not built for this model: only the trainer's actor loads in 4 "
    "bits (actor_rollout.load_in_4bit with bnb_4bit_quant_type / bnb_4bit_use_double_quant / bnb_4bit_compute_dtype, "
    "under actor_rollout.lora_r); 8-bit loading and a quantization_config mapping are not built; remove the key, and "
    "save memory with actor_rollout.lora_r, load_in_4bit, training.bf16 or a smaller model"
)
_CRITIC_LORA_WHY = (
    "the critic with LoRA is not built: the critic is a separate sequence-classification model trained in full "
    "(LoRA is the actor's only, actor_rollout.lora_r); remove the key, and save the critic's memory with "
    "critic.shared_backbone (seed 001's layout: a value head on the actor, sharing its LoRA adapters), a smaller "
    "critic.load (any sequence-classification model with the actor's tokenizer) or training.bf16"
)
_REWARD_ADAPTER_WHY = (
    "not built: TRL's reward_adapter (the reward model as a second LoRA adapter on the policy's own base, scored in "
    "the policy's process) has no counterpart here, because the reward service scores every sample before the "
    "trainer sees it and holds a model of its own, so an adapter on the trainer's base would need that base loaded "
    "a second time there anyway. Remove the key and score with a reward model folder: reward.scorers with type "
    "model and load (the adapter merged into its base and saved as a sequence-classification model)"
)
_ROLE_SECTIONS = ("training", "actor_rollout_ref.actor_rollout", "actor_rollout_ref.ref", "critic", "reward")


def not_built_message(key: str) -> str | None:
    """Why a dotted config ``key`` pydantic rejects as unknown names something not built, and what to use instead."""
    section, _, name = key.rpartition(".")
    if name == "reward_adapter":  # wherever a TRL user puts it: actor_rollout, reward, a scorer, the top level
        return _REWARD_ADAPTER_WHY
    if section in _ROLE_SECTIONS and name in _QUANT_KEYS:
        return _QUANT_WHY
    if section == "critic" and name in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
        return _CRITIC_LORA_WHY
    return None


# rollout fields only the vllm engine reads: set explicitly with engine hf they would be ignored, so they are errors
VLLM_ONLY_FIELDS = ("gpu_memory_utilization", "tensor_model_parallel_size", "enforce_eager", "staged_weight_swap")
# set to what the hf engine does anyway (it runs unsharded): not refused, so a MindSpeed config's TP 1 runs on hf
_HF_SAME = {"tensor_model_parallel_size": 1}


def check_rollout(cfg: Config) -> None:
    a = cfg.actor
    if a.engine == "hf":
        for name in VLLM_ONLY_FIELDS:
            if name in a.model_fields_set and _HF_SAME.get(name, object()) != getattr(a, name):
                raise ValueError(
                    f"actor_rollout_ref.actor_rollout.{name} is read by the vllm engine only; "
                    "remove it or set engine: vllm"
                )
    if a.partial_rollouts and a.lora_r and (a.lora_sync == "adapter" or (a.lora_sync == "auto" and a.engine == "vllm")):
        raise ValueError(
            "actor_rollout_ref.actor_rollout.partial_rollouts with an adapter-only push (lora_sync adapter, or auto "
            "with the vllm engine): an adapter push does not pause generation, so there is nothing to interrupt; "
            "set lora_sync: merged or remove partial_rollouts"
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


def check_algorithm(stage: Stage, alg: AlgorithmConfig) -> None:
    accepted = tuple(stage.traits.estimators)
    if alg.adv_estimator not in accepted:
        raise ValueError(
            f"algorithm.adv_estimator {alg.adv_estimator!r} does not apply to training.stage {stage}; "
            f"use one of {accepted}"
        )
    explicit = set(alg.model_fields_set)
    for name in sorted(explicit):
        stages = _ALGORITHM_FIELD_STAGES.get(name)
        if stages is not None and stage not in stages:
            raise ValueError(f"algorithm.{name} is not used by training.stage {stage} (only by {', '.join(stages)})")
    if stage == Stage.RLOO and alg.rloo_convention == "trl" and "loss_type" in explicit:
        raise ValueError(
            "algorithm.loss_type is not used by ray_rloo with rloo_convention trl (one ratio per sequence)"
        )
    defaults = dict(_STAGE_DEFAULTS.get(stage, {}))
    if alg.distill.coef > 0:  # the reference is the teacher: a KL penalty to it would pull twice (distill_problems)
        defaults["kl_coef"] = 0.0
    if stage == Stage.GRPO and alg.adv_estimator == "dr_grpo":  # Dr. GRPO = TRL's loss_type dr_grpo, scale_rewards none
        defaults.update(loss_type="dr_grpo", scale_rewards="none")
    if stage == Stage.RLOO and alg.rloo_convention == "openrlhf":
        defaults["loss_type"] = "bnpo"
    for name, value in defaults.items():
        if name == "kl_coef":
            if "kl_coef" not in alg.kl_ctrl.model_fields_set:
                alg.kl_ctrl.kl_coef = value
        elif name not in explicit:
            setattr(alg, name, value)


def mindspeed_default_notes(cfg: Config) -> list[str]:
    """Fields a MindSpeed-style config leaves out whose default here is not MindSpeed's. do_sample keeps its default
    true (every shipped config, the critic-free stages and the rollout service's REST defaults sample); a MindSpeed
    user who expects greedy rollouts from the omission is told instead."""
    out = []
    if "do_sample" not in cfg.actor.model_fields_set and cfg.training.stage == Stage.PPO:
        out.append(
            "actor_rollout_ref.actor_rollout.do_sample is not set: it defaults to true here (rollout samples at "
            "temperature), false in MindSpeed-LLM (greedy decoding); set it to choose and silence this line"
        )
    return out


# data.map_keys an evaluation does not read: the SFT texts, and per-row length caps (eval.max_new_tokens caps it)
EVAL_UNMAPPED = ("text", "history", "max_tokens")


def eval_problems(cfg: Config) -> list[str]:
    """The ``eval`` section: a path when it is on, greedy only with one sample, generator options only for
    generators, and no field set while evaluation is off (it would be accepted and ignored)."""
    e, out = cfg.eval, []
    if not e.interval:
        set_fields = sorted(e.model_fields_set - {"interval"})
        if set_fields:
            out.append(
                f"eval.{set_fields[0]} is set but eval.interval is {e.interval} (evaluation off): set eval.interval "
                "to evaluate every N steps, or remove the eval fields"
            )
        return out
    if not e.path:
        out.append(f"eval.path: required when eval.interval is set ({e.interval}); name the held-out prompts")
        return out
    for key in e.map_keys:
        if key not in DATA_MAP_KEYS or key in EVAL_UNMAPPED:
            usable = ", ".join(k for k in DATA_MAP_KEYS if k not in EVAL_UNMAPPED)
            out.append(f"eval.map_keys.{key}: not a key of the held-out prompts; use any of {usable}")
    if e.n > 1 and e.temperature == 0:
        out.append(f"eval.n is {e.n} but eval.temperature is 0 (greedy: {e.n} identical samples); set a temperature")
    if not e.path.startswith("reasoning_gym:"):
        for name in ("generator_size", "generator_seed", "generator_options"):
            if name in e.model_fields_set:
                out.append(f"eval.{name}: only used with eval.path: reasoning_gym:<task> ({e.path!r})")
    return out


def environment_problems(cfg: Config) -> list[str]:
    """The ``environment`` section: a name the registry knows, options its factory takes, and no field set without
    a name (single-turn: it would be accepted and ignored)."""
    env, out = cfg.environment, []
    if env.name is None:
        set_fields = sorted(env.model_fields_set - {"name"})
        if set_fields:
            out.append(
                f"environment.{set_fields[0]} is set but environment.name is null (single-turn samples): name the "
                "environment, or remove the environment fields"
            )
        return out

    try:
        check(env.name, env.options)
    except UnknownEnvironment as err:
        key = "environment.options" if str(err).startswith("options ") else "environment.name"
        out.append(f"{key}: {err}")
    a = cfg.actor
    budget = env.max_tokens
    if budget is not None and a.max_model_len is not None and a.max_model_len < a.max_prompt_length + budget:
        out.append(
            f"environment.max_tokens {env.max_tokens} does not fit actor_rollout.max_model_len {a.max_model_len} "
            f"after max_prompt_length {a.max_prompt_length}; lower it or raise max_model_len"
        )
    return out
