"""TRL 1.12 side of the learning comparison: what our ring trains from a ``configs/learn-*.yaml``, trained by TRL.

``PYTHONPATH=. .venv-parity/bin/python -m bench._trl_learning --config configs/learn-reverse-words.yaml --algo grpo
[--seed 1] [--steps N] [--threads 2] [--set KEY=VALUE ...] --out FILE.json``: the same warm-started policy, prompts in
our ring's order, chat template, reward rule and hyperparameters (``_optim``, ``_grpo``, ``_rloo``, ``_online_dpo``:
TRL argument <- our field), and our ``eval`` section's pass@1 on the held-out prompts along the way (``HeldOut``).
A step is ours: one batch of ``global_batch_size`` prompts, as many TRL optimizer steps as our trainer takes on it.
Seconds are training time only (model loading and evaluation left out). The result is one JSON line on stdout (library
output goes to stderr), also written to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl.data_utils import maybe_apply_chat_template
from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

from bench.converge import ALGOS  # the overrides that make a learn-*.yaml (GRPO) run another algorithm, as ours
from rlhf.config import load_config, read_config_data
from rlhf.data import PromptCursor, load_eval_prompts, load_prompts, record_prompt_ids
from rlhf.evaluation import eval_metrics
from rlhf.models import resolve_model_path
from services.reward.rules import RULES, prepare_kwargs
from services.trainer.optim import actor_optim

STAGES = {"grpo": "ray_grpo", "rloo": "ray_rloo", "online_dpo": "ray_online_dpo"}
# fp32 on the CPU; nothing saved, reported or drawn as progress bars
CPU_ARGS = {
    "bf16": False,
    "fp16": False,
    "use_cpu": True,
    "gradient_checkpointing": False,
    "report_to": "none",
    "save_strategy": "no",
    "logging_steps": 1,
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
}


@dataclass(frozen=True)
class Plan:
    """How one of our steps maps onto TRL: its optimizer steps and the completions it generates."""

    updates_per_step: int  # optimizer steps per step, ours and TRL's
    samples_per_step: int  # completions per step (prompts x generations)
    minibatches: int  # minibatches per epoch (GRPO/RLOO: steps_per_generation)
    per_device: int  # per_device_train_batch_size: samples (GRPO/RLOO) or prompts (online DPO) per optimizer step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--algo", choices=sorted(STAGES), default="grpo")
    p.add_argument("--seed", type=int, default=None, help="training.seed (default: the config's)")
    p.add_argument("--steps", type=int, default=None, help="training.train_iters (default: the config's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, as ours")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def load(args):
    """The experiment config as our ring would run it for ``--algo``, and the overrides that made it."""
    overrides = []
    if (read_config_data(args.config).get("training") or {}).get("stage") != STAGES[args.algo]:
        overrides = list(ALGOS[args.algo])
    overrides += [f"training.seed={args.seed}"] if args.seed is not None else []
    overrides += [f"training.train_iters={args.steps}"] if args.steps is not None else []
    overrides += list(args.set)
    return load_config(args.config, overrides), overrides


def plan_steps(algo: str, cfg) -> Plan:
    a, global_batch = cfg.actor, cfg.training.global_batch_size
    if algo == "online_dpo":  # ours: minibatches of ppo_mini_batch_size / 2 pairs, one optimizer step each
        pairs = max(1, a.ppo_mini_batch_size // 2)
        per_device = min(pairs, global_batch)
        if global_batch % per_device:
            raise SystemExit(f"global_batch_size {global_batch} is no multiple of {per_device} pairs per minibatch")
        return Plan(global_batch // per_device, 2 * global_batch, global_batch // per_device, per_device)
    samples = global_batch * a.n_samples_per_prompt
    if samples % a.ppo_mini_batch_size:
        raise SystemExit(f"{samples} samples per step do not split into minibatches of {a.ppo_mini_batch_size}")
    n_minibatches = samples // a.ppo_mini_batch_size
    return Plan(n_minibatches * a.ppo_epochs, samples, n_minibatches, a.ppo_mini_batch_size)


def reward_rule(cfg):
    """``score(prompt, response, label)``: the reward service's weighted sum of the rule scorers; None when a rule
    fails (our reward service's error status)."""
    scorers = cfg.reward.scorers
    if not scorers or any(s.type != "rule" or s.name not in RULES for s in scorers):
        raise SystemExit("only built-in rule scorers (reward.scorers[*].type: rule) are mapped to TRL reward functions")
    rules = [(s.weight, RULES[s.name], prepare_kwargs(s.name, dict(s.kwargs))) for s in scorers]

    def score(prompt: str, response: str, label: str | None) -> float | None:
        try:
            return sum(w * float(fn(prompt, response, label, **kw)) for w, fn, kw in rules)
        except Exception:  # noqa: BLE001 - a rule's failure leaves the item unscored, as in the reward service
            return None

    return score


def rule_reward(score, log: list):
    """The TRL reward function: the rule on the decoded completion (special tokens skipped); every reward is logged."""

    def rule_reward(prompts, completions, label, prompt_text, **kwargs):
        out = []
        for text, completion, gold in zip(prompt_text, completions, label, strict=True):
            response = completion[-1]["content"] if isinstance(completion, list) else completion
            out.append(score(text, response, gold))
        log.extend(out)
        return out

    return rule_reward


def train_records(cfg, n: int):
    """The first ``n`` prompts our trainer publishes: data.path walked by ``PromptCursor`` (training.seed,
    data.shuffle); step k's batch is records [k G, (k + 1) G)."""
    cursor = PromptCursor(load_prompts(cfg.data), cfg.training.seed, cfg.data.shuffle)
    return [cursor.next()[1] for _ in range(n)]


def conversation(record) -> list[dict]:
    system = [{"role": "system", "content": record.system}] if record.system else []
    return system + [{"role": "user", "content": record.prompt}]


def cut_at_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


class HeldOut:
    """Our ``eval`` section on the policy in TRL's hands: ``eval.n`` completions per held-out prompt (the same prompt
    ids as ours) at ``eval.temperature`` (0: greedy), scored by the same rule; ``rlhf.evaluation.eval_metrics`` gives
    pass@1 (with n > 1 the unbiased estimate, and pass@n) and the reward mean."""

    def __init__(self, cfg, tok, score):
        e, a = cfg.eval, cfg.actor
        if not e.interval:
            raise SystemExit("set eval.interval: the comparison is the held-out curve")
        self.records = load_eval_prompts(cfg)
        self.ids = [record_prompt_ids(tok, r, a.max_prompt_length, a.apply_chat_template) for r in self.records]
        d = cfg.sampling_defaults()
        sampled = {"do_sample": True, "temperature": e.temperature, "top_p": d["top_p"], "top_k": max(d["top_k"], 0)}
        self.gen = GenerationConfig(
            **(sampled if e.temperature else {"do_sample": False}),
            num_return_sequences=e.n,
            max_new_tokens=e.max_new_tokens or cfg.max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        self.n, self.seed, self.threshold, self.tok, self.score = e.n, cfg.training.seed, e.pass_threshold, tok, score

    @torch.no_grad()
    def completions(self, model, step: int) -> list[list[int]]:
        """Prompt i's samples at rows i n .. i n + n - 1 of one left-padded batch, each through its first EOS; the
        sampling seeded by the step and the training RNG left as it was."""
        tok, width = self.tok, max(map(len, self.ids))
        x = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in self.ids], device=model.device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in self.ids], device=model.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + step)
            out = model.generate(input_ids=x, attention_mask=mask, generation_config=self.gen)[:, width:]
        return [cut_at_eos(row, tok.eos_token_id) for row in out.tolist()]

    def __call__(self, model, step: int = 0) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            ids = self.completions(model, step)
        finally:
            model.train(was_training)
        n, texts = self.n, self.tok.batch_decode(ids, skip_special_tokens=True)
        rows = [range(i * n, (i + 1) * n) for i in range(len(self.records))]  # prompt i's samples
        rewards = [[self.score(r.prompt, texts[j], r.label) for j in rows[i]] for i, r in enumerate(self.records)]
        m = eval_metrics(rewards, [[len(ids[j]) for j in js] for js in rows], self.threshold)
        out = {"pass@1": m["eval/pass@1"], "reward_mean": m["eval/reward_mean"]}
        return out | ({f"pass@{n}": m[f"eval/pass@{n}"]} if n > 1 else {})


class Curve(TrainerCallback):
    """Held-out points at step 0 (eval.before_training), every eval.interval steps and at the last step; wall time
    from on_train_begin less the time spent evaluating."""

    def __init__(self, result: dict, evaluate: HeldOut, plan: Plan, cfg):
        self.result, self.evaluate, self.plan = result, evaluate, plan
        self.total, self.interval, self.before = cfg.training.train_iters, cfg.eval.interval, cfg.eval.before_training
        self.t0, self.eval_seconds = 0.0, 0.0

    def training_seconds(self) -> float:
        return time.perf_counter() - self.t0 - self.eval_seconds

    def point(self, step: int, model) -> None:
        seconds = self.training_seconds()
        start = time.perf_counter()
        metrics = self.evaluate(model, step)
        self.eval_seconds += time.perf_counter() - start
        samples = step * self.plan.samples_per_step
        self.result["curve"].append({"step": step, "samples": samples, "seconds": round(seconds, 3), **metrics})
        print(f"[trl_learning] {self.result['curve'][-1]}", file=sys.stderr, flush=True)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.t0 = time.perf_counter()
        if self.before:
            self.point(0, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.plan.updates_per_step == 0:
            step = state.global_step // self.plan.updates_per_step
            if step % self.interval == 0 or step >= self.total:
                self.point(step, model)

    def on_train_end(self, args, state, control, **kwargs):
        self.result["seconds_total"] = round(self.training_seconds(), 3)
        self.result["eval_seconds_total"] = round(self.eval_seconds, 3)


def _schedule(o) -> tuple[str, list[str]]:
    """HF's lr_scheduler_type for our actor schedule, and what does not carry over."""
    name = {"constant": "constant", "linear": "linear", "cosine": "cosine"}[o.decay_style]
    if name == "constant" and o.warmup_fraction:
        name = "constant_with_warmup"
    notes = []
    if o.decay_style != "constant":
        notes.append("lr schedule: ours sets the rate once per step, HF's per optimizer step")
        if o.min_lr:
            notes.append(f"min_lr {o.min_lr} not mapped: HF's {name} schedule decays to 0")
    return name, notes


def _optim(cfg, plan: Plan) -> tuple[list[tuple], list[str]]:
    """(TRL argument, value, our field) of the optimizer, schedule and run length, and what does not map."""
    o = actor_optim(cfg)  # actor_rollout.* where set, else training.*
    max_steps = cfg.training.train_iters * plan.updates_per_step
    schedule, notes = _schedule(o)
    return [
        ("learning_rate", o.lr, "training.lr"),
        ("lr_scheduler_type", schedule, "training.lr_decay_style"),
        ("warmup_steps", round(o.warmup_fraction * max_steps), "training.lr_warmup_fraction x max_steps"),
        ("weight_decay", o.weight_decay, "training.weight_decay"),
        ("adam_beta1", o.betas[0], "training.adam_beta1"),
        ("adam_beta2", o.betas[1], "training.adam_beta2"),
        ("adam_epsilon", 1e-8, "(torch AdamW's default eps, ours)"),
        ("max_grad_norm", max(o.clip_grad, 0.0), "training.clip_grad"),
        ("seed", cfg.training.seed, "training.seed"),
        ("max_steps", max_steps, "training.train_iters x optimizer steps per step"),
        ("gradient_accumulation_steps", 1, "(each minibatch is one optimizer step)"),
    ], notes


def _sampling(cfg) -> list[tuple]:
    a = cfg.actor
    return [
        ("temperature", cfg.sample_temperature, "actor_rollout.temperature"),
        ("top_p", a.top_p, "actor_rollout.top_p"),
        ("top_k", max(a.top_k, 0), "actor_rollout.top_k (-1: off = TRL's 0)"),
    ]


def _generation_batch(cfg, plan: Plan) -> list[tuple]:
    """GRPO's and RLOO's shared arguments: the generation batch, its minibatches, sampling, KL and clipping."""
    a, alg = cfg.actor, cfg.algorithm
    return [
        ("per_device_train_batch_size", plan.per_device, "actor_rollout.ppo_mini_batch_size"),
        ("steps_per_generation", plan.minibatches, "global_batch_size x n_samples_per_prompt / ppo_mini_batch_size"),
        ("num_generations", a.n_samples_per_prompt, "actor_rollout.n_samples_per_prompt"),
        ("num_iterations", a.ppo_epochs, "actor_rollout.ppo_epochs"),
        ("max_completion_length", cfg.max_new_tokens, "actor_rollout.max_new_tokens"),
        *_sampling(cfg),
        ("beta", alg.kl_ctrl.kl_coef, "algorithm.kl_ctrl.kl_coef"),
        ("epsilon", a.clip_ratio, "actor_rollout.clip_ratio"),
        ("epsilon_high", a.clip_ratio_high, "actor_rollout.clip_ratio_high"),
        ("mask_truncated_completions", alg.mask_truncated_completions, "algorithm.mask_truncated_completions"),
        ("shuffle_dataset", False, "(prompts given in our cursor's order)"),
    ]


def _grpo(cfg, plan: Plan) -> tuple[list[tuple], list[str]]:
    a, alg = cfg.actor, cfg.algorithm
    notes = [] if alg.kl_penalty == "low_var_kl" else [f"kl_penalty {alg.kl_penalty}: TRL's GRPO KL term is k3"]
    return [
        *_generation_batch(cfg, plan),
        ("loss_type", alg.loss_type, "algorithm.loss_type"),
        ("scale_rewards", alg.scale_rewards, "algorithm.scale_rewards"),
        ("use_bias_correction_kl", alg.use_bias_correction_kl, "algorithm.use_bias_correction_kl"),
        ("importance_sampling_level", alg.importance_sampling_level, "algorithm.importance_sampling_level"),
        ("top_entropy_quantile", alg.top_entropy_quantile, "algorithm.top_entropy_quantile"),
        ("entropy_coef", a.entropy_coeff, "actor_rollout.entropy_coeff"),
    ], notes


def _rloo(cfg, plan: Plan) -> tuple[list[tuple], list[str]]:
    alg = cfg.algorithm
    notes = [] if alg.kl_penalty == "kl" else [f"kl_penalty {alg.kl_penalty}: TRL's RLOO puts k1 in the reward"]
    notes += [] if alg.rloo_convention == "trl" else [f"rloo_convention {alg.rloo_convention}: TRL's is 'trl'"]
    if cfg.actor.entropy_coeff:
        notes.append(f"actor_rollout.entropy_coeff {cfg.actor.entropy_coeff} not mapped: TRL's RLOO has none")
    rows = [
        *_generation_batch(cfg, plan),
        ("normalize_advantages", alg.whiten_advantages, "algorithm.whiten_advantages"),
    ]
    return rows, notes


def _online_dpo(cfg, plan: Plan) -> tuple[list[tuple], list[str]]:
    a, alg = cfg.actor, cfg.algorithm
    notes = ["TRL's online DPO scores each pair with the reward function (the config's rule), as ours does"]
    if plan.updates_per_step > 1:
        notes.append("TRL generates each minibatch's pairs after the previous update; ours a step's pairs at once")
    if a.ppo_epochs > 1:
        notes.append(f"actor_rollout.ppo_epochs {a.ppo_epochs} not mapped: TRL's online DPO makes one pass")
    return [
        ("per_device_train_batch_size", plan.per_device, "min(global_batch_size, ppo_mini_batch_size / 2) pairs"),
        ("max_new_tokens", cfg.max_new_tokens, "actor_rollout.max_new_tokens"),
        ("max_length", a.max_prompt_length + cfg.max_new_tokens, "max_prompt_length + max_new_tokens"),
        *_sampling(cfg),
        ("beta", [alg.dpo_beta], "algorithm.dpo_beta"),
        ("loss_type", alg.dpo_loss_type, "algorithm.dpo_loss_type"),
        ("missing_eos_penalty", alg.missing_eos_penalty or None, "algorithm.missing_eos_penalty (0: None)"),
        ("train_sampling_strategy", "sequential", "(prompts given in our cursor's order)"),
    ], notes


def hyperparameters(algo: str, cfg, plan: Plan) -> tuple[dict, dict, list[str]]:
    """TRL's arguments, where each came from, and the notes on what does not map."""
    rows, notes = _optim(cfg, plan)
    algo_rows, algo_notes = {"grpo": _grpo, "rloo": _rloo, "online_dpo": _online_dpo}[algo](cfg, plan)
    rows = rows + algo_rows
    return {k: v for k, v, _ in rows}, {k: src for k, _, src in rows}, notes + algo_notes + common_notes(algo, cfg)


def common_notes(algo: str, cfg) -> list[str]:
    a, alg, t = cfg.actor, cfg.algorithm, cfg.training
    notes = [
        "prompts: our PromptCursor's order (training.seed, data.shuffle), given to TRL unshuffled",
        "TRL generates with the policy itself (HF generate, fp32); ours with vLLM on the rollout replicas",
        "evaluation: HF generate on the TRL policy (ours: vLLM on the replicas), same prompts, sampling and rule",
        "TRL's loss forward passes no position ids: a left-padded prompt's tokens sit at positions shifted by its "
        "padding, unlike at generation (HF generate, ours: positions counted from the first real token)",
        "a reward rule that fails gives None, which TRL sums to 0; ours leaves the item unscored",
    ]
    if algo != "online_dpo":
        if a.tis_cap:
            notes.append(f"actor_rollout.tis_cap {a.tis_cap}: no counterpart (TRL has no separate sampler log-probs)")
        if a.ppo_mini_batch_size < t.global_batch_size * a.n_samples_per_prompt and not a.shuffle_minibatch:
            notes.append("TRL shuffles a generation batch's rows once before its minibatches; ours keeps their order")
        if alg.missing_eos_penalty:
            notes.append(f"algorithm.missing_eos_penalty {alg.missing_eos_penalty} not mapped")
        if a.dual_clip:
            notes.append(f"actor_rollout.dual_clip {a.dual_clip} not mapped")
    if t.max_staleness:
        notes.append(f"training.max_staleness {t.max_staleness}: TRL is on-policy (staleness 0)")
    return notes


def build_trainer(algo: str, path: str, tok, kwargs: dict, dataset, reward_fn, callback, out_dir: str):
    """GRPOTrainer, RLOOTrainer or the experimental OnlineDPOTrainer on the policy at ``path`` (fp32)."""
    common = {"output_dir": out_dir, **CPU_ARGS, **kwargs}
    data = {"processing_class": tok, "train_dataset": dataset, "reward_funcs": reward_fn, "callbacks": [callback]}
    if algo == "online_dpo":
        policy, ref = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) for _ in range(2))
        return OnlineDPOTrainer(model=policy, ref_model=ref, args=OnlineDPOConfig(**common), **data)

    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if algo == "grpo" else (RLOOConfig, RLOOTrainer)
    args = config_cls(**common, model_init_kwargs={"dtype": "float32"}, log_completions=False)
    return trainer_cls(model=path, args=args, **data)


def trl_prompt_ids(trainer, algo: str, prompts: list[list[dict]]) -> list[list[int]]:
    """The prompt token ids TRL generates from, by its own code path."""
    if algo != "online_dpo":
        return [list(ids) for ids in trainer._tokenize_prompts(prompts)[0]]

    tok = trainer.processing_class
    texts = [maybe_apply_chat_template({"prompt": p}, tok)["prompt"] for p in prompts]
    return tok(text=texts, add_special_tokens=False)["input_ids"]


def check_prompt_ids(trainer, algo: str, cfg, tok, records) -> int:
    """TRL's prompt ids equal ours (``rlhf.data.record_prompt_ids``) for every distinct prompt; returns their count."""
    unique = list({r.prompt: r for r in records}.values())
    a = cfg.actor
    ours = [record_prompt_ids(tok, r, a.max_prompt_length, a.apply_chat_template) for r in unique]
    theirs = trl_prompt_ids(trainer, algo, [conversation(r) for r in unique])
    bad = [r.prompt for r, o, t in zip(unique, ours, theirs, strict=True) if list(o) != list(t)]
    if bad:
        raise SystemExit(f"TRL tokenizes {len(bad)} prompts unlike encode_prompt, e.g. {bad[0]!r}")
    return len(unique)


def per_step_rewards(rewards: list, samples_per_step: int) -> list[dict]:
    out = []
    for start in range(0, len(rewards) - samples_per_step + 1, samples_per_step):
        scored = [x for x in rewards[start : start + samples_per_step] if x is not None]
        mean = sum(scored) / len(scored) if scored else float("nan")
        out.append({"step": start // samples_per_step + 1, "reward_mean": mean})
    return out


def run(args) -> dict:
    cfg, overrides = load(args)
    plan = plan_steps(args.algo, cfg)
    kwargs, mapping, notes = hyperparameters(args.algo, cfg, plan)
    t, score, rewards = cfg.training, reward_rule(cfg), []
    path = str(resolve_model_path(cfg.actor.load))
    tok = AutoTokenizer.from_pretrained(path)
    records = train_records(cfg, t.train_iters * t.global_batch_size)
    rows = [{"prompt": conversation(r), "label": r.label, "prompt_text": r.prompt} for r in records]
    result = {
        "side": "trl",
        "trl_version": trl.__version__,
        "algo": args.algo,
        "task": cfg.data.path.removeprefix("builtin:"),
        "seed": t.seed,
        "threads": torch.get_num_threads(),
        "cores": len(os.sched_getaffinity(0)),
        "config": args.config,
        "overrides": overrides,
        "model": path,
        "steps": t.train_iters,
        "step": f"one batch of {t.global_batch_size} prompts x {plan.samples_per_step // t.global_batch_size} "
        f"completions; ours and TRL both take {plan.updates_per_step} optimizer step(s) on it "
        f"({plan.minibatches} minibatch(es) x {plan.updates_per_step // plan.minibatches} epoch(s))",
        "optimizer_steps_per_step": plan.updates_per_step,
        "hyperparameters": kwargs,
        "mapping": mapping,
        "notes": notes,
        "curve": [],
    }
    curve = Curve(result, HeldOut(cfg, tok, score), plan, cfg)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build_trainer(
            args.algo, path, tok, kwargs, Dataset.from_list(rows), rule_reward(score, rewards), curve, out_dir
        )
        result["prompt_ids_checked"] = check_prompt_ids(trainer, args.algo, cfg, tok, records)
        trainer.train()
    result["train_reward"] = per_step_rewards(rewards, plan.samples_per_step)
    result["samples_total"] = t.train_iters * plan.samples_per_step
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with contextlib.suppress(RuntimeError):  # only before the first parallel work
        torch.set_num_interop_threads(args.threads)
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # library chatter to stderr; the result alone on stdout
        result = run(args)
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line, file=out, flush=True)


if __name__ == "__main__":
    main()
