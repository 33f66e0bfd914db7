"""Padding-free passes (rlhf.packing, ``training.padding_free``) give the padded passes' results within float32
rounding: logits, values, gradients, every stage's update (losses, gradient norms, new weights) and reference
log-probs, on batches whose prompts and responses vary in length (left and right padding)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from rlhf.config import parse_config
from rlhf.models import causal_lm_logits, load_causal_lm, load_sequence_classifier, score_head_outputs
from rlhf.packing import pack, packed_attention
from rlhf.v1 import experience_pb2
from services.reference.engine import LogProbsItem, ReferenceEngine
from services.reward.engine import RewardEngine
from services.reward.scorers import Item
from services.trainer.engine import TrainerEngine
from tests.support import make_experience, make_sample

ATOL = 2e-5


def _batch(pad: int, rows: int = 6, seed: int = 0) -> torch.Tensor:
    """Left-padded prompts of 2-9 tokens, right-padded responses of 1-7 (the trainer's layout)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 9))] for _ in range(rows)]
    responses = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 7))] for _ in range(rows)]
    ctx, resp_len = max(map(len, prompts)), max(map(len, responses))
    qr = torch.full((rows, ctx + resp_len), pad, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        qr[i, ctx - len(p) : ctx] = torch.tensor(p)
        qr[i, ctx : ctx + len(r)] = torch.tensor(r)
    return qr


def test_pack_keeps_real_tokens_with_positions_per_sequence():
    qr = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 0, 0, 0], [0, 0, 4, 0, 0]])
    p = pack(qr, 0)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 4]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 6]
    assert p.flat_index.tolist() == [1, 2, 3, 5, 6, 12]


def test_packed_attention_needs_the_sequence_bounds():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packed_attention(None, q, q, q, None)


def test_packed_logits_values_and_gradients_match_padded(tiny_models):
    torch.manual_seed(0)
    model = load_causal_lm(tiny_models.policy)
    model.train()
    qr = _batch(0)
    real = qr != 0
    grads = []
    outs = []
    for packed in (False, True):
        model.zero_grad()
        logits = causal_lm_logits(model, qr, 0, packed=packed)
        (logits[real].float().pow(2).mean()).backward()
        outs.append(logits.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(outs[1][real], outs[0][real], atol=ATOL, rtol=1e-5)
    assert (outs[1][~real] == 0).all()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=ATOL, rtol=1e-4, msg=n)

    critic = load_sequence_classifier(tiny_models.reward)
    v0 = score_head_outputs(critic, qr, 0)
    v1 = score_head_outputs(critic, qr, 0, packed=True)
    torch.testing.assert_close(v1[real], v0[real], atol=ATOL, rtol=1e-5)
    # the packed pass ran with the packed attention only while it ran
    assert model.config._attn_implementation != "rlhf_packed_sdpa"


def _experiences(n: int, seed: int) -> list[experience_pb2.Experience]:
    rng = random.Random(seed)
    out = []
    for j in range(6):
        exp = make_experience(f"j{j}", [rng.randrange(3, 500) for _ in range(rng.randint(2, 9))])
        for _ in range(n):
            k = rng.randint(1, 8)
            resp = [rng.randrange(3, 500) for _ in range(k)]
            if rng.random() < 0.5:
                resp[-1] = 1  # EOS: a finished sample
            sampling = [-6.0 + rng.random() for _ in resp]
            ref = [-6.2 + rng.random() for _ in resp]
            exp.samples.append(make_sample(resp, sampling_logprobs=sampling, ref_logprobs=ref, score=rng.random()))
        out.append(exp)
    return out


@pytest.mark.parametrize(
    "stage,extra",
    [("ray_ppo", {}), ("ray_grpo", {"adv_estimator": "grpo"}), ("ray_online_dpo", {})],
)
def test_update_with_padding_free_equals_padded(tiny_models, stage, extra):
    n = 2 if stage == "ray_online_dpo" else 3
    results = []
    for padding_free in (False, True):
        cfg = parse_config(
            {
                "training": {"stage": stage, "device": "cpu", "lr": 1e-3, "seed": 3, "padding_free": padding_free},
                "actor_rollout_ref": {
                    "actor_rollout": {
                        "n_samples_per_prompt": n,
                        "ppo_mini_batch_size": 6,
                        "ppo_epochs": 2,
                        "tis_cap": 2.0,
                        "entropy_coeff": 0.01,
                    }
                },
                "critic": {"critic_mini_batch_size": 6, "critic_update_epochs": 2},
                "algorithm": extra,
            }
        )
        engine = TrainerEngine(cfg)
        metrics = [engine.step(_experiences(n, 1))]
        results.append((metrics, {k: v.clone() for k, v in engine.actor.state_dict().items()}))
    (m0, w0), (m1, w1) = results
    for a, b in zip(m0, m1, strict=True):
        for k, v in a.items():
            if k.startswith("time/"):
                continue
            assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=ATOL, rtol=1e-5, msg=k)


def test_reference_logprobs_with_padding_free_equal_padded(tiny_models):
    rng = random.Random(5)
    items = [
        LogProbsItem(
            [rng.randrange(3, 500) for _ in range(rng.randint(1, 9))],
            [rng.randrange(3, 500) for _ in range(rng.randint(1, 9))],
        )
        for _ in range(7)
    ]
    out = []
    for padding_free in (False, True):
        eng = ReferenceEngine(parse_config({"training": {"device": "cpu", "padding_free": padding_free}}), "cpu")
        eng.load()
        out.append(asyncio.run(eng.logprobs(items, 0.7))[0])
    for a, b in zip(*out, strict=True):
        assert len(a) == len(b)
        assert b == pytest.approx(a, abs=ATOL)


def test_reward_model_scores_with_padding_free_equal_padded(tiny_models):
    """The reward model's forward packs its micro-batch too: the same scores within float32 rounding, for items of
    different lengths (token ids) in one micro-batch."""
    rng = random.Random(6)
    ids = lambda lo, hi: [rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))]
    items = [Item(prompt="", response="", prompt_ids=ids(1, 9), response_ids=ids(1, 12)) for _ in range(7)]
    out = []
    for padding_free in (False, True):
        cfg = {
            "training": {"device": "cpu", "padding_free": padding_free},
            "reward": {"scorers": [{"type": "model", "load": "tiny:reward"}], "micro_batch_size": 8},
        }
        eng = RewardEngine(parse_config(cfg), "cpu")
        eng.load()
        assert eng.scorers[0].padding_free is padding_free
        out.append([o.score for o in asyncio.run(eng.score(items))])
    assert len({len(it.prompt_ids) + len(it.response_ids) for it in items}) > 1  # padding in the padded pass
    assert all(s is not None for s in out[0])
    assert out[1] == pytest.approx(out[0], abs=ATOL)
