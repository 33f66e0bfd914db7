"""The seeds' training options change what the trainer does, on the real tiny models: gradient accumulation,
the LR schedule, a frozen actor, PPO-ptx, reward normalisation and clipping, online DPO's minibatches, epochs and
entropy bonus, the save folders and no_load_optim / no_load_rng."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf import algo
from rlhf.config import parse_config
from rlhf.models import causal_lm_logits, score_head_outputs
from rlhf.v1 import experience_pb2
from services.trainer import optim
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.engine import TrainerEngine
from tests.support import make_experience, make_sample


def _config(stage: str = "ray_ppo", actor=None, training=None, algorithm=None, data=None, critic=None, reward=None):
    n = 2 if stage == "ray_online_dpo" else 4
    return parse_config(
        {
            **({"reward": reward} if reward else {}),
            "training": {
                "stage": stage,
                "device": "cpu",
                "lr": 1e-3,
                "seed": 3,
                "clip_grad": 0.0,
                "train_iters": 10,
                **(training or {}),
            },
            "actor_rollout_ref": {
                "actor_rollout": {"n_samples_per_prompt": n, "ppo_mini_batch_size": 8, **(actor or {})}
            },
            "critic": {"critic_mini_batch_size": 8, **(critic or {})},
            "algorithm": {"kl_ctrl": {"kl_coef": 0.01}, **(algorithm or {})},
            "data": data or {},
        }
    )


def _batch(engine: TrainerEngine, prompts: int = 2, seed: int = 0) -> list[experience_pb2.Experience]:
    """Fixed responses (random ids of varied length, no EOS) with the initial actor's reference log-probs."""
    g = torch.Generator().manual_seed(seed)
    n = engine.cfg.actor.n_samples_per_prompt if engine.stage != "ray_online_dpo" else 2
    out = []
    with torch.no_grad():
        for j in range(prompts):
            prompt = [2, 10 + j, 20 + j]
            samples = []
            for _ in range(n):
                length = int(torch.randint(3, 7, (1,), generator=g))
                resp = torch.randint(3, 500, (length,), generator=g).tolist()
                qr = torch.tensor([prompt + resp])
                ref = algo.logprobs_from_logits(causal_lm_logits(engine.actor, qr, engine.pad_id)[:, 2:-1], qr[:, 3:])[
                    0
                ].tolist()
                samples.append(make_sample(resp, ref_logprobs=ref, score=float(torch.rand(1, generator=g)) * 4 - 1))
            out.append(make_experience(f"j{seed}-{j}", prompt, samples))
    return out


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("stage", "algorithm"),
    [
        ("ray_ppo", {}),
        ("ray_grpo", {"loss_type": "grpo"}),
        ("ray_grpo", {"loss_type": "bnpo"}),
        ("ray_grpo", {"loss_type": "dapo"}),
        ("ray_rloo", {}),
        ("ray_online_dpo", {}),
    ],
)
def test_k_micro_batches_equal_one_step_on_the_whole_minibatch(tiny_models, stage, algorithm):
    grads = {}
    calls = []
    for micro in (None, 2):
        engine = TrainerEngine(
            _config(stage, algorithm=algorithm, actor={"entropy_coeff": 0.01, "micro_batch_size": micro})
        )
        step = engine.actor_opt.step
        engine.actor_opt.step = lambda s=step, e=engine, m=micro: (
            grads.setdefault(m, [p.grad.clone() for p in e.actor.parameters()]) and s()
        )
        if micro:
            forward = engine.logits_and_logprobs
            engine.logits_and_logprobs = lambda *a, f=forward, **k: calls.append(a[0].shape[0]) or f(*a, **k)
        engine.step(_batch(engine, prompts=4 if stage == "ray_online_dpo" else 2))
    scale = max(g.abs().max().item() for g in grads[None])
    assert scale > 0
    for g, h in zip(grads[None], grads[2], strict=True):  # the accumulated gradient is the whole minibatch's
        torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-6 * scale)
    assert calls.count(2) == 4  # 8 samples (online DPO: 4 pairs = 8 answers) in forward passes of 2 samples


@pytest.mark.parametrize(
    ("critic", "training"),
    [({"micro_batch_size": 2}, {}), ({}, {"micro_batch_size": 2})],
    ids=["critic-section", "training-default"],
)
def test_critic_micro_batches_equal_one_step_on_the_whole_minibatch(tiny_models, critic, training):
    """critic.micro_batch_size (or training.micro_batch_size, every role's default) accumulates the critic's gradient
    over micro-batches: the same gradient as one pass over the minibatch, in forward passes of 2 rows."""
    grads, calls = {}, []
    for micro in (False, True):
        engine = TrainerEngine(_config(critic=critic if micro else {}, training=training if micro else {}))
        assert engine.cfg.critic.micro_batch_size == (2 if micro else None)
        step = engine.critic_opt.step
        engine.critic_opt.step = lambda s=step, e=engine, m=micro: (
            grads.setdefault(m, [p.grad.clone() for p in e.critic.parameters()]) and s()
        )
        if micro:
            values = engine._values
            engine._values = lambda qr, ctx, f=values: calls.append(qr.shape[0]) or f(qr, ctx)
        engine.step(_batch(engine))
    scale = max(g.abs().max().item() for g in grads[False])
    assert scale > 0
    for g, h in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-6 * scale)
    assert calls.count(2) == 4  # the minibatch of 8 samples in 4 forward/backward passes of 2 (the first one reused)


def test_the_critic_sections_optimizer_fields_reach_its_adamw_clip_and_schedule(tiny_models, monkeypatch):
    critic = {
        "lr": 2e-3,
        "weight_decay": 0.05,
        "adam_beta1": 0.8,
        "adam_beta2": 0.95,
        "clip_grad": 0.5,
        "lr_decay_style": "linear",
        "lr_warmup_fraction": 0.5,
        "min_lr": 1e-4,
    }
    engine = TrainerEngine(_config(critic=critic, training={"train_iters": 4}))
    clips = []
    clip = optim.clip
    monkeypatch.setattr(optim, "clip", lambda model, max_norm: clips.append((model, max_norm)) or clip(model, max_norm))
    m = engine.step(_batch(engine))
    c, a = engine.critic_opt.param_groups[0], engine.actor_opt.param_groups[0]
    assert (c["betas"], c["weight_decay"]) == ((0.8, 0.95), 0.05)
    assert (a["betas"], a["weight_decay"]) == ((0.9, 0.999), 0.0)  # the actor keeps the training section's
    assert c["lr"] == pytest.approx(1e-3) and m["lr/actor"] == pytest.approx(1e-3)  # step 1 of 2 warm-up steps
    assert {max_norm for model, max_norm in clips if model is engine.critic} == {0.5}
    assert {max_norm for model, max_norm in clips if model is engine.actor} == {0.0}
    engine.step(_batch(engine, seed=1))
    assert c["lr"] == pytest.approx(2e-3)
    engine.state.step = 3  # the last step: linear decay ends at the critic's own min_lr
    engine.step(_batch(engine, seed=2))
    assert c["lr"] == pytest.approx(1e-4)


def test_lr_schedule_sets_each_steps_learning_rate(tiny_models):
    engine = TrainerEngine(_config(training={"train_iters": 3, "lr_decay_style": "linear", "min_lr": 0.0}))
    lrs, params = [], []
    for step in range(3):
        lrs.append(engine.step(_batch(engine, seed=step))["lr/actor"])
        params.append(_params(engine.actor))
    assert lrs == pytest.approx([1e-3, 5e-4, 0.0])
    assert engine.critic_opt.param_groups[0]["lr"] == 0.0
    assert _max_diff(params[1], params[0]) > 0 and _max_diff(params[2], params[1]) == 0.0  # lr 0: no move


def test_a_frozen_actor_does_not_change_while_the_critic_does(tiny_models):
    engine = TrainerEngine(_config(actor={"freezing_actor_steps": 1}))
    actor0, critic0 = _params(engine.actor), _params(engine.critic)
    m = engine.step(_batch(engine))
    assert m["policy/frozen"] == 1.0 and "loss/policy" not in m
    assert _max_diff(_params(engine.actor), actor0) == 0.0 and _max_diff(_params(engine.critic), critic0) > 0
    m = engine.step(_batch(engine, seed=1))
    assert m["policy/frozen"] == 0.0 and _max_diff(_params(engine.actor), actor0) > 0


def test_ptx_loss_enters_the_gradient_with_its_coefficient(tiny_models, tmp_path):
    texts = tmp_path / "sft.jsonl"
    texts.write_text('{"text": "the cat is happy"}\n{"text": "two plus two is four"}\n')
    grads = {}
    for coef in (0.5, 1.5):
        cfg = _config("ray_grpo", actor={"ptx_coef": coef}, data={"pretrain_data": str(texts)})
        engine = TrainerEngine(cfg)
        ids = engine.ptx.next_batch(8)
        engine.ptx.offset = 0
        engine.actor_opt.step = lambda: None  # read the gradient that the step would apply
        zero = sum(p.sum() for p in engine.actor.parameters()) * 0.0  # no policy term: only the ptx term is left
        engine._ptx_losses = []
        engine._actor_step(zero)
        grads[coef] = [p.grad.clone() for p in engine.actor.parameters()]
        engine.actor.zero_grad()
        algo.sft_loss(causal_lm_logits(engine.actor, ids, engine.pad_id), ids, ids != engine.pad_id).backward()
        scale = max(p.grad.abs().max().item() for p in engine.actor.parameters())
        for g, p in zip(grads[coef], engine.actor.parameters(), strict=True):
            torch.testing.assert_close(g, coef * p.grad, rtol=1e-4, atol=1e-6 * coef * scale)
    assert any(g.abs().max() > 0 for g in grads[0.5])


def test_normalised_rewards_use_the_running_statistics_and_clipping_bounds_them(tiny_models, tmp_path):
    engine = TrainerEngine(_config(algorithm={"normalize_reward": True, "reward_clip_range": [-0.5, 0.5]}))
    seen = []
    ppo = engine.ppo.update
    engine.ppo.update = lambda b: seen.append(b.scores.clone()) or ppo(b)
    b1, b2 = _batch(engine, seed=1), _batch(engine, seed=2)
    raw = [torch.tensor([s.score for e in b for s in e.samples]) for b in (b1, b2)]
    engine.step(b1)
    engine.step(b2)
    both = torch.cat(raw).double()
    assert engine.reward_moments.count == 16 and engine.reward_moments.mean == pytest.approx(both.mean().item())
    expected = ((raw[1] - both.mean()) / (both.var(unbiased=False).sqrt() + 1e-8)).clamp(-0.5, 0.5)
    torch.testing.assert_close(seen[1], expected.float(), rtol=1e-5, atol=1e-6)
    assert seen[1].min() >= -0.5 and seen[1].max() <= 0.5 and (seen[1].abs() == 0.5).any()
    save_checkpoint(tmp_path, engine, {})
    resumed = TrainerEngine(_config(algorithm={"normalize_reward": True}))
    load_checkpoint(latest_checkpoint(tmp_path), resumed)
    assert resumed.reward_moments.state() == engine.reward_moments.state()


def test_fixed_reward_statistics_normalise_with_the_given_or_the_reward_models_mean_and_std(tiny_models, tmp_path):
    def trained_on(engine, seed=1):
        seen = []
        ppo = engine.ppo.update
        engine.ppo.update = lambda b: seen.append(b.scores.clone()) or ppo(b)
        batch = _batch(engine, seed=seed)
        engine.step(batch)
        return torch.tensor([s.score for e in batch for s in e.samples]), seen[0]

    raw, seen = trained_on(TrainerEngine(_config(algorithm={"reward_norm_stats": [0.5, 2.0]})))
    assert torch.equal(seen, (raw - 0.5) / 2.0)  # fixed: no running update, no epsilon (OpenRLHF's RM)
    raw, seen = trained_on(TrainerEngine(_config(algorithm={"reward_norm_stats": [0.5, 2.0]})), seed=2)
    assert torch.equal(seen, (raw - 0.5) / 2.0)
    # reward_model: the mean and std OpenRLHF's reward-model training writes into the model's config.json
    rm = tmp_path / "rm"
    shutil.copytree(tiny_models.reward, rm)
    model_config = json.loads((rm / "config.json").read_text())
    (rm / "config.json").write_text(json.dumps({**model_config, "mean": -1.25, "std": 0.5}))
    cfg = _config(algorithm={"reward_norm_stats": "reward_model"}, reward={"load": str(rm)})
    raw, seen = trained_on(TrainerEngine(cfg))
    assert torch.equal(seen, (raw + 1.25) / 0.5)
    # a reward model trained without them: an error at start that says what to give instead
    with pytest.raises(ValueError, match=r"has no 'mean' / 'std'.*reward_norm_stats: \[mean, std\]"):
        TrainerEngine(_config(algorithm={"reward_norm_stats": "reward_model"}))


@pytest.mark.parametrize(
    ("baseline", "penalty", "expected"),
    [
        ("none", 0.0, [1.0, 3.0, -2.0, 0.5]),
        ("leave_one_out", 0.0, [-2.0, 2.0, -2.5, 2.5]),  # r(x, y) - r(x, y_ref): the prompt's other sample
        ("group_mean", 0.0, [-1.0, 1.0, -1.25, 1.25]),
        # no response has EOS: the penalty hits both samples of a prompt before the baseline, so it cancels
        ("leave_one_out", 1.0, [-2.0, 2.0, -2.5, 2.5]),
        ("none", 1.0, [0.0, 2.0, -3.0, -0.5]),
    ],
)
def test_ppo_reward_baseline_is_subtracted_from_the_scores_ppo_trains_on(
    tiny_models, monkeypatch, baseline, penalty, expected
):
    rollouts = []
    real = algo.ppo_rollout
    monkeypatch.setattr(algo, "ppo_rollout", lambda *a, **kw: rollouts.append(real(*a, **kw)) or rollouts[-1])
    algorithm = {"reward_baseline": baseline, "missing_eos_penalty": penalty}
    engine = TrainerEngine(_config(actor={"n_samples_per_prompt": 2}, algorithm=algorithm))
    batch = _batch(engine)
    for sample, score in zip([s for e in batch for s in e.samples], [1.0, 3.0, -2.0, 0.5], strict=True):
        sample.score = score
    engine.step(batch)
    (r,) = rollouts
    assert r.scores.tolist() == expected
    # the per-token rewards GAE reads: the KL penalty, plus the baselined score at the score position
    torch.testing.assert_close((r.rewards - r.non_score_reward).sum(1), torch.tensor(expected), rtol=0, atol=1e-6)


def test_online_dpo_minibatches_epochs_and_entropy_bonus(tiny_models):
    def run(**actor):
        engine = TrainerEngine(_config("ray_online_dpo", actor=actor))
        engine.step(_batch(engine, prompts=4))
        steps = int(next(iter(engine.actor_opt.state.values()))["step"])
        return steps, _params(engine.actor)

    steps, plain = run(ppo_mini_batch_size=4, ppo_epochs=2)
    assert steps == 4  # 4 pairs, 2 pairs per minibatch, 2 epochs
    assert run(ppo_mini_batch_size=8)[0] == 1
    _, shuffled = run(ppo_mini_batch_size=4, ppo_epochs=2, shuffle_minibatch=True)
    assert _max_diff(shuffled, plain) > 0
    _, bonus = run(ppo_mini_batch_size=4, ppo_epochs=2, entropy_coeff=0.5)
    assert _max_diff(bonus, plain) > 0


def test_save_folders_hold_the_trained_models_and_no_load_optim_rng(tiny_models, tmp_path):
    actor_dir, critic_dir = tmp_path / "actor-save", tmp_path / "critic-save"
    engine = TrainerEngine(_config(actor={"save": str(actor_dir)}, critic={"save": str(critic_dir)}))
    engine.step(_batch(engine))
    save_checkpoint(tmp_path / "ckpt", engine, {})
    saved = AutoModelForCausalLM.from_pretrained(actor_dir)
    for p, q in zip(engine.actor.state_dict().values(), saved.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q)
    critic = AutoModelForSequenceClassification.from_pretrained(critic_dir, num_labels=1)
    torch.testing.assert_close(critic.score.weight, engine.critic.score.weight)

    fresh = TrainerEngine(_config(training={"no_load_optim": True, "no_load_rng": True}))
    generator = fresh.generator.get_state()
    load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), fresh)
    assert fresh.step_count == 1 and not fresh.actor_opt.state and not fresh.critic_opt.state
    assert torch.equal(fresh.generator.get_state(), generator)
    full = TrainerEngine(_config())
    load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), full)
    assert full.actor_opt.state and torch.equal(full.generator.get_state(), engine.generator.get_state())


def test_tokenizer_sampling_mode_adam_settings_and_vf_coef_reach_the_engine(tiny_models, tmp_path):
    tok_dir = tmp_path / "tok"
    shutil.copytree(tiny_models.policy, tok_dir)
    (tok_dir / "model.safetensors").unlink()
    cfg = _config(
        training={"tokenizer_name_or_path": str(tok_dir), "adam_beta1": 0.8, "adam_beta2": 0.99, "weight_decay": 0.05},
        actor={"do_sample": False, "temperature": 0.7},
    )
    engine = TrainerEngine(cfg)
    assert engine.tokenizer.name_or_path == str(tok_dir)
    assert engine.temperature == 1.0  # greedy rollout: log-probs of the raw logits
    group = engine.actor_opt.param_groups[0]
    assert group["betas"] == (0.8, 0.99) and group["weight_decay"] == 0.05
    assert engine.critic_opt.param_groups[0]["betas"] == (0.8, 0.99)
    assert TrainerEngine(_config(actor={"temperature": 0.7})).temperature == 0.7

    grads = {}
    for coef in (1.0, 3.0):
        e = TrainerEngine(_config(critic={"vf_coef": coef}))
        step = e.critic_opt.step
        e.critic_opt.step = lambda s=step, e=e, c=coef: (grads.setdefault(c, e.critic.score.weight.grad.clone()), s())
        e.step(_batch(e))
    torch.testing.assert_close(grads[3.0], 3.0 * grads[1.0], rtol=1e-4, atol=1e-7)


def test_kl_penalty_full_penalises_the_whole_vocabulary_kl_to_the_reference(tiny_models):
    engine = TrainerEngine(_config(algorithm={"kl_penalty": "full", "whiten_advantages": False}))
    with torch.no_grad():  # a reference that differs from the actor, so the KL is not 0
        for p in engine.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = _batch(engine)
    rb = engine.collate(batch)
    ctx = rb.context_length
    with torch.no_grad():
        logits = causal_lm_logits(engine.actor, rb.query_responses, engine.pad_id)[:, ctx - 1 : -1]
        ref = causal_lm_logits(engine.ref_model, rb.query_responses, engine.pad_id)[:, ctx - 1 : -1]
    expected = algo.full_kl(logits, ref, engine.temperature)
    mask = rb.responses != engine.pad_id
    m = engine.step(batch)
    want = (expected * mask).sum(1).mean().item()
    assert want > 1e-3 and m["objective/kl"] == pytest.approx(want, rel=1e-4)


def test_no_load_optim_and_no_load_rng_per_role_on_resume(tiny_models, tmp_path):
    """MindSpeed's per-role keys: each role's optimizer state is restored or started afresh by its own key (default
    training's); the generators the actor and the critic share follow theirs."""
    engine = TrainerEngine(_config())
    engine.step(_batch(engine))
    engine.generator.manual_seed(99)  # a state no fresh engine starts from
    save_checkpoint(tmp_path, engine, {})
    ckpt = latest_checkpoint(tmp_path)

    actor_fresh = TrainerEngine(_config(actor={"no_load_optim": True}))
    load_checkpoint(ckpt, actor_fresh)
    assert not actor_fresh.actor_opt.state and actor_fresh.critic_opt.state
    critic_fresh = TrainerEngine(_config(critic={"no_load_optim": True}))
    load_checkpoint(ckpt, critic_fresh)
    assert critic_fresh.actor_opt.state and not critic_fresh.critic_opt.state
    # the role's own false wins over training's true (MindSpeed: role over training)
    kept = TrainerEngine(_config(training={"no_load_optim": True}, critic={"no_load_optim": False}))
    load_checkpoint(ckpt, kept)
    assert not kept.actor_opt.state and kept.critic_opt.state
    for k, v in engine.critic_opt.state_dict()["state"][0].items():
        assert torch.equal(kept.critic_opt.state_dict()["state"][0][k], v), k

    no_rng = TrainerEngine(_config(actor={"no_load_rng": True}, critic={"no_load_rng": True}))
    seeded = no_rng.generator.get_state()
    load_checkpoint(ckpt, no_rng)
    assert torch.equal(no_rng.generator.get_state(), seeded)
    rng = TrainerEngine(
        _config(training={"no_load_rng": True}, actor={"no_load_rng": False}, critic={"no_load_rng": False})
    )
    load_checkpoint(ckpt, rng)
    assert torch.equal(rng.generator.get_state(), engine.generator.get_state())


def test_bf16_per_role_sets_the_actors_and_the_critics_compute_and_the_push(tiny_models):
    qr = torch.tensor([[2, 10, 20, 30, 40, 50]])
    fp32 = TrainerEngine(_config())
    critic_bf16 = TrainerEngine(_config(critic={"bf16": True}))
    with torch.no_grad():
        v32, v16 = fp32.critic_rows(qr, 3), critic_bf16.critic_rows(qr, 3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = score_head_outputs(critic_bf16.critic, qr, critic_bf16.pad_id)[:, 2:-1].float()
        lp32 = fp32.actor_rows(qr, qr[:, 3:], 3)[0]
        lp_critic_bf16 = critic_bf16.actor_rows(qr, qr[:, 3:], 3)[0]
    assert not torch.equal(v16, v32)  # the critic computes in bf16 ...
    torch.testing.assert_close(v16, expected, rtol=0, atol=0)
    assert torch.equal(lp_critic_bf16, lp32)  # ... the actor does not
    assert {v.dtype for v in critic_bf16.policy_state_dict().values()} == {torch.float32}
    actor_bf16 = TrainerEngine(_config(actor={"bf16": True}))
    with torch.no_grad():
        assert not torch.equal(actor_bf16.actor_rows(qr, qr[:, 3:], 3)[0], lp32)
        assert torch.equal(actor_bf16.critic_rows(qr, 3), v32)
    assert {v.dtype for v in actor_bf16.policy_state_dict().values()} == {torch.bfloat16}  # pushed as bf16


def test_a_critic_with_a_device_of_its_own_trains_on_the_cpu(tiny_models):
    """resource_pool.critic [1]: on the CPU the critic's own device is the CPU (there is one); the step runs the
    same path as on an accelerator (inputs to the critic's device, values back to the actor's)."""
    own = TrainerEngine(parse_config({**_config().model_dump(exclude_unset=True), "resource_pool": {"critic": [1]}}))
    assert own.critic_device == own.device == torch.device("cpu")
    before = _params(own.critic)
    metrics = own.step(_batch(own))
    assert _max_diff(_params(own.critic), before) > 0 and math.isfinite(metrics["loss/value"])
