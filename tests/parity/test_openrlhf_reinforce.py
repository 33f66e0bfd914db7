"""REINFORCE++ (+baseline) and OpenRLHF-style RLOO: TRL has none of them, so the oracle is OpenRLHF (commit 3c3be62,
ALGORITHMS.md section 4), written out here as a plain loop because OpenRLHF itself (Ray, DeepSpeed, vLLM) does not
install beside TRL: the baseline on the scalar score (``rloo``: leave-one-out; ``reinforce_baseline``: group mean),
``compute_reward`` (``-kl_coef * clamp(k1, -10, 10)`` per token, the shaped score on the last response token),
``get_cumulative_returns`` (gamma 1 with a baseline), whitening over all response tokens with the plain variance and
``rsqrt(clamp(var, 1e-8))`` for the two REINFORCE++ estimators, then ``PolicyLoss`` (token-level clipped surrogate,
mean over the minibatch's response tokens) and AdamW, one step per minibatch.

Path B is ``TrainerEngine.step`` on experience records, as in the TRL parity tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import rlhf.algo
from rlhf.config import parse_config
from services.trainer.engine import TrainerEngine
from tests.parity.parity_support import (
    PAD,
    Comparison,
    build_models,
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
class Setting:
    name: str
    stage: str
    estimator: str  # OpenRLHF's advantage_estimator
    group: int
    prompts: int
    minibatch: int
    epochs: int
    kl_coef: float
    epsilon: float
    epsilon_high: float | None
    temperature: float
    gamma: float = 1.0
    lr: float = 5e-3


SETTINGS = [
    Setting(
        "reinforce_pp_g4",
        "ray_reinforce_plus_plus",
        "reinforce",
        group=4,
        prompts=3,
        minibatch=6,
        epochs=2,
        kl_coef=0.01,
        epsilon=0.2,
        epsilon_high=None,
        temperature=1.0,
        gamma=0.95,
    ),
    Setting(
        "reinforce_pp_baseline_g8_asym",
        "ray_reinforce_plus_plus",
        "reinforce_baseline",
        group=8,
        prompts=2,
        minibatch=8,
        epochs=2,
        kl_coef=0.05,
        epsilon=0.2,
        epsilon_high=0.28,
        temperature=0.8,
    ),
    Setting(
        "rloo_openrlhf_g4",
        "ray_rloo",
        "rloo",
        group=4,
        prompts=2,
        minibatch=4,
        epochs=2,
        kl_coef=0.05,
        epsilon=0.2,
        epsilon_high=None,
        temperature=1.2,
    ),
]

TENSOR_TOL = 1e-5
WHITENED_TOL = 1e-4  # abs, plus 1e-4 relative
LOSS_TOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4


def logprobs(model, ids: torch.Tensor, ctx: int, temp: float) -> torch.Tensor:
    """OpenRLHF's actor forward: position ids ``cumsum(mask) - 1`` (pads 1), ``log_softmax(logits / T)``."""
    attention = (ids != PAD).long()
    position_ids = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits[:, ctx - 1 : -1] / temp
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, ctx:, None])[..., 0]


def openrlhf_run(s: Setting, policy, prompts, completions, scores, refs) -> dict:
    n_rows, n = len(completions), s.group
    ctx = len(prompts[0])
    n_cols = max(len(c) for c in completions)
    ids = torch.tensor([prompts[i // n] + c + [PAD] * (n_cols - len(c)) for i, c in enumerate(completions)])
    action_mask = torch.tensor([[t < len(c) for t in range(n_cols)] for c in completions])
    ref = torch.tensor([r + [0.0] * (n_cols - len(r)) for r in refs])
    with torch.no_grad():
        old = logprobs(policy, ids, ctx, s.temperature)
    # the baseline on the scalar score
    r = list(scores)
    for j in range(s.prompts):
        g = scores[j * n : (j + 1) * n]
        for i in range(j * n, (j + 1) * n):
            if s.estimator == "rloo":
                r[i] = scores[i] - (sum(g) - scores[i]) / (n - 1)
            elif s.estimator == "reinforce_baseline":
                r[i] = scores[i] - sum(g) / n
    gamma = s.gamma if s.estimator == "reinforce" else 1.0
    adv = torch.zeros(n_rows, n_cols)
    for b in range(n_rows):
        m = len(completions[b])
        per = [-s.kl_coef * max(-10.0, min(10.0, float(old[b, t] - ref[b, t]))) for t in range(m)]
        per[m - 1] += r[b]
        run = 0.0
        for t in reversed(range(m)):
            run = per[t] + gamma * run
            adv[b, t] = run
    if s.estimator != "rloo":
        vals = adv[action_mask].double()
        mean = vals.mean()
        var = ((vals - mean) ** 2).mean()
        adv = torch.where(action_mask, ((adv.double() - mean) / math.sqrt(max(float(var), 1e-8))).float(), 0.0)
    opt = torch.optim.AdamW(policy.parameters(), lr=s.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    eps_high = s.epsilon if s.epsilon_high is None else s.epsilon_high
    losses, grads = [], []
    for _ in range(s.epochs):
        for k in range(n_rows // s.minibatch):
            rows = slice(k * s.minibatch, (k + 1) * s.minibatch)
            new = logprobs(policy, ids[rows], ctx, s.temperature)
            ratio = (new - old[rows]).exp()
            surr1 = ratio * adv[rows]
            surr2 = ratio.clamp(1 - s.epsilon, 1 + eps_high) * adv[rows]
            per_token = -torch.min(surr1, surr2)
            m = action_mask[rows]
            loss = per_token[m].sum() / m.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            losses.append(loss.detach())
            grads.append({name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None})
            opt.step()
    return {"advantages": adv, "mask": action_mask, "old": old, "losses": losses, "grads": grads}


def run_engine(s: Setting, model_dir: str, prompts, completions, scores, refs, monkeypatch) -> dict:
    algorithm = {"kl_ctrl": {"kl_coef": s.kl_coef}, "gamma": s.gamma}
    if s.stage == "ray_rloo":
        algorithm["rloo_convention"] = "openrlhf"
    elif s.estimator == "reinforce_baseline":
        algorithm["adv_estimator"] = "reinforce_plus_plus_baseline"
    cfg = parse_config(
        {
            "training": {"stage": s.stage, "device": "cpu", "lr": s.lr, "seed": 0, "clip_grad": 0.0},
            "actor_rollout_ref": {
                "actor_rollout": {
                    "load": model_dir,
                    "do_sample": True,
                    "temperature": s.temperature,
                    "n_samples_per_prompt": s.group,
                    "ppo_mini_batch_size": s.minibatch,
                    "ppo_epochs": s.epochs,
                    "clip_ratio": s.epsilon,
                    "clip_ratio_high": s.epsilon_high,
                }
            },
            "algorithm": algorithm,
        }
    )
    assert cfg.algorithm.loss_type == "bnpo" and cfg.algorithm.kl_penalty == "kl"  # OpenRLHF's token mean, k1
    engine = TrainerEngine(cfg, device="cpu")
    grads = capture_optimizer_grads(engine)
    cap: dict = {"losses": []}
    orig_adv, orig_loss = rlhf.algo.openrlhf_advantages, rlhf.algo.grpo_loss

    def adv_spy(*a, **k):
        out = orig_adv(*a, **k)
        cap["advantages"] = out[0].clone()
        return out

    def loss_spy(*a, **k):
        loss, stats = orig_loss(*a, **k)
        cap["losses"].append(loss.detach().clone())
        cap.setdefault("old", a[1].clone())
        return loss, stats

    monkeypatch.setattr(rlhf.algo.critic_free, "openrlhf_advantages", adv_spy)  # called by critic_free_advantages
    monkeypatch.setattr(rlhf.algo.critic_free, "grpo_loss", loss_spy)  # called by critic_free_micro_loss
    engine.step(experiences(prompts, completions, scores, refs))
    cap["grads"] = grads
    return cap


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_engine_matches_openrlhf(setting: Setting, seed: int, tmp_path, monkeypatch, parity_report):
    s = setting
    gen = torch.Generator().manual_seed(4000 + seed)
    n_rows = s.group * s.prompts
    models = build_models(seed)
    prompts = make_prompts(gen, s.prompts, 4, 4)
    raw, _ = make_responses(gen, n_rows, 6)
    completions = [truncate_after_eos(r) for r in raw.tolist()]
    scores = torch.randn(n_rows, generator=gen).tolist()
    refs = [
        reference_logprobs(models.behaviour, prompts[i // s.group], c, s.temperature) for i, c in enumerate(completions)
    ]  # a reference != the policy: the KL is not ~0
    model_dir = save_pretrained(models.fresh().policy, tmp_path / "policy")
    oracle = openrlhf_run(s, models.fresh().policy.train(), prompts, completions, scores, refs)
    ours = run_engine(s, model_dir, prompts, completions, scores, refs, monkeypatch)
    cmp = Comparison(
        f"OpenRLHF {s.name} seed={seed}", prefix=f"openrlhf {s.estimator} [{s.name}] ", report=parity_report
    )
    mask = oracle["mask"]
    first_mb = slice(0, s.minibatch)
    cmp.add("old_logprobs (first minibatch)", ours["old"], oracle["old"][first_mb], TENSOR_TOL, mask=mask[first_mb])
    whitened = s.estimator != "rloo"
    cmp.add(
        "advantages" + (" (whitened)" if whitened else ""),
        ours["advantages"],
        oracle["advantages"],
        WHITENED_TOL if whitened else TENSOR_TOL,
        rtol=1e-4 if whitened else 0.0,
        mask=mask,
    )
    assert len(ours["losses"]) == len(oracle["losses"]) == s.epochs * (n_rows // s.minibatch)
    # The gradient of the first step only: the oracle's forward rounds differently from the engine's (log_softmax then
    # gather, ~5e-7 per log-prob), and AdamW turns the resulting 1e-9 differences in near-zero gradient entries into
    # steps of a fraction of the learning rate, so later gradients may differ by ~1e-5 in a few entries. The losses of
    # every step are compared.
    worst_grad(cmp, "[0]", ours["grads"][0], oracle["grads"][0], GRAD_ATOL, GRAD_RTOL)
    for step, (lo, lt) in enumerate(zip(ours["losses"], oracle["losses"], strict=True)):
        cmp.add(f"loss[{step}]", lo, lt, LOSS_TOL)
    cmp.check()
