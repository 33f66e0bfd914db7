"""The experiment config's sections (``training``, ``actor_rollout_ref``, ``critic``, ``reward``, ``algorithm``,
``resource_pool``, ``data``): every field with its default, bounds and description. :mod:`rlhf.config` puts them
together into :class:`~rlhf.config.ExperimentConfig` and loads files; import from there."""

from __future__ import annotations

import re
import string
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlhf.stages import Stage
from rlhf.tool_calls import TOOL_CALL_PARSERS


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the offending key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _f(default: Any, description: str, **kw: Any) -> Any:
    return Field(default, description=description, **kw)


class TrainingConfig(Section):
    stage: Stage = _f(Stage.PPO, "training algorithm: ray_ppo, ray_online_dpo, ray_grpo, ray_rloo, ...")
    global_batch_size: int = _f(
        8, "prompts per training step (the rollout batch; each gives n_samples_per_prompt samples)", gt=0
    )
    seq_length: int = _f(
        1024,
        "maximum prompt + response length in tokens (the default of actor_rollout.seq_length)",
        gt=1,
    )
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
    no_load_optim: bool = _f(
        False,
        "on resume, restore the weights but start the optimizers (AdamW moments) afresh; the default of the actor's "
        "and the critic's own no_load_optim",
    )
    no_load_rng: bool = _f(
        False,
        "on resume, do not restore the trainer's random-number generators (reseeded from seed); the default of the "
        "actor's and the critic's own no_load_rng",
    )
    bf16: bool = _f(
        False,
        "bf16 autocast compute over fp32 master weights and AdamW state; weights pushed to rollout as bf16; the "
        "default of every role's own bf16 (actor_rollout, ref, critic, reward)",
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
    max_new_tokens: int | None = _f(
        None, "response budget in tokens; default actor_rollout.seq_length - max_prompt_length", gt=0
    )
    # MindSpeed's role sections take any training key; these four are read per role (null: training's value)
    seq_length: int | None = _f(
        None, "the actor's prompt + response length: the response budget's default (default training.seq_length)", gt=1
    )
    bf16: bool | None = _f(None, "the actor's bf16 autocast and the bf16 push to rollout (default training.bf16)")
    no_load_optim: bool | None = _f(
        None, "on resume, start the actor's AdamW moments afresh (default training.no_load_optim)"
    )
    no_load_rng: bool | None = _f(
        None,
        "on resume, do not restore the trainer's generators, which the actor draws from (default "
        "training.no_load_rng; under ray_ppo the critic's must agree: they share them)",
    )
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
    partial_rollouts: bool = _f(
        False,
        "a weight push stops the requests in flight at the next token (vllm: aborts them) and resumes them from "
        "prompt + tokens so far under the new weights (records carry version spans), instead of waiting for them to "
        "finish; vllm: requests with frequency or presence penalties still finish first",
    )
    stop: list[str] = _f([], "stop strings for generation")
    apply_chat_template: bool = _f(True, "wrap prompts in the tokenizer's chat template when it has one")
    tool_call_parser: Literal[TOOL_CALL_PARSERS] = _f(
        "hermes",
        "how /v1/chat/completions with tools reads tool calls in the model's text (vLLM's --tool-call-parser "
        "names): hermes = <tool_call>{json}</tool_call> blocks (Hermes, Qwen2.5)",
    )
    lr: float | None = _f(None, "actor learning rate (overrides training.lr)")
    # LoRA (seed 001's peft LoraConfig: r, lora_alpha, lora_dropout, target_modules)
    lora_r: int = _f(0, "LoRA rank of the actor's adapters (0: full fine-tuning); see lora_sync", ge=0)
    lora_alpha: float = _f(16.0, "LoRA alpha: the adapter's update is scaled by alpha / r", gt=0)
    lora_dropout: float = _f(
        0.0,
        "LoRA dropout, recorded in the adapter's config; off while training (p = 0), as in TRL's RL trainers: the "
        "losses compare log-probs of two forward passes, which dropout would make differ (a start-up note says so)",
        ge=0,
        lt=1,
    )
    lora_target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "names of the actor's linear modules that get adapters",
    )
    lora_sync: Literal["auto", "adapter", "merged"] = _f(
        "auto",
        "what a LoRA actor's push sends: adapter = the adapter tensors only, served by vLLM as a versioned LoRA "
        "adapter; merged = the whole model with the adapters merged in; auto = adapter with the vllm engine, merged "
        "with hf",
    )
    # QLoRA (seed 001's BitsAndBytesConfig): the trainer's frozen actor base in 4 bits under the LoRA adapters
    load_in_4bit: bool = _f(
        False,
        "QLoRA: the trainer loads the actor's frozen base in 4 bits (bitsandbytes, the qlora extra) under the lora_r "
        "adapters; pushes carry the dequantized base plus the adapters (lora_sync merged), so the replicas sample "
        "from the weights the trainer trains",
    )
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = _f(
        "nf4", "load_in_4bit: the 4-bit data type (nf4, QLoRA's NormalFloat, as seed 001; or fp4)"
    )
    bnb_4bit_use_double_quant: bool = _f(
        False,
        "load_in_4bit: quantize the quantization constants too (QLoRA's double quantization, ~0.4 bit/weight less)",
    )
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "load_in_4bit: the dtype the 4-bit weights are dequantized to for each matmul"
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
    seq_length: int | None = _f(
        None,
        "the longest prompt + response the reference service takes, at least the actor's samples (null: the "
        "model's context)",
        gt=1,
    )
    bf16: bool | None = _f(
        None, "the reference model serves in bf16 on an accelerator (default training.bf16; fp32 on the CPU)"
    )


class ActorRolloutRefConfig(Section):
    actor_rollout: ActorRolloutConfig = _f(ActorRolloutConfig(), "actor and rollout")
    ref: RefConfig = _f(RefConfig(), "reference policy")


class CriticConfig(Section):
    load: str | None = _f(None, "critic initialisation: a sequence-classification model (default the reward model)")
    shared_backbone: bool = _f(
        False,
        "seed 001's layout: no separate critic; a value head on the actor's own backbone (TRL's "
        "AutoModelForCausalLMWithValueHead; with LoRA, policy and value share the adapters). The value loss (x "
        "vf_coef) joins the actor's loss on the actor's minibatches and epochs, so it trains the shared backbone; the "
        "head steps with the critic's optimizer settings. ray_ppo, one trainer process",
    )
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
    seq_length: int | None = _f(
        None,
        "the longest prompt + response the critic takes: checked at load to cover the actor's samples (null: the "
        "model's context)",
        gt=1,
    )
    bf16: bool | None = _f(None, "the critic's bf16 autocast (default training.bf16)")
    no_load_optim: bool | None = _f(
        None, "on resume, start the critic's AdamW moments afresh (default training.no_load_optim)"
    )
    no_load_rng: bool | None = _f(
        None,
        "on resume, do not restore the trainer's generators (default training.no_load_rng); the critic's minibatch "
        "order draws from the actor's, so it must agree with actor_rollout.no_load_rng",
    )


JUDGE_TEMPLATE_FIELDS = ("prompt", "response", "label")


def template_fields(template: str) -> list[str]:
    """The replacement fields of a str.format ``template`` as written ("" for ``{}``); ValueError if malformed."""
    return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]


def _template_problem(template: str) -> str | None:
    """Why ``template`` is not a str.format template over :data:`JUDGE_TEMPLATE_FIELDS` only, or None. Plain names
    only: ``{prompt.x}`` or ``{prompt[0]}`` would reach into attributes at scoring time."""
    try:
        fields = template_fields(template)
    except ValueError as err:
        return f"is not a str.format template ({err}); write a literal brace as {{{{ or }}}}"
    for f in fields:
        if f not in JUDGE_TEMPLATE_FIELDS:
            shown = "{" + f + "}" if f else "{}"
            return (
                f"uses {shown}, which is not a field: use {{prompt}}, {{response}} and {{label}} only (write a literal "
                "brace as {{ or }})"
            )
    return None


class JudgeConfig(Section):
    base_url: str | None = _f(
        None,
        "the OpenAI-compatible server (http://host:port; a trailing /v1 is allowed); the judge posts to "
        "{base_url}/v1/chat/completions",
    )
    model: str | None = _f(None, "the model name sent in each request (null: left out, for servers of one model)")
    api_key_env: str | None = _f(
        None,
        "name of the environment variable holding the API key (sent as a Bearer token); the key never goes in "
        "the config",
    )
    template: str | None = _f(
        None, "the user message: a str.format template with the fields {prompt}, {response} and {label}"
    )
    system: str | None = _f(None, "a system message sent before the user message, as written (no fields)")
    temperature: float = _f(0.0, "sampling temperature of the judge (0: greedy, the same verdict every time)", ge=0)
    max_tokens: int = _f(16, "the judge's reply length limit in tokens", gt=0)
    concurrency: int = _f(16, "requests in flight to the judge at most, over all reward requests", gt=0)
    parser: Literal["numeric", "yes_no", "choice"] = _f(
        "yes_no",
        "how the reply becomes a score: numeric (a number in it), yes_no (yes: 1, no: 0) or choice (choices' score)",
    )
    pattern: str | None = _f(
        None,
        "a regular expression searched in the reply; its first group (else the whole match) is the verdict. Default: "
        "numeric, the first number; yes_no and choice, the first word(s) of the reply",
    )
    range: tuple[float, float] | None = _f(
        None, "numeric: [low, high], the judge's scale; a number outside it is an error status, not clipped"
    )
    normalize: bool = _f(False, "numeric: map range [low, high] onto [0, 1]")
    choices: dict[str, float] | None = _f(None, "choice: each verdict (matched case-insensitively) and its score")
    extra_body: dict[str, Any] = _f({}, "more fields for each request body (e.g. seed, or a server's own options)")

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        # each message names the key, so a config error points at the line to change
        # (base_url and template are required by ScorerConfig for type judge: the default section has neither)
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge.base_url {self.base_url!r} must start with http:// or https://")
        problem = _template_problem(self.template) if self.template is not None else None
        if problem:
            raise ValueError(f"judge.template {problem}")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(f"judge.pattern is not a regular expression: {err}") from None
        if self.parser == "choice":
            if not self.choices:
                raise ValueError("judge.choices is required with parser choice: a map of verdict -> score")
            folded = [k.strip().casefold() for k in self.choices]
            if "" in folded or len(set(folded)) != len(folded):
                raise ValueError("judge.choices needs non-empty verdicts that differ ignoring case")
        elif self.choices is not None:
            raise ValueError(f"judge.choices is read by parser choice only, not {self.parser}")
        if self.parser != "numeric" and (self.range is not None or self.normalize):
            raise ValueError(f"judge.range and judge.normalize are read by parser numeric only, not {self.parser}")
        if self.range is not None and not self.range[0] < self.range[1]:
            raise ValueError(f"judge.range {list(self.range)} must be [low, high] with low < high")
        if self.normalize and self.range is None:
            raise ValueError("judge.normalize needs judge.range: the [low, high] to map onto [0, 1]")
        if "messages" in self.extra_body or "stream" in self.extra_body:
            raise ValueError("judge.extra_body cannot set messages or stream: the judge builds them")
        return self


class ScorerConfig(Section):
    type: Literal["model", "rule", "remote", "judge"] = _f(
        "rule", "model: reward model; rule: a Python function; remote: HTTP; judge: an LLM asked over a chat API"
    )
    name: str | None = _f(
        None,
        "rule name from the registry, or module:function for a user function (imported from the working directory)",
    )
    load: str | None = _f(None, "reward model directory (type model), or tiny:reward")
    url: str | None = _f(None, "remote scorer URL speaking OpenRLHF's /get_reward format (type remote)")
    judge: JudgeConfig = _f(JudgeConfig(), "type judge: the chat endpoint, template and verdict parser")
    weight: float = _f(1.0, "weight of this scorer in the combined reward")
    timeout_s: float = _f(30.0, "per-call timeout (remote, judge)", gt=0)
    retries: int = _f(2, "retries after a failed call (remote, judge: timeouts, HTTP 5xx and 429)", ge=0)
    kwargs: dict[str, Any] = _f({}, "extra keyword arguments for a rule function")

    @model_validator(mode="after")
    def _check(self) -> ScorerConfig:
        if self.type == "judge":
            for key, what in (("base_url", "the OpenAI-compatible server to ask"), ("template", "the user message")):
                if not getattr(self.judge, key):
                    raise ValueError(f"a scorer of type 'judge' needs judge.{key}: {what}")
        else:
            needed = {"model": "load", "rule": "name", "remote": "url"}[self.type]
            if getattr(self, needed) is None:
                raise ValueError(f"a scorer of type {self.type!r} needs '{needed}'")
            if self.judge != JudgeConfig():  # (compared by value: a dumped and reloaded config carries the default)
                raise ValueError(f"'judge' is read by scorers of type judge only, not {self.type!r}")
        return self


class RewardConfig(Section):
    scorers: list[ScorerConfig] = _f([ScorerConfig(type="model", load="tiny:reward")], "scorers, combined by weight")
    micro_batch_size: int = _f(
        16, "sequences per reward-model forward (default training.micro_batch_size, else 16)", gt=0
    )
    load: str | None = _f(None, "shorthand for one model scorer (MindSpeed's reward.load)")
    seq_length: int | None = _f(
        None,
        "the longest prompt + response (in the policy's tokens) the reward service scores, at least the actor's "
        "samples (null: the models' context)",
        gt=1,
    )
    bf16: bool | None = _f(
        None, "the reward models serve in bf16 on an accelerator (default training.bf16; fp32 on the CPU)"
    )
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


class DistillConfig(Section):
    coef: float = _f(
        0.0,
        "on-policy distillation (critic-free stages): each sampled token's advantage gets coef x (teacher log-prob - "
        "student log-prob), the teacher being the reference model (actor_rollout_ref.ref.load), i.e. the per-token "
        "reverse KL to the teacher as a negative reward; 0: off",
        ge=0,
    )
    reward_coef: float = _f(
        0.0,
        "with distill.coef > 0: weight of the stage's own task advantage (from the reward scores) added to the "
        "distillation advantage; 0: pure distillation",
        ge=0,
    )


class RejectionSamplingConfig(Section):
    interval: int = _f(
        0,
        "rejection-sampling fine-tuning (seed 002, Llama 2's): every interval-th step (the first included) trains by "
        "SFT on the best-scored sample of each prompt's group instead of the stage's RL update; 2 alternates them; "
        "0: off",
        ge=0,
    )
    min_score: float | None = _f(None, "keep a prompt's best sample only when its score is at least this")
    epochs: int = _f(1, "passes of SFT over the kept samples in one rejection-sampling step", gt=0)


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
    reward_norm_stats: tuple[float, float] | Literal["reward_model"] | None = _f(
        None,
        "scores become (score - mean) / std with fixed statistics: [mean, std], or reward_model to read 'mean' and "
        "'std' from the reward model's config.json (where OpenRLHF's reward-model training writes its training-set "
        "statistics); exclusive with normalize_reward (running statistics); null: no fixed normalisation",
    )
    reward_baseline: Literal["none", "leave_one_out", "group_mean"] = _f(
        "none",
        "ray_ppo: subtract a baseline from each score before the KL penalty (seed 002's r(x, y) - r(x, y_ref), "
        "y_ref sampled from the current policy for the same prompt): leave_one_out, the mean score of the prompt's "
        "other samples (n_samples_per_prompt 2: exactly the other sample's); group_mean, of all its samples; needs "
        "n_samples_per_prompt >= 2; a prompt left with one scored sample gets 0",
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
    distill: DistillConfig = _f(
        DistillConfig(), "on-policy distillation from the reference model as teacher (critic-free stages)"
    )
    rejection_sampling: RejectionSamplingConfig = _f(
        RejectionSamplingConfig(), "best of K by reward, then SFT on it, alternating with the RL update"
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
        "[0]: the critic shares the trainer's devices; [1]: the critic has a device of its own, the one after the "
        "trainer's (still in the trainer process: its values move to the actor's device). On the CPU both are the CPU",
    )
    reward: list[int] = _f([1], "devices for the reward service")


# data.map_keys: our key -> what it reads (MindSpeed-LLM's --map-keys for an Alpaca-style file)
DATA_MAP_KEYS = {
    "prompt": "the instruction column (required)",
    "query": "the input column, appended to the prompt after a newline (Alpaca instruction + input)",
    "system": "a per-row system prompt column (empty cells fall back to data.system)",
    "label": "the reference-answer column, sent to the reward scorers as the item's label",
    "response": "the reference response column: the label when the row has no label column (MindSpeed's R1 labels)",
    "text": "the pretrain_data text column",
    "max_tokens": "a per-row cap on new tokens (1 to actor_rollout.max_new_tokens): its prompt job's max_tokens "
    "(a length-controlled workload, e.g. bench.long_tail's long tail)",
}


class DataConfig(Section):
    path: str = _f(
        "builtin:arithmetic",
        "prompt data set: a .jsonl, .json (a list of records) or .parquet file; a Megatron indexed data set (the "
        ".bin/.idx prefix MindSpeed-LLM's preprocess_data.py writes, e.g. seed 004's data_path: token ids, used as "
        "they are); reasoning_gym:<task> (a reasoning-gym procedural generator, see generator_*); or "
        "builtin:arithmetic",
    )
    map_keys: dict[str, str] = _f(
        {"prompt": "prompt", "label": "label", "text": "text"},
        "our key -> column in the file: prompt, query (joined to prompt with a newline, as MindSpeed's "
        "PPOAlpacaStyleInstructionHandler does), system (per-row system prompt), label, response (the label when "
        "there is no label column), text (the pretrain_data column), max_tokens (a per-row cap on new tokens, 1 to "
        "actor_rollout.max_new_tokens: its prompt job's max_tokens); an empty column name means not used",
    )
    pretrain_data: str | None = _f(
        None, "PPO-ptx SFT texts (.jsonl, .json or .parquet, column map_keys.text), used when ptx_coef > 0"
    )
    system: str | None = _f(None, "system message prepended when the chat template is applied")
    shuffle: bool = _f(True, "shuffle the prompt order each epoch")
    max_samples: int | None = _f(None, "use only the first N prompts", gt=0)
    generator_size: int = _f(
        1000, "reasoning_gym:<task> only: how many prompts the generator makes (one epoch)", gt=0, le=1_000_000
    )
    generator_seed: int = _f(0, "reasoning_gym:<task> only: the generator's seed (the same seed, the same prompts)")
    generator_options: dict[str, Any] = _f(
        {},
        "reasoning_gym:<task> only: the task's own options (its config dataclass fields, e.g. min_terms, "
        "max_terms for chain_sum); an unknown option is an error",
    )

    @model_validator(mode="after")
    def _check_data(self) -> DataConfig:
        for key, column in self.map_keys.items():
            if key == "history":
                raise ValueError(
                    "data.map_keys.history: multi-turn history rows are not supported; flatten them into the prompt"
                )
            if key not in DATA_MAP_KEYS:
                raise ValueError(f"data.map_keys.{key}: unknown key; use any of {', '.join(DATA_MAP_KEYS)}")
            if key == "prompt" and not column:
                raise ValueError("data.map_keys.prompt: must name a column")
        generator = self.path.startswith("reasoning_gym:")
        if generator and not self.path.split(":", 1)[1]:
            raise ValueError("data.path: reasoning_gym:<task> needs a task name, e.g. reasoning_gym:chain_sum")
        if not generator:
            for name in ("generator_size", "generator_seed", "generator_options"):
                if name in self.model_fields_set:
                    raise ValueError(f"data.{name}: only used with data.path: reasoning_gym:<task> ({self.path!r})")
        return self


class EvalConfig(Section):
    interval: int | None = _f(
        0,
        "evaluate every N training steps and once more at the end of training (0 or null: no evaluation); the "
        "held-out prompts go straight to a rollout replica and the reward service, never into the experience stream",
        ge=0,
    )
    before_training: bool = _f(
        False, "also evaluate the initial weights before the first step (reported as step 0; not again on --resume)"
    )
    path: str | None = _f(
        None, "held-out prompts: any data.path source (a file, an indexed prefix, reasoning_gym:<task>, builtin:...)"
    )
    map_keys: dict[str, str] = _f(
        {"prompt": "prompt", "label": "label"},
        "our key -> column of eval.path, as data.map_keys (prompt, query, system, label, response)",
    )
    system: str | None = _f(None, "system message prepended when the chat template is applied; default data.system")
    max_samples: int | None = _f(None, "evaluate only the first N prompts", gt=0)
    generator_size: int = _f(64, "reasoning_gym:<task> only: how many prompts the generator makes", gt=0, le=100_000)
    generator_seed: int = _f(
        1, "reasoning_gym:<task> only: the generator's seed (keep it apart from data.generator_seed: held-out prompts)"
    )
    generator_options: dict[str, Any] = _f({}, "reasoning_gym:<task> only: the task's own options, as data's")
    n: int = _f(1, "samples per prompt; pass@k is reported with k = n", gt=0, le=64)
    temperature: float = _f(0.0, "sampling temperature (0: greedy, which needs n = 1)", ge=0)
    max_new_tokens: int | None = _f(None, "response budget in tokens; default the rollout's", gt=0)
    pass_threshold: float = _f(
        1.0, "a sample passes when its reward >= this; pass@k = share of prompts with at least one passing sample"
    )
    timeout_s: float = _f(600.0, "deadline of one evaluation's generate / score calls", gt=0)

    def data_config(self, data: DataConfig) -> DataConfig:
        """The section as a DataConfig, so the data loader reads eval.path as it reads data.path."""
        gen = {k: getattr(self, k) for k in ("generator_size", "generator_seed", "generator_options")}
        fields = {
            "path": self.path,
            "map_keys": self.map_keys,
            "system": self.system if self.system is not None else data.system,
            "max_samples": self.max_samples,
            "shuffle": False,
        }
        if self.path and self.path.startswith("reasoning_gym:"):
            fields.update(gen)
        return DataConfig(**fields)


class TrainingServiceConfig(Section):
    """The training service (the tinker SDK's API, docs/tinker.md) under ``rlhf up``. The Helm chart has its own switch
    (``training.enabled``; it refuses a config with this one on while its own is off), docker compose its profile
    (``--profile training``)."""

    enabled: bool = _f(
        False,
        "rlhf up also starts `rlhf serve training` for the run's lifetime and prints its address; it needs "
        "RLHF_TRAINING_TOKENS or RLHF_API_TOKEN (the keys the SDK sends, starting with tml-)",
    )


class EnvironmentConfig(Section):
    """Multi-turn episodes: the rollout replica alternates model turns with an environment service's steps (one
    environment instance per episode, rlhf.environments). Without a name every sample is one response, as before."""

    name: str | None = _f(
        None,
        "the environment of every episode: builtin:calculator, python:<module>:<factory> (your own Environment), or a "
        "name an adapter registers (rlhf.environments.registry); null: single-turn samples scored by reward only",
    )
    options: dict[str, Any] = _f({}, "keyword arguments of the environment's factory (one instance per episode)")
    max_turns: int = _f(4, "model turns per episode at most", gt=0)
    max_tokens: int | None = _f(
        None,
        "the episode's token budget after the prompt (model and environment tokens together); default max_turns x "
        "the response budget of one turn (actor_rollout.max_new_tokens)",
        gt=0,
    )
    timeout_s: float = _f(
        30.0, "seconds one reset or step of the environment may take; a slower one fails the sample (timeout)", gt=0
    )
    replicas: int = _f(1, "environment service processes under rlhf up (rollout replica i uses i mod replicas)", gt=0)
    episode_ttl_s: float = _f(600.0, "the service closes an episode left without a call this long", gt=0)
    max_episodes: int = _f(
        4096, "open episodes per environment service process; a reset beyond them is refused until some close", gt=0
    )
