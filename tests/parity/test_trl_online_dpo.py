"""Online DPO parity: TRL 1.12.0 ``OnlineDPOTrainer.training_step`` vs ``rlhf.algo``, number for number.

Path A is TRL's own ``training_step`` (ALGORITHMS.md sections 2 and 6.2) with ``_generate`` replaced by a function
that returns fixed completions (truncated after the first EOS by TRL's ``truncate_right``, as ``_generate`` does)
and a callable reward that returns fixed scores. Path B recomputes the per-token log-probs, the chosen/rejected
choice (``select_chosen_rejected``), the loss (``dpo_loss``) and every logged statistic from the same weights.

TRL's online DPO runs the model as ``model(ids, attention_mask=mask)``: default position ids ``0..T-1`` that count
left pads, unlike PPO's ``forward``. The prompts here all have the same length, so there is no left padding and
``rlhf.models.causal_lm_logits`` gives the same numbers on every token the loss uses (checked below). Past the EOS the
two conventions give the pad slots different positions, and TRL's ``objective/kl`` and ``objective/entropy`` sum
over those slots too, so the per-token log-probs of Path B come from the same plain call TRL makes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from datasets import Dataset
from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from trl.experimental.utils import truncate_right

from rlhf.algo import (
    dpo_loss,
    logprobs_from_logits,
    masked_sum,
    select_chosen_rejected,
    sequence_lengths,
    truncate_at_stop,
)
from rlhf.config import parse_config
from rlhf.models import causal_lm_logits
from services.trainer.engine import TrainerEngine
from tests.parity.parity_support import (
    EOS,
    PAD,
    TRL_CPU_ARGS,
    Comparison,
    build_models,
    build_tokenizer,
    capture_optimizer_grads,
    experiences,
    left_pad,
    make_prompts,
    make_responses,
    save_pretrained,
    truncate_after_eos,
    worst_grad,
)


@dataclass(frozen=True)
class ODPOSetting:
    name: str
    num_prompts: int
    prompt_length: int
    completion_length: int
    beta: float
    loss_type: str
    missing_eos_penalty: float | None


SETTINGS = [
    ODPOSetting(
        "sigmoid_eos_penalty",
        num_prompts=4,
        prompt_length=4,
        completion_length=6,
        beta=0.1,
        loss_type="sigmoid",
        missing_eos_penalty=1.0,
    ),
    ODPOSetting(
        "ipo", num_prompts=6, prompt_length=3, completion_length=7, beta=0.5, loss_type="ipo", missing_eos_penalty=None
    ),
]

LOGPROB_TOL = 1e-5
SUM_TOL = 1e-4  # per-sequence sums over tokens
LOSS_TOL = 1e-6
STAT_TOL = 1e-6
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4


@dataclass
class Case:
    setting: ODPOSetting
    seed: int
    prompts: list[list[int]]  # equal length: no left padding (see the module docstring)
    completions: torch.Tensor  # (2B, L) raw, block layout [p0..pB-1, p0..pB-1], no pad inside
    scores: torch.Tensor  # (2B,) what the reward function returns


def make_case(setting: ODPOSetting, seed: int) -> Case:
    gen = torch.Generator().manual_seed(1000 + seed)
    n_prompts = setting.num_prompts
    prompts = make_prompts(gen, n_prompts, setting.prompt_length, setting.prompt_length)
    completions, cases = make_responses(gen, 2 * n_prompts, setting.completion_length)
    scores = torch.randn(2 * n_prompts, generator=gen)
    # a tie (both samples of prompt 0 end in EOS, so the penalty keeps it): TRL then chooses the first sample
    assert "eos" in cases[0] and "eos" in cases[n_prompts]
    scores[n_prompts] = scores[0]
    return Case(setting=setting, seed=seed, prompts=prompts, completions=completions, scores=scores)


# ---------------------------------------------------------------------------------------------------------------------
# Path A: TRL's OnlineDPOTrainer.training_step


def run_trl(case: Case, models, tmp_path) -> dict:
    s = case.setting
    m = models.fresh()
    tok = build_tokenizer()
    texts = [tok.decode(p) for p in case.prompts]
    cap: dict = {"forward": []}

    def fixed_generate(model, prompts, images=None):
        assert list(prompts) == texts
        prompt_ids = left_pad(case.prompts).repeat(2, 1)  # block layout, as _generate's .repeat(2, 1)
        completion_ids, completion_mask = truncate_right(case.completions, tok.eos_token_id, tok.pad_token_id)
        cap["generate"] = (prompt_ids, completion_ids, completion_mask)
        return prompt_ids, (prompt_ids != tok.pad_token_id).long(), completion_ids, completion_mask

    def fixed_reward(prompts, completions, completion_ids, **kwargs):
        assert completion_ids == cap["generate"][1].tolist()
        return case.scores.tolist()

    args = OnlineDPOConfig(
        output_dir=str(tmp_path / "trl_odpo"),
        seed=case.seed,
        per_device_train_batch_size=s.num_prompts,
        gradient_accumulation_steps=1,
        beta=s.beta,
        loss_type=s.loss_type,
        missing_eos_penalty=s.missing_eos_penalty,
        max_new_tokens=s.completion_length,
        max_length=512,
        learning_rate=1e-3,
        **TRL_CPU_ARGS,
    )
    trainer = OnlineDPOTrainer(
        model=m.policy,
        ref_model=m.ref,
        reward_funcs=fixed_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tok,
    )
    trainer._generate = fixed_generate
    orig_forward = trainer._forward

    def forward_spy(*a, **k):
        out = orig_forward(*a, **k)
        cap["forward"].append(out.detach().clone())  # policy first, then the reference
        return out

    trainer._forward = forward_spy
    orig_rewards = trainer._calculate_rewards_from_functions

    def rewards_spy(*a, **k):
        out = orig_rewards(*a, **k)
        cap["rewards"] = out  # the same tensor training_step then penalises in place: read after the step
        return out

    trainer._calculate_rewards_from_functions = rewards_spy
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.training_step(trainer.model, {"prompt": texts})
    assert len(cap["forward"]) == 2
    cap["rewards"] = cap["rewards"].clone()
    cap["loss"] = loss.item()
    cap["stats"] = {k: v[-1] for k, v in trainer.stats.items()}
    cap["grads"] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return cap


# ---------------------------------------------------------------------------------------------------------------------
# Path B: ours


def online_dpo_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """TRL online DPO's model call: the pad/EOS mask, default position ids (see the module docstring)."""
    return model(input_ids=ids, attention_mask=(ids != PAD).long()).logits


def run_ours(case: Case, models) -> dict:
    s = case.setting
    m = models.fresh()
    n_prompts = s.num_prompts
    prompt_ids = left_pad(case.prompts).repeat(2, 1)
    ctx = prompt_ids.shape[1]
    completions = truncate_at_stop(case.completions, EOS, PAD)
    ell = sequence_lengths(completions, PAD)
    mask = torch.arange(completions.shape[1])[None, :] <= ell[:, None]  # through the EOS
    contains_eos = (completions == EOS).any(1)
    ids = torch.cat([prompt_ids, completions], 1)

    policy = m.policy.train()
    logprobs = logprobs_from_logits(online_dpo_logits(policy, ids)[:, ctx - 1 : -1], completions)  # no temperature
    with torch.no_grad():
        ref_logprobs = logprobs_from_logits(online_dpo_logits(m.ref, ids)[:, ctx - 1 : -1], completions)
        # the project's forward (PPO convention) on the same batch: equal on every token through the EOS
        project_logprobs = logprobs_from_logits(causal_lm_logits(m.ref, ids, PAD)[:, ctx - 1 : -1], completions)

    scores = case.scores.clone()
    if s.missing_eos_penalty is not None:
        scores = scores - s.missing_eos_penalty * (~contains_eos).float()
    chosen, rejected = select_chosen_rejected(scores, n_prompts)
    sums = masked_sum(logprobs, mask, dim=1)  # sums over completion tokens, EOS included (not means; IPO too)
    ref_sums = masked_sum(ref_logprobs, mask, dim=1)
    loss, stats = dpo_loss(
        sums[chosen], sums[rejected], ref_sums[chosen], ref_sums[rejected], beta=s.beta, loss_type=s.loss_type
    )
    loss.backward()

    with torch.no_grad():
        # TRL's objective/* statistics run over every completion slot, pads included (no mask)
        kl = logprobs - ref_logprobs
        non_score_reward = (-s.beta * kl).sum(1)
        metrics = {
            "loss": loss.item(),
            **{k: v.item() for k, v in stats.items()},
            "objective/kl": kl.sum(1).mean().item(),
            "objective/entropy": (-logprobs.sum(1)).mean().item(),
            "objective/non_score_reward": non_score_reward.mean().item(),
            "objective/rlhf_reward": (scores + non_score_reward).mean().item(),
            "objective/scores": scores.mean().item(),
            "objective/scores_margin": (scores[chosen] - scores[rejected]).mean().item(),
            "val/contain_eos_token": contains_eos.float().mean().item(),
        }
    return {
        "prompt_ids": prompt_ids,
        "completions": completions,
        "mask": mask,
        "logprobs": logprobs.detach(),
        "ref_logprobs": ref_logprobs,
        "project_logprobs": project_logprobs,
        "sums": sums.detach(),
        "ref_sums": ref_sums,
        "scores": scores,
        "chosen": chosen,
        "rejected": rejected,
        "metrics": metrics,
        "grads": {n: p.grad for n, p in policy.named_parameters() if p.grad is not None},
    }


# ---------------------------------------------------------------------------------------------------------------------


def compare(case: Case, trl: dict, ours: dict, report: dict) -> Comparison:
    s = case.setting
    n_prompts = s.num_prompts
    cmp = Comparison(f"online DPO {s.name} seed={case.seed}", prefix="online_dpo ", report=report)
    prompt_ids, completion_ids, completion_mask = trl["generate"]
    cmp.exact("prompt_ids", ours["prompt_ids"], prompt_ids)
    cmp.exact("completion_ids (truncated)", ours["completions"], completion_ids)
    cmp.exact("completion_mask", ours["mask"], completion_mask)

    t_lp, t_ref = trl["forward"]
    cmp.add("logprobs (all slots)", ours["logprobs"], t_lp, LOGPROB_TOL)
    cmp.add("ref_logprobs (all slots)", ours["ref_logprobs"], t_ref, LOGPROB_TOL)
    cmp.add("rlhf.models logprobs (through EOS)", ours["project_logprobs"], t_ref, LOGPROB_TOL, mask=ours["mask"])

    cmp.add("scores (after EOS penalty)", ours["scores"], trl["rewards"], STAT_TOL)
    # TRL's chosen/rejected rows: its own rule (ties choose the first sample) applied to its own rewards
    first, second = trl["rewards"].split(n_prompts)
    take_first = first >= second
    t_chosen = torch.arange(n_prompts) + (~take_first) * n_prompts
    t_rejected = torch.arange(n_prompts) + take_first * n_prompts
    cmp.exact("chosen_indices", ours["chosen"], t_chosen)
    cmp.exact("rejected_indices", ours["rejected"], t_rejected)
    trl_mask = completion_mask.bool()
    cmp.add("logprob sums", ours["sums"], (t_lp * trl_mask).sum(1), SUM_TOL)
    cmp.add("ref logprob sums", ours["ref_sums"], (t_ref * trl_mask).sum(1), SUM_TOL)

    tolerances = {
        "loss": LOSS_TOL,
        "logps/chosen": SUM_TOL,
        "logps/rejected": SUM_TOL,
        "rewards/chosen": STAT_TOL,
        "rewards/rejected": STAT_TOL,
        "rewards/margins": STAT_TOL,
        "rewards/accuracies": 0.0,
        "objective/scores": STAT_TOL,
        "objective/scores_margin": STAT_TOL,
        "objective/kl": STAT_TOL,
        "objective/entropy": SUM_TOL,  # a sum of 2B x L log-probs of about -3.5 each
        "objective/non_score_reward": STAT_TOL,
        "objective/rlhf_reward": STAT_TOL,
        "val/contain_eos_token": 0.0,
    }
    # "loss" is training_step's return value (loss / GA, GA = 1); Trainer logs it rounded to 4 decimals.
    trl_values = dict(trl["stats"], loss=trl["loss"])
    for name, tol in tolerances.items():
        cmp.add(name, ours["metrics"][name], trl_values[name], tol)

    # the gradient of the loss with respect to every policy parameter
    assert set(ours["grads"]) == set(trl["grads"]), set(ours["grads"]) ^ set(trl["grads"])
    worst = max(trl["grads"], key=lambda n: float((ours["grads"][n] - trl["grads"][n]).abs().max()))
    cmp.add("grad (worst parameter)", ours["grads"][worst], trl["grads"][worst], GRAD_ATOL, rtol=GRAD_RTOL)
    return cmp


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_online_dpo_matches_trl(setting: ODPOSetting, seed: int, tmp_path, parity_report):
    case = make_case(setting, seed)
    models = build_models(seed)
    trl = run_trl(case, models, tmp_path)
    ours = run_ours(case, models)
    compare(case, trl, ours, parity_report).check()


# ---------------------------------------------------------------------------------------------------------------------
# the trainer's real update path: TrainerEngine.step with stage ray_online_dpo, sampling temperature != 1

ENGINE_TEMPERATURE = 0.9  # TRL's default sampling temperature; its online DPO never divides the logits by it


def run_engine(case: Case, model_dir: str, trl_ref: torch.Tensor) -> dict:
    """The experience records carry TRL's reference log-probs (at temperature 1, as TRL computes them): the reference
    service is an input of the trainer here."""
    s = case.setting
    n_prompts = s.num_prompts
    cfg = parse_config(
        {
            "training": {"stage": "ray_online_dpo", "device": "cpu", "lr": 1e-3, "seed": case.seed, "clip_grad": 0.0},
            "actor_rollout_ref": {
                "actor_rollout": {
                    "load": model_dir,
                    "do_sample": True,
                    "temperature": ENGINE_TEMPERATURE,
                    "n_samples_per_prompt": 2,
                    "ppo_mini_batch_size": 2 * n_prompts,
                }
            },  # TRL: one step on every pair
            "algorithm": {
                "dpo_beta": s.beta,
                "dpo_loss_type": s.loss_type,
                "missing_eos_penalty": s.missing_eos_penalty or 0.0,
            },
        }
    )
    engine = TrainerEngine(cfg, device="cpu")
    assert engine.temperature == ENGINE_TEMPERATURE
    grads = capture_optimizer_grads(engine)
    rows = [truncate_after_eos(r) for r in case.completions.tolist()]
    order = [
        i for j in range(n_prompts) for i in (j, n_prompts + j)
    ]  # each prompt's record holds its two samples, first then second
    completions = [rows[i] for i in order]
    refs = [trl_ref[i, : len(rows[i])].tolist() for i in order]
    metrics = engine.step(experiences(case.prompts, completions, case.scores[order].tolist(), refs))
    return {"metrics": metrics, "grads": grads[0]}


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_online_dpo_engine_matches_trl(setting: ODPOSetting, seed: int, tmp_path, parity_report):
    case = make_case(setting, seed)
    models = build_models(seed)
    # the perturbed policy as the reference: at the first step policy != reference, so no margin is 0 up to rounding
    models = dataclasses.replace(models, ref=models.behaviour)
    model_dir = save_pretrained(models.fresh().policy, tmp_path / "policy")
    trl = run_trl(case, models, tmp_path)
    ours = run_engine(case, model_dir, trl["forward"][1])
    m, t = ours["metrics"], dict(trl["stats"], loss=trl["loss"])
    title = f"online DPO engine {setting.name} T={ENGINE_TEMPERATURE} seed={seed}"
    cmp = Comparison(title, prefix=f"online_dpo engine {setting.loss_type} ", report=parity_report)
    # IPO squares x - 1/(2 beta), x a difference of sums of ~20 log-probs: the engine's forward (explicit position ids,
    # section 7.5) and TRL's plain call differ by ~5e-7 per token, ~2e-6 per sum, so the loss and the gradient (both
    # scale with 2|x - 1/(2 beta)|) get an absolute 1e-5 there; the sigmoid loss keeps section 6.4's 1e-6.
    ipo = setting.loss_type == "ipo"
    cmp.add("loss", m["loss/dpo"], t["loss"], 1e-5 if ipo else LOSS_TOL)
    for name, tol in (
        ("rewards/chosen", STAT_TOL),
        ("rewards/rejected", STAT_TOL),
        ("rewards/margins", STAT_TOL),
        ("rewards/accuracies", 0.0),
        ("logps/chosen", SUM_TOL),
        ("logps/rejected", SUM_TOL),
        ("objective/scores_margin", STAT_TOL),
    ):
        cmp.add(name, m[name], t[name], tol)
    worst_grad(cmp, "", ours["grads"], trl["grads"], 1e-5 if ipo else GRAD_ATOL, GRAD_RTOL)
    cmp.check()
