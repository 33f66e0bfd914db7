"""GRPO parity: TRL 1.12.0 ``GRPOTrainer`` vs the trainer's real update path (``TrainerEngine.step``), number by number.

Path A is TRL's own code on fixed completions: ``rollout_func`` (TRL's hook for custom generation) returns them,
truncated after the first EOS as ``_generate_single_turn`` does, and a reward function returns fixed scores;
``_generate_and_score_completions`` builds the masks, advantages and old/reference log-probs, and
``compute_loss`` (``_compute_loss``) gives each minibatch's loss, stepped with AdamW in the order TRL's
``_prepare_inputs`` feeds it: ``steps_per_generation`` slices of ``per_device_train_batch_size`` rows, the same slices
again for each of ``num_iterations`` (GA = 1; TRL shuffles the rows of a generation batch once, the engine does not:
row order is input data, so TRL gets them unshuffled).

Path B is ``services.trainer.engine.TrainerEngine`` built from a config with TRL's option names, fed experience records
as the rollout workers publish them (reference log-probs at the sampling temperature, as the reference service
computes them). Its intermediate tensors are read by wrapping ``rlhf.algo`` functions, without changing the path.

TRL's GRPO runs the model without position ids (HF's default ``0..T-1`` counts left pads); the engine's forward gives
left pads position 0. The prompts of a run therefore all have the same length, so both agree on every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

import rlhf.algo
import rlhf.models
from rlhf.config import parse_config
from services.trainer.engine import TrainerEngine
from tests.parity.parity_support import (
    PAD,
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
class GRPOSetting:
    name: str
    loss_type: str
    group: int  # num_generations = n_samples_per_prompt
    prompts: int
    minibatch: int  # per_device_train_batch_size = ppo_mini_batch_size
    iterations: int  # num_iterations = ppo_epochs
    beta: float
    epsilon: float
    epsilon_high: float | None
    temperature: float
    scale_rewards: str = "group"
    bias_correction_kl: bool = True
    importance_sampling_level: str = "token"
    mask_truncated: bool = False
    top_entropy_quantile: float = 1.0
    equal_reward: float = 0.3  # every sample of the first prompt gets this score
    lr: float = 5e-3
    completion_length: int = 6
    max_completion_length: int = 6


SETTINGS = [
    GRPOSetting(
        "dapo_g4_beta0",
        "dapo",
        group=4,
        prompts=3,
        minibatch=6,
        iterations=2,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=None,
        temperature=1.0,
    ),
    GRPOSetting(
        "grpo_g8_asym_kl_T0.7",
        "grpo",
        group=8,
        prompts=2,
        minibatch=8,
        iterations=2,
        beta=0.04,
        epsilon=0.2,
        epsilon_high=0.28,
        temperature=0.7,
        equal_reward=1000.1,
    ),
    GRPOSetting(
        "bnpo_g4_batch_scale_plain_kl",
        "bnpo",
        group=4,
        prompts=2,
        minibatch=4,
        iterations=2,
        beta=0.1,
        epsilon=0.1,
        epsilon_high=0.3,
        temperature=1.3,
        scale_rewards="batch",
        bias_correction_kl=False,
    ),
    GRPOSetting(
        "dr_grpo_g8_mask_truncated",
        "dr_grpo",
        group=8,
        prompts=2,
        minibatch=16,
        iterations=3,
        beta=0.02,
        epsilon=0.2,
        epsilon_high=0.28,
        temperature=0.9,
        scale_rewards="none",
        mask_truncated=True,
        max_completion_length=8,
    ),
    GRPOSetting(
        "dapo_g8_top_entropy_kl",
        "dapo",
        group=8,
        prompts=2,
        minibatch=8,
        iterations=2,
        beta=0.05,
        epsilon=0.2,
        epsilon_high=0.28,
        temperature=0.8,
        top_entropy_quantile=0.5,
    ),
    GRPOSetting(
        "gspo_grpo_g4_sequence",
        "grpo",
        group=4,
        prompts=3,
        minibatch=4,
        iterations=2,
        beta=0.03,
        epsilon=3e-4,
        epsilon_high=4e-4,
        temperature=1.0,
        importance_sampling_level="sequence",
    ),
]

LOGPROB_TOL = 1e-5
ADV_TOL, ADV_RTOL = 1e-4, 1e-4  # dividing by std + 1e-4 amplifies rounding (section 6.4, whitened advantages)
LOSS_TOL = 1e-5
STAT_TOL = 1e-6
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4


@dataclass
class Case:
    setting: GRPOSetting
    seed: int
    prompts: list[list[int]]  # distinct, equal length
    completions: list[list[int]]  # (B,) truncated after the first EOS; rows of prompt j at j*G .. j*G+G-1
    scores: list[float]


def make_case(setting: GRPOSetting, seed: int) -> Case:
    gen = torch.Generator().manual_seed(2000 + seed)
    s = setting
    n_rows = s.group * s.prompts
    prompts = make_prompts(gen, s.prompts, 4, 4)
    raw, cases = make_responses(gen, n_rows, s.completion_length)
    completions = [truncate_after_eos(r) for r in raw.tolist()]
    assert len({len(c) for c in completions}) > 1 and any(c[-1] != 1 for c in completions)  # unequal, some no EOS
    scores = torch.randn(n_rows, generator=gen)
    scores[: s.group] = s.equal_reward  # a group whose rewards are all equal
    return Case(setting=s, seed=seed, prompts=prompts, completions=completions, scores=scores.tolist())


# ---------------------------------------------------------------------------------------------------------------------
# Path A: TRL


def run_trl(case: Case, model_dir: str, tmp_path) -> dict:
    s = case.setting
    n_rows = len(case.completions)
    n_minibatches = n_rows // s.minibatch
    tok = build_tokenizer()
    texts = [tok.decode(p) for p in case.prompts]
    cap: dict = {"logps": [], "entropy_mask": [], "losses": [], "grads": []}

    def fixed_rollout(prompts, trainer):
        assert list(prompts) == [texts[i // s.group] for i in range(n_rows)]
        return {
            "prompt_ids": [case.prompts[i // s.group] for i in range(n_rows)],
            "completion_ids": [list(c) for c in case.completions],
            "logprobs": None,
        }

    def fixed_reward(prompts, completions, completion_ids, **kwargs):
        assert completion_ids == case.completions
        return list(case.scores)

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl_grpo"),
        seed=case.seed,
        per_device_train_batch_size=s.minibatch,
        gradient_accumulation_steps=1,
        steps_per_generation=n_minibatches,
        num_generations=s.group,
        num_iterations=s.iterations,
        max_completion_length=s.max_completion_length,
        temperature=s.temperature,
        beta=s.beta,
        epsilon=s.epsilon,
        epsilon_high=s.epsilon_high,
        loss_type=s.loss_type,
        scale_rewards=s.scale_rewards,
        use_bias_correction_kl=s.bias_correction_kl,
        importance_sampling_level=s.importance_sampling_level,
        mask_truncated_completions=s.mask_truncated,
        top_entropy_quantile=s.top_entropy_quantile,
        learning_rate=s.lr,
        **TRL_CPU_ARGS,
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=fixed_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tok,
        rollout_func=fixed_rollout,
    )
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which this drives by hand
    orig_logps = trainer._get_per_token_logps_and_entropies

    def logps_spy(*a, **k):
        out = orig_logps(*a, **k)
        if k.get("compute_entropy"):  # the training forward inside _compute_loss
            cap["logps"].append((out[0].detach().clone(), out[1].detach().clone()))
        return out

    trainer._get_per_token_logps_and_entropies = logps_spy
    orig_entropy_mask = trainer.get_high_entropy_mask

    def entropy_mask_spy(*a, **k):
        out = orig_entropy_mask(*a, **k)
        cap["entropy_mask"].append(out.clone())
        return out

    trainer.get_high_entropy_mask = entropy_mask_spy

    gen = trainer._generate_and_score_completions([{"prompt": texts[i // s.group]} for i in range(n_rows)])
    cap["gen"] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in gen.items()}
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


# ---------------------------------------------------------------------------------------------------------------------
# Path B: the trainer engine


def engine_config(s: GRPOSetting, model_dir: str, seed: int):
    return parse_config(
        {
            "training": {"stage": "ray_grpo", "device": "cpu", "lr": s.lr, "seed": seed, "clip_grad": 0.0},
            "actor_rollout_ref": {
                "actor_rollout": {
                    "load": model_dir,
                    "do_sample": True,
                    "temperature": s.temperature,
                    "n_samples_per_prompt": s.group,
                    "ppo_mini_batch_size": s.minibatch,
                    "ppo_epochs": s.iterations,  # TRL's num_iterations
                    "clip_ratio": s.epsilon,  # TRL's epsilon
                    "clip_ratio_high": s.epsilon_high,  # TRL's epsilon_high
                    "max_new_tokens": s.max_completion_length,
                    "shuffle_minibatch": False,
                }
            },
            "algorithm": {
                "kl_ctrl": {"kl_coef": s.beta},  # TRL's beta
                "loss_type": s.loss_type,
                "scale_rewards": s.scale_rewards,
                "use_bias_correction_kl": s.bias_correction_kl,
                "importance_sampling_level": s.importance_sampling_level,
                "mask_truncated_completions": s.mask_truncated,
                "top_entropy_quantile": s.top_entropy_quantile,
            },
        }
    )


def run_ours(case: Case, models, model_dir: str, monkeypatch, trl_ref: torch.Tensor | None) -> dict:
    """``trl_ref``: TRL's reference log-probs, which the experience records carry when ``beta != 0``.

    The reference service is an input of the trainer; its math (``reference_logprobs``) is compared with TRL's
    separately. Feeding its own numbers would make the KL term differ from TRL's by ~1e-15 where TRL's is exactly 0
    (policy == reference on the first step), and AdamW turns a 1e-9 gradient into a step of a fifth of the learning
    rate where TRL's is 0: a real but meaningless difference.
    """
    s = case.setting
    n_rows = len(case.completions)
    cfg = engine_config(s, model_dir, case.seed)
    assert cfg.algorithm.kl_penalty == "low_var_kl"  # ray_grpo's default: TRL's k3
    engine = TrainerEngine(cfg, device="cpu")
    grads = capture_optimizer_grads(engine)
    cap: dict = {"loss_calls": []}
    orig_adv, orig_loss = rlhf.algo.grpo_advantages, rlhf.algo.grpo_loss

    def adv_spy(*a, **k):
        out = orig_adv(*a, **k)
        cap["advantages"] = out.clone()
        return out

    def loss_spy(logprobs, old_logprobs, advantages, mask, **k):
        loss, stats = orig_loss(logprobs, old_logprobs, advantages, mask, **k)
        cap["loss_calls"].append(
            {
                "logprobs": logprobs.detach().clone(),
                "old": old_logprobs.clone(),
                "ref": k["ref_logprobs"].clone(),
                "mask": mask.clone(),
                "entropy_mask": None if k["entropy_mask"] is None else k["entropy_mask"].clone(),
                "num_items": float(k["num_items"]),
                "loss": loss.detach().clone(),
                "stats": {n: v.clone() for n, v in stats.items()},
            }
        )
        return loss, stats

    monkeypatch.setattr(rlhf.algo.critic_free, "grpo_advantages", adv_spy)  # called by critic_free_advantages
    monkeypatch.setattr(rlhf.algo.critic_free, "grpo_loss", loss_spy)  # called by critic_free_micro_loss
    refs = [
        reference_logprobs(models.ref, case.prompts[i // s.group], c, s.temperature)
        for i, c in enumerate(case.completions)
    ]
    fed = refs if trl_ref is None else [trl_ref[i, : len(c)].tolist() for i, c in enumerate(case.completions)]
    metrics = engine.step(experiences(case.prompts, case.completions, case.scores, fed))
    assert len(cap["loss_calls"]) == s.iterations * (n_rows // s.minibatch)
    cap.update(metrics=metrics, grads=grads, refs=refs)
    return cap


# ---------------------------------------------------------------------------------------------------------------------


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows])


def compare(case: Case, trl: dict, ours: dict, report: dict) -> Comparison:
    s = case.setting
    n_rows = len(case.completions)
    n_minibatches = n_rows // s.minibatch
    g = trl["gen"]
    mask = g["completion_mask"].bool()
    width = mask.shape[1]
    cmp = Comparison(f"GRPO {s.name} seed={case.seed}", prefix=f"grpo {s.loss_type} [{s.name}] ", report=report)
    calls = ours["loss_calls"]
    first = calls[:n_minibatches]  # the first pass over the minibatches: the whole batch, in row order
    our_mask = torch.cat([c["mask"] for c in first])
    cmp.exact("completion_mask", our_mask, mask)
    cmp.add("advantages", ours["advantages"], g["advantages"], ADV_TOL, rtol=ADV_RTOL)
    if s.scale_rewards == "group":  # the equal-reward group: TRL's 1e-4 keeps it near 0 (1e-6 would not)
        assert trl["gen"]["advantages"][: s.group].abs().max() < 0.5
    num_items = float(g["num_items_in_batch"]) / n_minibatches
    cmp.add("dapo normaliser (tokens per minibatch)", first[0]["num_items"], num_items, 1e-5)  # float32 quotient
    old = torch.cat([c["old"] for c in first])
    if "old_per_token_logps" in g:  # TRL computes them when num_iterations > 1
        cmp.add("old_logprobs", old, g["old_per_token_logps"], LOGPROB_TOL, mask=mask)
    if s.beta != 0.0:  # the reference service's math against TRL's reference forward
        cmp.add(
            "ref_logprobs (reference service)",
            _pad(ours["refs"], width),
            g["ref_per_token_logps"],
            LOGPROB_TOL,
            mask=mask,
        )

    m = trl["metrics"]
    assert len(calls) == len(trl["losses"]) == len(trl["logps"]) == s.iterations * n_minibatches
    for step, (call, t_loss, (t_logps, _), t_grads, o_grads) in enumerate(
        zip(calls, trl["losses"], trl["logps"], trl["grads"], ours["grads"], strict=True)
    ):
        k = step % n_minibatches
        rows = slice(k * s.minibatch, (k + 1) * s.minibatch)
        tag = f"[it{step // n_minibatches} mb{k}]"
        mb_mask = mask[rows]
        cmp.add(f"new_logprobs{tag}", call["logprobs"], t_logps, LOGPROB_TOL, mask=mb_mask)
        if call["entropy_mask"] is not None:
            cmp.exact(f"entropy_mask{tag}", call["entropy_mask"], trl["entropy_mask"][step])
        cmp.add(f"loss{tag}", call["loss"], t_loss, LOSS_TOL)
        st = call["stats"]
        if s.beta != 0.0:
            cmp.add(f"kl{tag}", st["kl"], m["kl"][step], STAT_TOL)
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            cmp.add(f"{name}{tag}", st[name], m[name][step], STAT_TOL)
        worst_grad(cmp, tag, o_grads, t_grads, GRAD_ATOL, GRAD_RTOL)
    cmp.add(
        "entropy (mean over minibatches)",
        ours["metrics"]["policy/entropy"],
        sum(m["entropy"]) / len(m["entropy"]),
        STAT_TOL,
    )
    return cmp


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_grpo_engine_matches_trl(setting: GRPOSetting, seed: int, tmp_path, monkeypatch, parity_report):
    case = make_case(setting, seed)
    models = build_models(seed)
    model_dir = save_pretrained(models.fresh().policy, tmp_path / "policy")
    trl = run_trl(case, model_dir, tmp_path)
    ours = run_ours(case, models, model_dir, monkeypatch, trl["gen"].get("ref_per_token_logps"))
    cmp = compare(case, trl, ours, parity_report)
    # the data make the comparison non-trivial: the later passes are off-policy and some tokens get clipped
    assert any(v > 0 for v in trl["metrics"]["clip_ratio/region_mean"]), "no clipping in this run"
    cmp.check()


def test_very_negative_padded_logprobs_never_make_nan(tmp_path):
    """The engine's GRPO with beta > 0 at a low temperature: the policy's log-prob of the pad token on the padded
    positions is hundreds below 0, so a k3 computed everywhere overflows there (exp(ref - logp) = inf) and a mask
    applied by multiplying turns the loss into NaN. Masked positions are selected away instead."""
    models = build_models(0)
    model_dir = save_pretrained(models.fresh().policy, tmp_path / "policy")
    s = GRPOSetting(
        "low_T",
        "bnpo",
        group=4,
        prompts=2,
        minibatch=8,
        iterations=1,
        beta=0.1,
        epsilon=0.2,
        epsilon_high=None,
        temperature=1e-3,
    )
    case = make_case(s, 0)
    refs = [
        reference_logprobs(models.ref, case.prompts[i // s.group], c, s.temperature)
        for i, c in enumerate(case.completions)
    ]
    cfg = parse_config(
        {
            "training": {"stage": "ray_grpo", "device": "cpu", "lr": 1e-3, "seed": 0},
            "actor_rollout_ref": {
                "actor_rollout": {
                    "load": model_dir,
                    "temperature": s.temperature,
                    "n_samples_per_prompt": s.group,
                    "ppo_mini_batch_size": 8,
                }
            },
            "algorithm": {"kl_ctrl": {"kl_coef": s.beta}},
        }
    )
    engine = TrainerEngine(cfg, device="cpu")
    with torch.no_grad():  # the premise: padded positions carry log-probs far below 0
        ids = torch.tensor([case.prompts[0] + case.completions[2] + [PAD] * 3])
        pad_lp = rlhf.algo.logprobs_from_logits(
            rlhf.models.causal_lm_logits(engine.actor, ids, PAD)[:, -4:-1], ids[:, -3:], s.temperature
        )
    assert pad_lp.min() < -100, pad_lp
    metrics = engine.step(experiences(case.prompts, case.completions, case.scores, refs))
    assert all(v == v for v in metrics.values()), metrics  # no NaN
    assert all(torch.isfinite(p).all() for p in engine.actor.parameters())
