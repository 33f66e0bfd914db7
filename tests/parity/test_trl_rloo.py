"""RLOO parity: TRL 1.12.0 ``RLOOTrainer`` vs the trainer's real update path (``TrainerEngine.step``, ``ray_rloo`` with
``rloo_convention: trl``), number by number.

Path A is TRL's own code on fixed completions: ``_generate`` is replaced by a function that returns them (truncated
after the first EOS, as generation returns them) and a reward function returns fixed scores;
``_generate_and_score_completions`` folds ``beta * sum_t (old - ref)`` into the reward before the leave-one-out baseline
and ``compute_loss`` clips one ratio per sequence. Minibatches and iterations are fed in the order of TRL's
``_prepare_inputs`` (GA = 1), stepped with AdamW. Path B is ``TrainerEngine`` with the same options (TRL's
``epsilon``, ``beta``, ``num_iterations`` and ``normalize_advantages`` are ``clip_ratio``, ``kl_ctrl.kl_coef``,
``ppo_epochs`` and ``whiten_advantages`` there). Prompts have one length (see test_trl_grpo.py on position ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from datasets import Dataset
from trl import RLOOConfig, RLOOTrainer

import rlhf.algo
from rlhf.config import parse_config
from services.trainer.engine import TrainerEngine
from tests.parity.parity_support import (
    TRL_CPU_ARGS,
    Comparison,
    build_models,
    build_tokenizer,
    capture_optimizer_grads,
    experiences,
    make_prompts,
    make_responses,
    reference_logprobs,
    save_pretrained,
    truncate_after_eos,
    worst_grad,
)


@dataclass(frozen=True)
class RLOOSetting:
    name: str
    group: int
    prompts: int
    minibatch: int
    iterations: int
    beta: float
    epsilon: float
    epsilon_high: float | None
    temperature: float
    normalize_advantages: bool = False
    mask_truncated: bool = False
    lr: float = 5e-3
    completion_length: int = 6


SETTINGS = [
    RLOOSetting(
        "g4_beta0.05_T0.8",
        group=4,
        prompts=3,
        minibatch=6,
        iterations=2,
        beta=0.05,
        epsilon=0.2,
        epsilon_high=None,
        temperature=0.8,
    ),
    RLOOSetting(
        "g8_normalized_asym_mask_truncated",
        group=8,
        prompts=2,
        minibatch=8,
        iterations=2,
        beta=0.1,
        epsilon=0.2,
        epsilon_high=0.28,
        temperature=1.0,
        normalize_advantages=True,
        mask_truncated=True,
    ),
    RLOOSetting(
        "g4_beta0",
        group=4,
        prompts=2,
        minibatch=8,
        iterations=3,
        beta=0.0,
        epsilon=0.1,
        epsilon_high=0.3,
        temperature=1.2,
    ),
]

LOGPROB_TOL = 1e-5
SUM_TOL = 1e-4  # per-sequence sums over tokens
ADV_TOL, ADV_RTOL = 1e-4, 1e-4
LOSS_TOL = 1e-5
STAT_TOL = 1e-6
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4


@dataclass
class Case:
    setting: RLOOSetting
    seed: int
    prompts: list[list[int]]
    completions: list[list[int]]
    scores: list[float]


def make_case(setting: RLOOSetting, seed: int) -> Case:
    gen = torch.Generator().manual_seed(3000 + seed)
    n_rows = setting.group * setting.prompts
    prompts = make_prompts(gen, setting.prompts, 4, 4)
    raw, _ = make_responses(gen, n_rows, setting.completion_length)
    completions = [truncate_after_eos(r) for r in raw.tolist()]
    scores = torch.randn(n_rows, generator=gen)
    scores[: setting.group] = 0.5  # an equal-reward group
    return Case(setting=setting, seed=seed, prompts=prompts, completions=completions, scores=scores.tolist())


def run_trl(case: Case, model_dir: str, tmp_path) -> dict:
    s = case.setting
    n_rows = len(case.completions)
    n_minibatches = n_rows // s.minibatch
    tok = build_tokenizer()
    texts = [tok.decode(p) for p in case.prompts]
    cap: dict = {"logps": [], "losses": [], "grads": []}

    def fixed_generate(prompts):
        assert list(prompts) == [texts[i // s.group] for i in range(n_rows)]
        prompt_ids = [case.prompts[i // s.group] for i in range(n_rows)]
        completion_ids = [list(c) for c in case.completions]
        return prompt_ids, completion_ids, tok.batch_decode(completion_ids, skip_special_tokens=True)

    def fixed_reward(prompts, completions, completion_ids, **kwargs):
        assert completion_ids == case.completions
        return list(case.scores)

    args = RLOOConfig(
        output_dir=str(tmp_path / "trl_rloo"),
        seed=case.seed,
        per_device_train_batch_size=s.minibatch,
        gradient_accumulation_steps=1,
        steps_per_generation=n_minibatches,
        num_generations=s.group,
        num_iterations=s.iterations,
        max_completion_length=s.completion_length,
        temperature=s.temperature,
        beta=s.beta,
        epsilon=s.epsilon,
        epsilon_high=s.epsilon_high,
        normalize_advantages=s.normalize_advantages,
        mask_truncated_completions=s.mask_truncated,
        learning_rate=s.lr,
        **TRL_CPU_ARGS,
        log_completions=False,
    )
    trainer = RLOOTrainer(
        model=model_dir,
        reward_funcs=fixed_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tok,
    )
    trainer._generate = fixed_generate
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    orig_logps = trainer._get_per_token_logps_and_entropies

    def logps_spy(*a, **k):
        out = orig_logps(*a, **k)
        cap["logps"].append(out[0].detach().clone())  # old, [ref,] then one per minibatch
        return out

    trainer._get_per_token_logps_and_entropies = logps_spy
    gen = trainer._generate_and_score_completions([{"prompt": texts[i // s.group]} for i in range(n_rows)])
    cap["gen"] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in gen.items()}
    cap["old_per_token"] = cap["logps"][0]
    cap["ref_per_token"] = cap["logps"][1] if s.beta != 0.0 else None
    cap["logps"] = []
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=s.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True
    )
    for _ in range(s.iterations):
        for k in range(n_minibatches):
            rows = slice(k * s.minibatch, (k + 1) * s.minibatch)
            mb = {
                key: v[rows] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n_rows else v
                for key, v in gen.items()
            }
            loss = trainer.compute_loss(model, mb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            cap["losses"].append(loss.detach().clone())
            cap["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
            optimizer.step()
    cap["metrics"] = {k: list(v) for k, v in trainer._metrics["train"].items()}
    return cap


def run_ours(case: Case, models, model_dir: str, monkeypatch, trl_ref: torch.Tensor | None) -> dict:
    """``trl_ref``: TRL's reference log-probs, carried by the experience records when ``beta != 0`` (see the GRPO test:
    the reference service's own numbers are compared with them, within 1e-5, and are an input of the trainer)."""
    s = case.setting
    cfg = parse_config(
        {
            "training": {"stage": "ray_rloo", "device": "cpu", "lr": s.lr, "seed": case.seed, "clip_grad": 0.0},
            "actor_rollout_ref": {
                "actor_rollout": {
                    "load": model_dir,
                    "do_sample": True,
                    "temperature": s.temperature,
                    "n_samples_per_prompt": s.group,
                    "ppo_mini_batch_size": s.minibatch,
                    "ppo_epochs": s.iterations,
                    "clip_ratio": s.epsilon,
                    "clip_ratio_high": s.epsilon_high,
                    "max_new_tokens": s.completion_length,
                }
            },
            "algorithm": {
                "kl_ctrl": {"kl_coef": s.beta},
                "whiten_advantages": s.normalize_advantages,  # TRL's normalize_advantages
                "mask_truncated_completions": s.mask_truncated,
            },
        }
    )
    assert cfg.algorithm.rloo_convention == "trl" and cfg.algorithm.kl_penalty == "kl"
    engine = TrainerEngine(cfg, device="cpu")
    grads = capture_optimizer_grads(engine)
    cap: dict = {"loss_calls": []}
    orig_adv, orig_loss = rlhf.algo.rloo_trl_advantages, rlhf.algo.rloo_trl_loss

    def adv_spy(scores, group, sequence_kl=None, beta=0.0, normalize_advantages=False, **k):
        out = orig_adv(scores, group, sequence_kl, beta, normalize_advantages=normalize_advantages, **k)
        cap["advantages"], cap["rewards"], cap["sequence_kl"] = out[0].clone(), out[1].clone(), sequence_kl.clone()
        return out

    def loss_spy(logprobs, old_sequence_logprobs, advantages, mask, **k):
        loss, stats = orig_loss(logprobs, old_sequence_logprobs, advantages, mask, **k)
        cap["loss_calls"].append(
            {
                "logprobs": logprobs.detach().clone(),
                "old": old_sequence_logprobs.clone(),
                "mask": mask.clone(),
                "loss": loss.detach().clone(),
                "stats": {n: v.clone() for n, v in stats.items()},
            }
        )
        return loss, stats

    monkeypatch.setattr(rlhf.algo.critic_free, "rloo_trl_advantages", adv_spy)  # called by critic_free_advantages
    monkeypatch.setattr(rlhf.algo.critic_free, "rloo_trl_loss", loss_spy)  # called by critic_free_micro_loss
    refs = [
        reference_logprobs(models.ref, case.prompts[i // s.group], c, s.temperature)
        for i, c in enumerate(case.completions)
    ]
    fed = refs if trl_ref is None else [trl_ref[i, : len(c)].tolist() for i, c in enumerate(case.completions)]
    cap["metrics"] = engine.step(experiences(case.prompts, case.completions, case.scores, fed))
    cap.update(grads=grads, refs=refs)
    return cap


def compare(case: Case, trl: dict, ours: dict, report: dict) -> Comparison:
    s = case.setting
    n_rows = len(case.completions)
    n_minibatches = n_rows // s.minibatch
    g = trl["gen"]
    mask = g["completion_mask"].bool()
    cmp = Comparison(f"RLOO {s.name} seed={case.seed}", prefix=f"rloo trl [{s.name}] ", report=report)
    calls = ours["loss_calls"]
    first = calls[:n_minibatches]
    cmp.exact("completion_mask", torch.cat([c["mask"] for c in first]), mask)
    cmp.add("old sequence logprobs", torch.cat([c["old"] for c in first]), g["old_logps"], SUM_TOL)
    if s.beta != 0.0:
        width = mask.shape[1]
        refs = torch.tensor([r + [0.0] * (width - len(r)) for r in ours["refs"]])
        cmp.add("ref_logprobs (reference service)", refs, trl["ref_per_token"], LOGPROB_TOL, mask=mask)
        t_kl = ((trl["old_per_token"] - trl["ref_per_token"]) * mask).sum(1)
        cmp.add("sequence KL (sum of old - ref)", ours["sequence_kl"], t_kl, SUM_TOL)
    cmp.add("advantages", ours["advantages"], g["advantages"], ADV_TOL, rtol=ADV_RTOL)
    m = trl["metrics"]
    assert len(calls) == len(trl["losses"]) == len(trl["logps"]) == s.iterations * n_minibatches
    for step, (call, t_loss, t_logps, t_grads, o_grads) in enumerate(
        zip(calls, trl["losses"], trl["logps"], trl["grads"], ours["grads"], strict=True)
    ):
        k = step % n_minibatches
        rows = slice(k * s.minibatch, (k + 1) * s.minibatch)
        tag = f"[it{step // n_minibatches} mb{k}]"
        cmp.add(f"new_logprobs{tag}", call["logprobs"], t_logps, LOGPROB_TOL, mask=mask[rows])
        cmp.add(f"loss{tag}", call["loss"], t_loss, LOSS_TOL)
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            cmp.add(f"{name}{tag}", call["stats"][name], m[name][step], STAT_TOL)
        worst_grad(cmp, tag, o_grads, t_grads, GRAD_ATOL, GRAD_RTOL)
    cmp.add(
        "objective/kl (sum over tokens, mean over rows)",
        ours["metrics"]["objective/kl"],
        ((trl["old_per_token"] - trl["ref_per_token"]) * mask).sum(1).mean() if s.beta else 0.0,
        STAT_TOL if s.beta else 1.0,
    )
    return cmp


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_rloo_engine_matches_trl(setting: RLOOSetting, seed: int, tmp_path, monkeypatch, parity_report):
    case = make_case(setting, seed)
    models = build_models(seed)
    model_dir = save_pretrained(models.fresh().policy, tmp_path / "policy")
    trl = run_trl(case, model_dir, tmp_path)
    ours = run_ours(case, models, model_dir, monkeypatch, trl["ref_per_token"])
    cmp = compare(case, trl, ours, parity_report)
    assert any(v > 0 for v in trl["metrics"]["clip_ratio/region_mean"]), "no clipping in this run"
    cmp.check()
