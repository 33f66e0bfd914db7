"""The trainer's update step on real (tiny) models: it learns, it checkpoints and resumes exactly."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rlhf.algo import logprobs_from_logits
from rlhf.config import parse_config
from rlhf.models import causal_lm_logits
from rlhf.transport.weights.format import load_safetensors
from rlhf.transport.weights.pack import BufferPool, copy_weights
from rlhf.v1 import common_pb2
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.critic_free import CriticFreeStages
from services.trainer.engine import TrainerEngine
from services.trainer.passes import TrainerPasses
from services.trainer.ppo import PPOStage
from tests.support import make_experience, make_sample
from tests.support.sampling import actor_samples


def _config(stage: str, **algorithm):
    n = 2 if stage == "ray_online_dpo" else 4
    return parse_config(
        {
            "training": {"stage": stage, "device": "cpu", "lr": 5e-3, "seed": 7, "clip_grad": 1.0},
            "actor_rollout_ref": {
                "actor_rollout": {"n_samples_per_prompt": n, "ppo_mini_batch_size": 16, "ppo_epochs": 2}
            },
            "critic": {"critic_mini_batch_size": 16, "critic_update_epochs": 2},
            "algorithm": {"kl_ctrl": {"kl_coef": 0.01}, **algorithm},
        }
    )


def _even_fraction(ids: list[int]) -> float:
    return sum(1 for t in ids if t % 2 == 0) / len(ids)


def _rollout(engine: TrainerEngine, prompts: list[list[int]], n: int, new_tokens: int = 6, ref=None):
    """Sample with the actor itself (transformers generate) and score: the fraction of even token ids.

    Reference log-probs come from ``ref`` (a frozen copy of the initial actor), as the reference service computes them.
    """
    experiences = []
    ref = ref if ref is not None else engine.actor
    with torch.no_grad():
        for j, prompt in enumerate(prompts):
            out = actor_samples(engine, torch.tensor([prompt] * n), new_tokens)
            logits = causal_lm_logits(ref, out, engine.pad_id)[:, len(prompt) - 1 : -1]
            ref_lp = logprobs_from_logits(logits, out[:, len(prompt) :])
            samples = [
                make_sample(row, ref_logprobs=row_ref, score=_even_fraction(row), policy_version=engine.policy_version)
                for row, row_ref in zip(out[:, len(prompt) :].tolist(), ref_lp.tolist(), strict=True)
            ]
            experiences.append(make_experience(f"j{j}", prompt, samples))
    return experiences


PROMPTS = [[2, 100 + i, 200 + i] for i in range(8)]


def _learns(stage: str, steps: int, **algorithm) -> tuple[float, float]:
    engine = TrainerEngine(_config(stage, **algorithm))
    ref = copy.deepcopy(engine.actor).eval()
    n = engine.cfg.actor.n_samples_per_prompt
    rewards = [engine.step(_rollout(engine, PROMPTS, n, ref=ref))["reward/mean"] for _ in range(steps)]
    return sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3


def test_ppo_raises_the_reward(tiny_models):
    torch.manual_seed(0)
    first, last = _learns("ray_ppo", 8)
    assert last > first + 0.1, (first, last)


def test_grpo_raises_the_reward(tiny_models):
    torch.manual_seed(0)
    first, last = _learns("ray_grpo", 8, adv_estimator="grpo")
    assert last > first + 0.1, (first, last)


def test_online_dpo_step_prefers_the_higher_score(tiny_models):
    engine = TrainerEngine(_config("ray_online_dpo", dpo_beta=0.5))
    batch = _rollout(engine, PROMPTS[:4], 2)
    for exp in batch:  # make the second sample of each pair the better one
        exp.samples[0].score, exp.samples[1].score = 0.0, 1.0
    m1 = engine.step(batch)
    m2 = engine.step(batch)
    assert m2["rewards/margins"] > m1["rewards/margins"]
    assert m2["loss/dpo"] < m1["loss/dpo"]


def test_failed_scores_are_dropped_not_zeroed(tiny_models):
    engine = TrainerEngine(_config("ray_grpo", adv_estimator="grpo"))
    batch = _rollout(engine, PROMPTS[:2], 4)
    batch[0].samples[0].score_status = common_pb2.ITEM_STATUS_SCORER_ERROR
    rb = engine.collate(batch)
    assert rb.responses.shape[0] == 7


def test_checkpoint_resume_is_exact(tiny_models, tmp_path):
    torch.manual_seed(0)
    engine = TrainerEngine(_config("ray_ppo"))
    engine.step(_rollout(engine, PROMPTS[:4], 4))
    save_checkpoint(tmp_path, engine, {"trained_job_ids": ["j0", "j1"], "data": {"epoch": 0, "offset": 8}})
    batch = _rollout(engine, PROMPTS[:4], 4)
    continued = engine.step(batch)

    resumed = TrainerEngine(_config("ray_ppo"))
    state = load_checkpoint(latest_checkpoint(tmp_path), resumed)
    assert state["trained_job_ids"] == ["j0", "j1"] and resumed.step_count == 1 and resumed.policy_version == 1
    again = resumed.step(batch)
    for key in ("loss/policy", "loss/value", "policy/approxkl", "objective/kl"):
        assert abs(again[key] - continued[key]) < 1e-6, key
    for p, q in zip(engine.actor.parameters(), resumed.actor.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_checkpoint_policy_loads_in_transformers(tiny_models, tmp_path):
    engine = TrainerEngine(_config("ray_grpo", adv_estimator="grpo"))
    path = save_checkpoint(tmp_path, engine, {})
    model = AutoModelForCausalLM.from_pretrained(path / "policy")
    for (name, p), q in zip(engine.actor.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    assert not (tmp_path / f"{path.name}.tmp").exists()


class _OnlyThePasses:
    """The engine seen through :class:`TrainerPasses` alone: anything else a stage reaches for is an error."""

    names = set(TrainerPasses.__annotations__) | {n for n in vars(TrainerPasses) if not n.startswith("_")}

    def __init__(self, engine: TrainerEngine):
        self._engine = engine

    def __getattr__(self, name: str):
        if name not in self.names:
            raise AttributeError(f"{name} is not in TrainerPasses")
        return getattr(self._engine, name)


@pytest.mark.parametrize(
    ("stage", "algorithm", "losses"),
    [
        ("ray_ppo", {}, ["loss/value"]),
        ("ray_ppo", {"kl_penalty": "full", "whiten_advantages": False}, ["loss/value"]),
        ("ray_grpo", {"adv_estimator": "grpo", "rejection_sampling": {"interval": 2}}, ["loss/sft", "loss/policy"]),
        ("ray_online_dpo", {}, ["loss/dpo"]),
    ],
    ids=["ppo", "ppo-full-kl", "grpo-rejection-sampling", "online-dpo"],
)
def test_the_stages_need_only_the_passes_they_are_handed(tiny_models, stage, algorithm, losses):
    engine = TrainerEngine(_config(stage, **algorithm))
    passes = _OnlyThePasses(engine)
    engine.critic_free = CriticFreeStages(passes)
    if engine.ppo is not None:
        engine.ppo = PPOStage(passes)
    n = engine.cfg.actor.n_samples_per_prompt
    for loss in losses:
        assert loss in engine.step(_rollout(engine, PROMPTS[:4], n))


def test_critic_alongside_the_actor_matches_one_after_the_other(tiny_models, monkeypatch):
    """The PPO step runs the critic's passes in a second thread, each side on half of the intra-op threads on a CPU;
    the update must be exactly the sequential one on all of them, and the caller's thread count comes back."""
    # torch's own setter: an in-process vLLM CPU worker earlier in the session replaces torch.set_num_threads with a
    # no-op for the whole process (the trainer's process never runs one); restored after the test
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    real_critic_updates = PPOStage._critic_updates

    def critic_updates(self, *args):
        seen.append((torch.get_num_threads(), threading.current_thread().name))
        return real_critic_updates(self, *args)

    monkeypatch.setattr(PPOStage, "_critic_updates", critic_updates)
    cfg = _config("ray_ppo")
    cfg.actor.ppo_mini_batch_size = cfg.critic.critic_mini_batch_size = 8  # several shuffled minibatches per epoch
    torch.manual_seed(0)
    probe = TrainerEngine(cfg)
    batches = [_rollout(probe, PROMPTS[:4], 4) for _ in range(2)]
    results = {}
    for parallel in (True, False):
        monkeypatch.setattr(PPOStage, "_parallel_critic", lambda self, p=parallel: p)
        engine = TrainerEngine(cfg)
        metrics = [engine.step(b) for b in batches]
        results[parallel] = (metrics, engine)
    after = torch.get_num_threads()
    torch.set_num_threads(threads)
    assert after == 2
    assert [n for n, _ in seen[:2]] == [1, 1] and all(name.startswith("critic") for _, name in seen[:2])
    assert [n for n, _ in seen[2:]] == [2, 2]  # one after the other: the caller's threads
    (m_par, e_par), (m_seq, e_seq) = results[True], results[False]
    assert m_par[-1]["loss/value"] != m_par[0]["loss/value"]  # the critic did learn between the steps
    for a, b in zip(m_par, m_seq, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == {
            k: v for k, v in b.items() if not k.startswith("time/")
        }
    for model in ("actor", "critic"):
        for p, q in zip(getattr(e_par, model).parameters(), getattr(e_seq, model).parameters(), strict=True):
            assert torch.equal(p, q), model


def test_reusing_the_first_minibatch_pass_matches_a_full_old_pass(tiny_models, monkeypatch):
    """The old pass covers only the rows outside the first (micro-)batch, whose update forward gives their old
    log-probs and values: the same metrics and weights as an old pass over every row, within float32 rounding, with
    fewer rows through each model. Also with micro-batches, the critic one after the actor and a frozen actor."""
    rows_seen: dict[str, int] = {}
    real_logits, real_values = TrainerEngine.logits_and_logprobs, TrainerEngine._values

    def logits(self, qr, *args, **kwargs):
        rows_seen["actor"] = rows_seen.get("actor", 0) + qr.shape[0]
        return real_logits(self, qr, *args, **kwargs)

    def values(self, qr, *args):
        rows_seen["critic"] = rows_seen.get("critic", 0) + qr.shape[0]
        return real_values(self, qr, *args)

    monkeypatch.setattr(TrainerEngine, "logits_and_logprobs", logits)
    monkeypatch.setattr(TrainerEngine, "_values", values)
    torch.manual_seed(0)
    probe = TrainerEngine(_config("ray_ppo"))
    batches = [_rollout(probe, PROMPTS[:4], 4) for _ in range(3)]  # 16 rows each
    for micro, parallel, freeze in ((None, True, 0), (4, False, 1)):
        monkeypatch.setattr(PPOStage, "_parallel_critic", lambda self, p=parallel: p)
        cfg = _config("ray_ppo")
        cfg.actor.ppo_mini_batch_size = cfg.critic.critic_mini_batch_size = 8  # 2 minibatches x 2 epochs
        cfg.actor.micro_batch_size, cfg.actor.freezing_actor_steps = micro, freeze
        results = {}
        for reuse in (True, False):
            rows_seen.clear()
            engine = TrainerEngine(cfg)
            engine.reuse_first_pass = reuse
            metrics = [engine.step(b) for b in batches]
            results[reuse] = (metrics, engine, dict(rows_seen))
        (m_new, e_new, seen_new), (m_old, e_old, seen_old) = results[True], results[False]
        # per step, without reuse: 16 old + 4 updates x 8; with it, the first (micro-)batch's rows once less
        first = micro or 8
        assert seen_old == {"actor": 3 * 48 - 32 * freeze, "critic": 3 * 48}  # a frozen step: no actor update
        assert seen_new == {"actor": 3 * (48 - first) - (32 - first) * freeze, "critic": 3 * (48 - 8)}
        assert m_new[-1]["loss/value"] != m_new[0]["loss/value"]  # it learns: the comparison is not of constants
        for a, b in zip(m_new, m_old, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                if not k.startswith("time/"):
                    assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-5), (k, a[k], b[k])
        for model in ("actor", "critic"):
            for p, q in zip(getattr(e_new, model).parameters(), getattr(e_old, model).parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=model)


def _with_training(cfg, **training):
    """``cfg`` validated again with ``training`` fields changed: the role sections take their defaults (bf16, ...)
    from the training section at validation, so a field assigned afterwards would not reach them."""
    data = cfg.model_dump(mode="json", exclude_unset=True)
    data["training"] = {**data.get("training", {}), **training}
    return parse_config(data)


def _changed_fraction(batches, bf16: bool, pure_bf16: bool = False) -> tuple[float, TrainerEngine]:
    """Fraction of actor weight elements that moved over ``batches`` at the Llama-3.2-1B configs' lr (5e-7)."""
    cfg = _with_training(_config("ray_ppo"), lr=5e-7, bf16=bf16)
    torch.manual_seed(0)
    engine = TrainerEngine(cfg)
    if pure_bf16:  # what bf16 meant before fp32 master weights: the weights themselves in bf16
        engine.actor.to(torch.bfloat16)
    before = [p.detach().clone() for p in engine.actor.parameters()]
    for batch in batches:
        engine.step(batch)
    changed = sum(int((p.detach() != q).sum()) for p, q in zip(engine.actor.parameters(), before, strict=True))
    return changed / sum(q.numel() for q in before), engine


def test_bf16_keeps_fp32_master_weights_that_learn_at_a_small_lr(tiny_models, tmp_path):
    torch.manual_seed(0)
    probe = TrainerEngine(_config("ray_ppo"))
    batches = [_rollout(probe, PROMPTS[:4], 4) for _ in range(3)]
    fp32, _ = _changed_fraction(batches, bf16=False)
    mixed, engine = _changed_fraction(batches, bf16=True)
    pure, _ = _changed_fraction(batches, bf16=False, pure_bf16=True)
    print(f"changed fraction: fp32 {fp32:.4f} bf16+master {mixed:.4f} pure bf16 {pure:.4f}")
    assert fp32 > 0.5, fp32  # rows of unused tokens get no gradient
    assert mixed > 0.9 * fp32, (mixed, fp32)
    assert pure < 0.5 * fp32, (pure, fp32)  # the control: without master weights the updates are rounded away
    # compute is bf16 (autocast), weights and optimizer state fp32
    with engine._autocast(), torch.no_grad():
        logits = causal_lm_logits(engine.actor, torch.tensor([PROMPTS[0]]), engine.pad_id)
    assert logits.dtype == torch.bfloat16
    assert {p.dtype for p in engine.actor.parameters()} == {torch.float32}
    assert {p.dtype for p in engine.critic.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in engine.actor_opt.state.values()} == {torch.float32}
    # rollout gets bf16: the master weights rounded
    pushed = engine.policy_state_dict()
    assert {v.dtype for v in pushed.values()} == {torch.bfloat16}
    for name, p in engine.actor.state_dict().items():
        assert torch.equal(pushed[name], p.to(torch.bfloat16)), name
    # checkpoints keep the fp32 master weights
    path = save_checkpoint(tmp_path, engine, {})
    with safe_open(str(path / "policy" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}  # noqa: SIM118 (safe_open is not iterable)


def test_the_push_copy_keeps_the_weights_the_next_step_changes(tiny_models):
    """The trainer copies the policy into push buckets (copy_weights) and hashes and sends them while its next step
    trains: the buckets must hold the weights of the copy's moment, not share the training weights' memory (the fp32
    CPU state dict does); buffers come back from the pool only once no push holds them."""
    engine = TrainerEngine(_config("ray_ppo"))
    live = engine.policy_state_dict()
    before = {k: v.clone() for k, v in live.items()}
    pool = BufferPool()
    packed = copy_weights(live, 1, pool=pool)
    with torch.no_grad():
        for p in engine.actor.parameters():
            p.add_(1.0)  # what an optimizer step does to the memory
    assert any(not torch.equal(live[k], before[k]) for k in live)  # the plain state dict is the live weights
    packed.seal()
    assert packed.header.checksum and len(packed.header.buckets) == len(packed.buckets)
    got = {k: v for data in packed.buckets for k, v in load_safetensors(bytes(data)).items()}
    assert got.keys() == before.keys()
    for k, v in got.items():
        assert torch.equal(v, before[k]), k
    held = [id(b) for b in packed.buckets]
    second = copy_weights(engine.policy_state_dict(), 2, pool=pool)
    assert not {id(b) for b in second.buckets} & set(held)  # the first push still holds its buffers
    del packed
    third = copy_weights(engine.policy_state_dict(), 3, pool=pool)
    assert [id(b) for b in third.buckets] == held  # free again: reused, no new memory


def test_the_push_on_device_gives_the_same_tensors_as_the_host_copy(tiny_models):
    """policy_state_dict(on_device=True), which the trainer's push copies into its buckets itself (one
    device-to-bucket copy per tensor on an accelerator), holds what the host state dict holds: the push dtype
    (bf16 under training.bf16, from the fp32 masters), the checkpoint layout, the same values, contiguous."""
    cfg = _config("ray_grpo", adv_estimator="grpo")
    engine = TrainerEngine(_with_training(cfg, bf16=True))
    host, device = engine.policy_state_dict(), engine.policy_state_dict(on_device=True)
    assert host.keys() == device.keys()
    for k, v in device.items():
        assert v.dtype == host[k].dtype == torch.bfloat16 and v.is_contiguous() and torch.equal(v, host[k]), k
    packed = copy_weights(device, 1).seal()
    got = {k: v for data in packed.buckets for k, v in load_safetensors(bytes(data)).items()}
    assert all(torch.equal(got[k], host[k]) for k in host)
