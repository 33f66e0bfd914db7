"""On-policy distillation through the trainer: the student samples, a teacher scores each sampled token (as the
reference service would), and the per-token advantage teacher - student log-prob pulls the student towards the
teacher. Measured: the exact reverse KL, KL(student || teacher) over the whole vocabulary at the positions of fresh
student samples, falls.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.algo import logprobs_from_logits
from rlhf.config import parse_config
from rlhf.models import causal_lm_logits, load_tokenizer
from rlhf.preflight import check
from rlhf.tiny import TinySpec, build_tokenizer
from rlhf.v1 import experience_pb2
from services.trainer.engine import TrainerEngine
from tests.support import make_experiences, make_sample
from tests.support.sampling import actor_samples

PROMPTS = [[2, 100 + i, 200 + i] for i in range(8)]
NEW_TOKENS = 6
TEACHER_TEXT = "one two three four five six seven eight nine ten " * 3


@pytest.fixture(scope="module")
def teacher_dir(tiny_models, tmp_path_factory):
    """The tiny policy fine-tuned for 20 steps on a counting text: a teacher that differs from the student (which
    starts as the tiny policy itself; exact reverse KL about 1.5 nats per token), saved as the reference service
    would load it."""
    out = tmp_path_factory.mktemp("teacher") / "teacher"
    shutil.copytree(tiny_models.policy, out)
    tok = load_tokenizer(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([tok.encode(TEACHER_TEXT)])
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(20):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out, safe_serialization=True)
    return out


def _config(teacher, **distill):
    return parse_config(
        {
            "training": {"stage": "ray_grpo", "device": "cpu", "lr": 2e-2, "seed": 7, "clip_grad": 1.0},
            "actor_rollout_ref": {
                "actor_rollout": {"n_samples_per_prompt": 4, "ppo_mini_batch_size": 32, "temperature": 1.0},
                "ref": {"load": str(teacher)},
            },
            "algorithm": {"distill": {"coef": 1.0, **distill}},
        }
    )


def _without_pad(model, pad_id: int):
    """Take the pad token out of the model's output distribution (logit -1e4: probability 0, finite log-prob).

    The tiny policy's pad is an ordinary output row, and every stage's mask ends a response at its first pad
    without training that token. Distillation's advantages are all negative at first (the student's log-probs are
    below the teacher's on its own samples), and each pushes the sampled token down and every other up; pad, never
    trained down, would soak up the mass (measured: 13% of it after 16 steps) and the student would learn to stop
    early instead of to match the teacher. A real tokenizer's pad is not produced by the model."""
    model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: out.index_fill(-1, torch.tensor([pad_id], device=out.device), -1e4)
    )
    return model


def _samples(engine: TrainerEngine, n: int) -> torch.Tensor:
    """(prompts x n, prompt + NEW_TOKENS) token ids sampled from the student at temperature 1."""
    return actor_samples(engine, torch.tensor([p for p in PROMPTS for _ in range(n)]), NEW_TOKENS)


def _records(engine: TrainerEngine, teacher, n: int = 4, score=lambda ids: 0.0) -> list[experience_pb2.Experience]:
    """One experience record per prompt: the student's samples with the teacher's log-probs of every sampled token
    as ``ref_logprobs`` (what the reference service returns when it runs the teacher)."""
    out = _samples(engine, n)
    ctx = len(PROMPTS[0])
    with torch.no_grad():
        teacher_lp = logprobs_from_logits(causal_lm_logits(teacher, out, engine.pad_id)[:, ctx - 1 : -1], out[:, ctx:])
    samples = []
    for ids, ref in zip(out[:, ctx:].tolist(), teacher_lp.tolist(), strict=True):
        samples.append(make_sample(ids, ref_logprobs=ref, score=score(ids), policy_version=engine.policy_version))
    return make_experiences(PROMPTS, samples)


def _exact_reverse_kl(engine: TrainerEngine, teacher) -> float:
    """KL(student || teacher) over the vocabulary, averaged over the response positions of fresh student samples (the
    exact per-position KL, not the one-sample estimate the trainer logs)."""
    torch.manual_seed(1234)  # the same prompts and sampling noise for every measurement
    out = _samples(engine, 8)
    ctx = len(PROMPTS[0])
    with torch.no_grad():
        s = torch.log_softmax(causal_lm_logits(engine.actor, out, engine.pad_id)[:, ctx - 1 : -1].float(), -1)
        t = torch.log_softmax(causal_lm_logits(teacher, out, engine.pad_id)[:, ctx - 1 : -1].float(), -1)
    return (s.exp() * (s - t)).sum(-1).mean().item()


def test_distillation_lowers_the_students_reverse_kl_to_the_teacher(teacher_dir):
    torch.manual_seed(0)
    engine = TrainerEngine(_config(teacher_dir))
    assert engine.cfg.algorithm.kl_ctrl.kl_coef == 0.0  # the reference is the teacher: no KL penalty besides
    _without_pad(engine.actor, engine.pad_id)
    teacher = _without_pad(AutoModelForCausalLM.from_pretrained(teacher_dir).eval(), engine.pad_id)
    before = _exact_reverse_kl(engine, teacher)
    torch.manual_seed(0)
    logged = [engine.step(_records(engine, teacher))["distill/reverse_kl"] for _ in range(16)]
    after = _exact_reverse_kl(engine, teacher)
    print(f"exact KL(student || teacher): {before:.3f} -> {after:.3f}; logged per step: {logged}")
    # measured: 1.46 -> 0.53 nats per token; logged 1.49, 1.56, 1.53 ... 0.58, 0.59, 0.51 (other training seeds:
    # 0.56 and 0.52, logged last three 0.45-0.59)
    assert after < 0.5 * before, (before, after)
    # the trainer's own estimate on each step's fresh samples falls with it
    assert sum(logged[-3:]) / 3 < 0.5 * sum(logged[:3]) / 3, logged


def test_pure_distillation_ignores_the_score_and_reward_coef_adds_the_task_advantage(teacher_dir):
    """reward_coef 0: the scores change nothing; reward_coef > 0: they move the update (through the stage's group
    advantage)."""
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    torch.manual_seed(0)
    probe = TrainerEngine(_config(teacher_dir))
    records = _records(probe, teacher)
    rescored = [experience_pb2.Experience.FromString(e.SerializeToString()) for e in records]
    for e in rescored:
        for i, s in enumerate(e.samples):
            s.score = float(i)  # a spread within every group: nonzero group advantages

    def weights_after(recs, **distill):
        torch.manual_seed(0)
        engine = TrainerEngine(_config(teacher_dir, **distill))
        metrics = engine.step(recs)
        return [p.detach().clone() for p in engine.actor.parameters()], metrics

    base, m0 = weights_after(records)
    same, _ = weights_after(rescored)
    mixed, m1 = weights_after(rescored, reward_coef=1.0)
    assert all(torch.equal(p, q) for p, q in zip(base, same, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(base, mixed, strict=True))
    assert m0["distill/reverse_kl"] == pytest.approx(m1["distill/reverse_kl"])


def test_a_teacher_with_another_tokenizer_is_refused_at_start(tiny_models, tmp_path):
    teacher = tmp_path / "other-teacher"
    shutil.copytree(tiny_models.policy, teacher)
    build_tokenizer(TinySpec(seed=1)).save_pretrained(teacher)  # BPE merges learnt on another corpus
    with pytest.raises(ValueError, match="another tokenizer") as err:
        TrainerEngine(_config(teacher))
    assert str(teacher) in str(err.value) and "tiny:policy" in str(err.value)


def test_preflight_reports_a_teacher_with_another_tokenizer(tiny_models, tmp_path):
    teacher = tmp_path / "other-teacher"
    shutil.copytree(tiny_models.policy, teacher)
    build_tokenizer(TinySpec(seed=1)).save_pretrained(teacher)
    problems = check(_config(teacher)).problems
    assert any("another tokenizer" in p and str(teacher) in p for p in problems), problems
    same = tmp_path / "same-teacher"
    shutil.copytree(tiny_models.policy, same)
    assert not [p for p in check(_config(same)).problems if "tokenizer" in p]
