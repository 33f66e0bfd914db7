"""PPO parity: TRL 1.12.0 ``PPOTrainer.train()`` vs ``rlhf.algo`` + ``rlhf.models``, number for number.

Path A runs TRL's own trainer on fixed responses (ALGORITHMS.md section 6.2): ``batch_generation`` is replaced by a
function that returns the fixed responses and, as "generation scores", the temperature-scaled logits of a full
forward of a perturbed behaviour policy, so the old log-probs differ from the policy's and the ratio is not 1.
TRL's intermediate tensors are read without changing its code: the rollout tensors from ``train``'s own locals at
the moment it logs, whitening inputs/outputs by wrapping ``masked_whiten``, the per-minibatch ``pg_loss`` and
``vf_loss`` by wrapping ``masked_mean``, the training log-probs by wrapping ``selective_log_softmax``.

Path B computes the same from the same initial weights with our code only: ``rlhf.models`` forwards,
``rlhf.algo.ppo_rollout`` and an update loop over the same minibatch permutation (GA = 1, one AdamW over policy and
value parameters, ``loss = pg_loss + vf_coef * vf_loss``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import trl.experimental.ppo.ppo_trainer as trl_ppo
from datasets import Dataset
from trl.experimental.ppo import PPOConfig, PPOTrainer

from rlhf.algo import (
    entropy_from_logits,
    gae,
    kl_penalized_rewards,
    logprobs_from_logits,
    ppo_policy_loss,
    ppo_rollout,
    rollout_metrics,
    sequence_lengths,
    truncate_at_stop,
    value_loss,
)
from rlhf.lora import wrap_lora
from rlhf.models import causal_lm_logits, score_head_outputs
from tests.parity.parity_support import (
    EOS,
    PAD,
    Comparison,
    build_models,
    build_tokenizer,
    left_pad,
    make_prompts,
    make_responses,
    permutations,
)


@dataclass(frozen=True)
class PPOSetting:
    name: str
    batch: int  # rollout rows = per_device_train_batch_size (GA = 1, one process)
    response_length: int
    num_mini_batches: int
    epochs: int
    kl_estimator: str
    whiten_rewards: bool
    missing_eos_penalty: float | None
    temperature: float
    kl_coef: float
    cliprange: float
    cliprange_value: float
    vf_coef: float
    gamma: float
    lam: float
    lr: float


SETTINGS = [
    # 4 minibatches of 2 rows x 2 epochs = 8 optimizer steps; TRL's default-ish coefficients.
    PPOSetting(
        "k1_4mb_2ep",
        batch=8,
        response_length=6,
        num_mini_batches=4,
        epochs=2,
        kl_estimator="k1",
        whiten_rewards=False,
        missing_eos_penalty=1.0,
        temperature=0.7,
        kl_coef=0.05,
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        gamma=1.0,
        lam=0.95,
        lr=1e-3,
    ),
    # reward whitening needs local_mini_batch_size >= 8 (TRL asserts it): 16 rows in 2 minibatches, 3 epochs.
    PPOSetting(
        "k3_whiten_2mb_3ep",
        batch=16,
        response_length=7,
        num_mini_batches=2,
        epochs=3,
        kl_estimator="k3",
        whiten_rewards=True,
        missing_eos_penalty=0.5,
        temperature=1.0,
        kl_coef=0.2,
        cliprange=0.1,
        cliprange_value=0.15,
        vf_coef=0.5,
        gamma=0.99,
        lam=0.9,
        lr=5e-4,
    ),
]

# train() locals read when it logs (after the rollout and the update loop, before it deletes them).
TRAIN_LOCALS = (
    "query_responses",
    "responses",
    "postprocessed_responses",
    "logprobs",
    "ref_logprobs",
    "values",
    "scores",
    "sequence_lengths",
    "contain_eos_token",
    "padding_mask",
    "padding_mask_p1",
    "kl",
    "non_score_reward",
    "rewards",
    "actual_end",
    "advantages",
    "returns",
    "context_length",
    "approxkl_stats",
    "pg_clipfrac_stats",
    "pg_loss_stats",
    "vf_loss_stats",
    "vf_clipfrac_stats",
    "entropy_stats",
    "ratio_stats",
)


@dataclass
class Case:
    setting: PPOSetting
    seed: int
    prompts: list[list[int]]
    responses: dict[tuple[int, ...], torch.Tensor]  # prompt -> its fixed raw response (no pad inside)
    perms: list[list[int]]  # minibatch shuffle per epoch, shared by both paths


def make_case(setting: PPOSetting, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    prompts = make_prompts(gen, setting.batch, min_len=2, max_len=5)
    raw, _ = make_responses(gen, setting.batch, setting.response_length)
    return Case(
        setting=setting,
        seed=seed,
        prompts=prompts,
        responses={tuple(p): r for p, r in zip(prompts, raw, strict=True)},
        perms=permutations(seed, setting.batch, setting.epochs),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Path A: TRL's PPOTrainer.train()


def run_trl(case: Case, models, tmp_path, monkeypatch, peft_config=None) -> dict:
    """``peft_config``: TRL trains LoRA adapters on the policy, and its reference is the policy without them."""
    s = case.setting
    m = models.fresh()
    tau = s.temperature + 1e-7
    cap: dict = {"whiten": [], "pg": [], "vf": [], "selective": []}

    @torch.no_grad()
    def fixed_batch_generation(model, queries, local_rollout_forward_batch_size, pad_token_id, generation_config):
        cap["queries"] = queries.clone()
        rows = [case.responses[tuple(q[q != pad_token_id].tolist())] for q in queries]
        query_responses = torch.cat([queries, torch.stack(rows)], 1)
        ctx = queries.shape[1]
        # With do_sample, generate()'s output.scores are the raw logits / (T + 1e-7) (section 1.3); a full forward of
        # the behaviour policy replaces the KV-cached generation pass.
        logits = trl_ppo.forward(m.behaviour, query_responses, pad_token_id).logits[:, ctx - 1 : -1] / tau
        return query_responses, logits

    orig_masked_mean, orig_masked_whiten, orig_selective = (
        trl_ppo.masked_mean,
        trl_ppo.masked_whiten,
        trl_ppo.selective_log_softmax,
    )

    def masked_mean_spy(values, mask, axis=None):
        out = orig_masked_mean(values, mask, axis)
        frame = sys._getframe(1)
        if frame.f_code.co_name == "train":  # masked_whiten's internal calls come from other frames
            f = frame.f_locals
            kind = "pg" if values is f.get("pg_loss_max") else "vf" if values is f.get("vf_loss_max") else None
            if kind is not None:
                cap[kind].append(
                    {
                        "epoch": f["ppo_epoch_idx"],
                        "minibatch": f["minibatch_idx"],
                        "inds": np.asarray(f["micro_batch_inds"]).copy(),
                        # TRL: vf_loss = 0.5 * masked_mean(vf_loss_max, ~padding_mask_p1[...])
                        "loss": (out if kind == "pg" else 0.5 * out).detach().clone(),
                    }
                )
        return out

    def masked_whiten_spy(values, mask, shift_mean=True):
        out = orig_masked_whiten(values, mask, shift_mean=shift_mean)
        cap["whiten"].append({"input": values.clone(), "shift_mean": shift_mean, "output": out.clone()})
        return out

    def selective_spy(logits, index):
        out = orig_selective(logits, index)
        cap["selective"].append(out.detach().clone())
        return out

    perm_iter = iter(case.perms)

    def fixed_permutation(n):
        assert n == s.batch, n
        return np.array(next(perm_iter))

    def log_hook(logs, *args, **kwargs):
        frame = sys._getframe(1)
        assert frame.f_code.co_name == "train"
        cap["logs"] = dict(logs)
        cap["locals"] = {
            k: v.detach().clone() if torch.is_tensor(v) else v for k, v in frame.f_locals.items() if k in TRAIN_LOCALS
        }

    monkeypatch.setattr(trl_ppo, "batch_generation", fixed_batch_generation)
    monkeypatch.setattr(trl_ppo, "masked_mean", masked_mean_spy)
    monkeypatch.setattr(trl_ppo, "masked_whiten", masked_whiten_spy)
    monkeypatch.setattr(trl_ppo, "selective_log_softmax", selective_spy)
    monkeypatch.setattr(np.random, "permutation", fixed_permutation)

    args = PPOConfig(
        output_dir=str(tmp_path / "trl_ppo"),
        seed=case.seed,
        per_device_train_batch_size=s.batch,
        gradient_accumulation_steps=1,
        num_mini_batches=s.num_mini_batches,
        num_ppo_epochs=s.epochs,
        total_episodes=s.batch,  # one rollout batch, one PPO update
        local_rollout_forward_batch_size=s.batch,
        response_length=s.response_length,
        stop_token="eos",
        missing_eos_penalty=s.missing_eos_penalty,
        temperature=s.temperature,
        kl_coef=s.kl_coef,
        kl_estimator=s.kl_estimator,
        whiten_rewards=s.whiten_rewards,
        cliprange=s.cliprange,
        cliprange_value=s.cliprange_value,
        vf_coef=s.vf_coef,
        gamma=s.gamma,
        lam=s.lam,
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tok = build_tokenizer()
    ds = Dataset.from_dict({"input_ids": case.prompts})
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=m.policy,
        ref_model=None if peft_config is not None else m.ref,
        peft_config=peft_config,
        reward_model=m.reward,
        value_model=m.value,
        train_dataset=ds,
        eval_dataset=ds,  # __init__ builds an eval DataLoader unconditionally
    )
    trainer.log = log_hook
    if peft_config is not None:  # the adapters as TRL initialised them (lora_A random), for path B to start from
        cap["initial_adapter"] = {
            k: v.detach().clone() for k, v in trainer.policy_model.state_dict().items() if ".lora_" in k
        }
        cap["policy_model"] = trainer.policy_model
    trainer.train()
    assert next(perm_iter, None) is None, "TRL did not draw one permutation per epoch"
    assert "logs" in cap, "PPOTrainer.train() never logged"
    return cap


# ---------------------------------------------------------------------------------------------------------------------
# Path B: ours


def run_ours(case: Case, models, queries: torch.Tensor, lora: dict | None = None) -> dict:
    """``lora``: {"r", "alpha", "target_modules", "initial_adapter"}: the policy trains LoRA adapters (rlhf.lora)
    from TRL's initial adapter weights, and the reference is the initial policy (TRL's disabled adapters)."""
    """``queries``: the left-padded prompts in the row order TRL's dataloader produced (row order is input data)."""
    s = case.setting
    m = models.fresh()
    tau = s.temperature + 1e-7
    n_rows, ctx = queries.shape
    responses = torch.stack([case.responses[tuple(q[q != PAD].tolist())] for q in queries])
    qr = torch.cat([queries, responses], 1)

    ref_model = m.ref
    if lora is not None:
        ref_model = models.fresh().policy
        m.policy = wrap_lora(m.policy, lora["r"], lora["alpha"], lora["target_modules"])
        result = m.policy.load_state_dict(lora["initial_adapter"], strict=False)
        assert not result.unexpected_keys and not [k for k in result.missing_keys if ".lora_" in k]
    with torch.no_grad():
        old = logprobs_from_logits(causal_lm_logits(m.behaviour, qr, PAD)[:, ctx - 1 : -1], responses, tau)
        ref = logprobs_from_logits(causal_lm_logits(ref_model, qr, PAD)[:, ctx - 1 : -1], responses, tau)
        values = score_head_outputs(m.value, qr, PAD)[:, ctx - 1 : -1]
        post = truncate_at_stop(responses, EOS, PAD)
        ell = sequence_lengths(post, PAD)
        # the reward model's output at the last kept token (C - 1, the last prompt token, for an empty response)
        raw_scores = score_head_outputs(m.reward, torch.cat([queries, post], 1), PAD)[torch.arange(n_rows), ctx + ell]
        roll = ppo_rollout(
            responses,
            old,
            ref,
            values,
            raw_scores,
            pad_token_id=PAD,
            eos_token_id=EOS,
            stop_token_id=EOS,
            kl_coef=s.kl_coef,
            kl_estimator=s.kl_estimator,
            gamma=s.gamma,
            lam=s.lam,
            missing_eos_penalty=s.missing_eos_penalty,
            whiten_rewards=s.whiten_rewards,
        )
        # the rewards before whitening and the score column, from the same function ppo_rollout uses
        kr = kl_penalized_rewards(
            raw_scores,
            roll.logprobs,
            roll.ref_logprobs,
            roll.sequence_lengths,
            s.kl_coef,
            kl_estimator=s.kl_estimator,
            contains_eos=roll.contains_eos,
            missing_eos_penalty=s.missing_eos_penalty,
        )
        raw_advantages, gae_returns = gae(roll.rewards, roll.values, gamma=s.gamma, lam=s.lam)

    pm, pm1 = roll.padding_mask, roll.padding_mask_p1
    policy, critic = m.policy.train(), m.value.train()
    # TRL's optimizer: transformers' default optim "adamw_torch_fused" over PolicyAndValueWrapper, i.e. one
    # torch.optim.AdamW(fused=True) over policy + value parameters; constant lr, no gradient clipping in PPO's loop.
    optimizer = torch.optim.AdamW(
        [*policy.parameters(), *critic.parameters()],
        lr=s.lr,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        fused=True,
    )
    mb_size = n_rows // s.num_mini_batches
    minibatches = []
    for epoch, perm in enumerate(case.perms):
        for mb in range(s.num_mini_batches):
            inds = torch.tensor(perm[mb * mb_size : (mb + 1) * mb_size])
            logits = causal_lm_logits(policy, qr[inds], PAD)[:, ctx - 1 : -1]
            new = logprobs_from_logits(logits, responses[inds], tau).masked_fill(pm[inds], 0.0)
            vpred = score_head_outputs(critic, qr[inds], PAD)[:, ctx - 1 : -1].masked_fill(pm1[inds], 0.0)
            pg_loss, pg_stats = ppo_policy_loss(new, roll.logprobs[inds], roll.advantages[inds], ~pm[inds], s.cliprange)
            vf_loss, vf_stats = value_loss(vpred, roll.values[inds], roll.returns[inds], ~pm1[inds], s.cliprange_value)
            loss = pg_loss + s.vf_coef * vf_loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                # Our stats are masked means over response tokens. TRL's approxkl, ratio and entropy are plain means
                # over all M * L positions, where a pad has log-ratio 0 (both log-probs INVALID_LOGPROB), hence
                # ratio 1, and still has an entropy. Rebuild TRL's numbers from our masked ones:
                n_all = pm[inds].numel()
                n_valid = (~pm[inds]).sum()
                approxkl = pg_stats["approxkl"] * n_valid / n_all
                ratio = (pg_stats["ratio"] * n_valid + (n_all - n_valid)) / n_all
                entropy = entropy_from_logits(logits, tau).mean()
                r = torch.exp(new - roll.logprobs[inds])[~pm[inds]]
                # distance of the nearest ratio / value to a clip boundary: decides whether clipfracs may differ
                pg_margin = torch.minimum((r - (1 - s.cliprange)).abs(), (r - (1 + s.cliprange)).abs()).min()
                v_shift = (vpred - roll.values[inds])[~pm1[inds]].abs()
                vf_margin = (v_shift - s.cliprange_value).abs().min()
            minibatches.append(
                {
                    "epoch": epoch,
                    "minibatch": mb,
                    "inds": inds.numpy(),
                    "pg_loss": pg_loss.detach(),
                    "vf_loss": vf_loss.detach(),
                    "pg_clipfrac": pg_stats["clipfrac"],
                    "vf_clipfrac": vf_stats["clipfrac"],
                    "approxkl": approxkl,
                    "ratio": ratio,
                    "entropy": entropy,
                    "new_logprobs": new.detach(),
                    "n_valid": int(n_valid),
                    "n_value": int((~pm1[inds]).sum()),
                    "pg_margin": float(pg_margin),
                    "vf_margin": float(vf_margin),
                }
            )

    def avg(key):
        return torch.stack([torch.as_tensor(mb[key], dtype=torch.float32) for mb in minibatches])

    metrics = rollout_metrics(roll)
    metrics.update(
        {
            "policy/approxkl_avg": avg("approxkl").mean().item(),
            "policy/clipfrac_avg": avg("pg_clipfrac").mean().item(),
            "loss/policy_avg": avg("pg_loss").mean().item(),
            "loss/value_avg": avg("vf_loss").mean().item(),
            "val/clipfrac_avg": avg("vf_clipfrac").mean().item(),
            "policy/entropy_avg": avg("entropy").mean().item(),
            "val/ratio": avg("ratio").mean().item(),
            "val/ratio_var": avg("ratio").var().item(),
        }
    )
    return {
        "responses": responses,
        "queries": queries,
        "roll": roll,
        "rewards_before_whitening": kr.rewards,
        "score_index": kr.score_index,
        "raw_advantages": raw_advantages,
        "gae_returns": gae_returns,
        "minibatches": minibatches,
        "metrics": metrics,
        "policy": policy,
    }


# ---------------------------------------------------------------------------------------------------------------------
# the comparison (tolerances: ALGORITHMS.md section 6.4)

LOGPROB_TOL = 1e-5
KL_TOL = 1e-6
TENSOR_TOL = 1e-5  # scores, values, rewards, raw advantages, returns
WHITENED_TOL = 1e-4  # abs, plus 1e-4 relative: dividing by the std amplifies rounding
LOSS_TOL = 1e-5
STAT_TOL = 1e-6  # approxkl, entropy, ratio, objective/*


def compare(case: Case, trl: dict, ours: dict, report: dict) -> Comparison:
    s = case.setting
    t = trl["locals"]
    roll = ours["roll"]
    cmp = Comparison(f"PPO {s.name} seed={case.seed}", prefix="ppo ", report=report)

    # integer / boolean bookkeeping: exact
    cmp.exact("context_length", ours["queries"].shape[1], t["context_length"])
    cmp.exact("query_responses", torch.cat([ours["queries"], ours["responses"]], 1), t["query_responses"])
    cmp.exact("postprocessed_responses", roll.responses, t["postprocessed_responses"])
    cmp.exact("sequence_lengths", roll.sequence_lengths, t["sequence_lengths"])
    cmp.exact("padding_mask", roll.padding_mask, t["padding_mask"])
    cmp.exact("padding_mask_p1", roll.padding_mask_p1, t["padding_mask_p1"])
    cmp.exact("score_index (actual_end)", ours["score_index"], t["actual_end"])
    cmp.exact("contain_eos_token", roll.contains_eos, t["contain_eos_token"])

    valid = ~t["padding_mask"]
    # per-token rollout tensors. Log-probs only where valid: TRL stores INVALID_LOGPROB = 1.0 past ell, we store 0.
    cmp.add("old_logprobs", roll.logprobs, t["logprobs"], LOGPROB_TOL, mask=valid)
    cmp.add("ref_logprobs", roll.ref_logprobs, t["ref_logprobs"], LOGPROB_TOL, mask=valid)
    cmp.add("kl", roll.kl, t["kl"], KL_TOL)
    cmp.add("non_score_reward", roll.non_score_reward, t["non_score_reward"], KL_TOL)
    cmp.add("scores (after EOS penalty)", roll.scores, t["scores"], TENSOR_TOL)
    cmp.add("values", roll.values, t["values"], TENSOR_TOL)
    whiten_calls = trl["whiten"]
    assert len(whiten_calls) == (2 if s.whiten_rewards else 1), len(whiten_calls)
    if s.whiten_rewards:
        assert whiten_calls[0]["shift_mean"] is False
        cmp.add("rewards (score placed)", ours["rewards_before_whitening"], whiten_calls[0]["input"], TENSOR_TOL)
        cmp.add("rewards (whitened)", roll.rewards, t["rewards"], WHITENED_TOL, rtol=1e-4)
    else:
        cmp.add("rewards (score placed)", roll.rewards, t["rewards"], TENSOR_TOL)
    adv_call = whiten_calls[-1]
    cmp.add("advantages (raw)", ours["raw_advantages"], adv_call["input"], TENSOR_TOL)
    cmp.add("returns", roll.returns, t["returns"], TENSOR_TOL)
    cmp.add("returns (gae)", ours["gae_returns"], t["returns"], TENSOR_TOL)
    cmp.add("advantages (whitened)", roll.advantages, t["advantages"], WHITENED_TOL, rtol=1e-4)

    # per minibatch (GA = 1: one micro-batch per minibatch, one optimizer step each)
    mbs = ours["minibatches"]
    n_steps = s.epochs * s.num_mini_batches
    assert len(mbs) == len(trl["pg"]) == len(trl["vf"]) == n_steps, (len(mbs), len(trl["pg"]), len(trl["vf"]))
    assert len(trl["selective"]) == 2 + n_steps  # old, ref, then one per micro-batch
    for mb, pg, vf, new_lp in zip(mbs, trl["pg"], trl["vf"], trl["selective"][2:], strict=True):
        e, k = mb["epoch"], mb["minibatch"]
        assert (pg["epoch"], pg["minibatch"]) == (vf["epoch"], vf["minibatch"]) == (e, k)
        tag = f"[e{e} mb{k}]"
        cmp.exact(f"minibatch_inds{tag}", mb["inds"], pg["inds"])
        cmp.add(f"new_logprobs{tag}", mb["new_logprobs"], new_lp, LOGPROB_TOL, mask=valid[mb["inds"]])
        cmp.add(f"pg_loss{tag}", mb["pg_loss"], pg["loss"], LOSS_TOL)
        cmp.add(f"vf_loss{tag}", mb["vf_loss"], vf["loss"], LOSS_TOL)
        cmp.add(f"pg_loss (stats){tag}", mb["pg_loss"], t["pg_loss_stats"][e, k, 0], LOSS_TOL)
        cmp.add(f"vf_loss (stats){tag}", mb["vf_loss"], t["vf_loss_stats"][e, k, 0], LOSS_TOL)
        # Clip fractions are counts / N and must agree exactly, unless a ratio (value) sits within rounding distance
        # of a clip boundary: then one token may fall either side (section 6.4), which is all we allow.
        pg_tol = 0.0 if mb["pg_margin"] > 1e-5 else 1.0 / mb["n_valid"]
        vf_tol = 0.0 if mb["vf_margin"] > 1e-5 else 1.0 / mb["n_value"]
        cmp.add(f"pg_clipfrac{tag}", mb["pg_clipfrac"], t["pg_clipfrac_stats"][e, k, 0], pg_tol)
        cmp.add(f"vf_clipfrac{tag}", mb["vf_clipfrac"], t["vf_clipfrac_stats"][e, k, 0], vf_tol)
        cmp.add(f"approxkl (unmasked){tag}", mb["approxkl"], t["approxkl_stats"][e, k, 0], STAT_TOL)
        cmp.add(f"ratio (unmasked){tag}", mb["ratio"], t["ratio_stats"][e, k, 0], STAT_TOL)
        cmp.add(f"entropy (unmasked){tag}", mb["entropy"], t["entropy_stats"][e, k, 0], STAT_TOL)

    # the logged metrics
    logs, ours_m = trl["logs"], ours["metrics"]
    pg_clip_tol = max(0.0 if mb["pg_margin"] > 1e-5 else 1.0 / mb["n_valid"] for mb in mbs) / n_steps
    vf_clip_tol = max(0.0 if mb["vf_margin"] > 1e-5 else 1.0 / mb["n_value"] for mb in mbs) / n_steps
    tolerances = {
        "objective/kl": STAT_TOL,
        "objective/entropy": STAT_TOL,
        "objective/non_score_reward": STAT_TOL,
        "objective/rlhf_reward": STAT_TOL,
        "objective/scores": STAT_TOL,
        "policy/approxkl_avg": STAT_TOL,
        "policy/clipfrac_avg": pg_clip_tol,
        "loss/policy_avg": LOSS_TOL,
        "loss/value_avg": LOSS_TOL,
        "val/clipfrac_avg": vf_clip_tol,
        "policy/entropy_avg": STAT_TOL,
        "val/ratio": STAT_TOL,
        "val/ratio_var": STAT_TOL,
        "val/num_eos_tokens": 0.0,
    }
    for name, tol in tolerances.items():
        assert name in logs, f"TRL did not log {name}: {sorted(logs)}"
        cmp.add(name, ours_m[name], logs[name], tol)
    return cmp


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_ppo_matches_trl(setting: PPOSetting, seed: int, tmp_path, monkeypatch, parity_report):
    case = make_case(setting, seed)
    models = build_models(seed)
    trl = run_trl(case, models, tmp_path, monkeypatch)
    # the left-padded prompts TRL's collator built, in its dataloader's (shuffled) order, must be what we would build
    queries = left_pad([case.prompts[i] for i in order_of(case.prompts, trl["queries"])])
    assert torch.equal(queries, trl["queries"])
    # the data make the comparison non-trivial: off-policy ratios, clipping, and rows without EOS (the penalty)
    assert trl["logs"]["policy/approxkl_avg"] > 1e-4 and 0 < trl["logs"]["policy/clipfrac_avg"] < 1
    assert not trl["locals"]["contain_eos_token"].all() and trl["locals"]["contain_eos_token"].any()
    ours = run_ours(case, models, queries)
    compare(case, trl, ours, parity_report).check()


def order_of(prompts: list[list[int]], queries: torch.Tensor) -> list[int]:
    index = {tuple(p): i for i, p in enumerate(prompts)}
    return [index[tuple(q[q != PAD].tolist())] for q in queries]
