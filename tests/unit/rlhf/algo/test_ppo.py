"""rlhf.algo.ppo: stop-token truncation, sequence lengths and the PPO rollout post-processing (TRL conventions),
checked against an independent plain-Python implementation of the spec on a small batch."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo import first_true_indices, ppo_rollout, rollout_metrics, sequence_lengths, truncate_at_stop

PAD, EOS = 0, 1


def test_first_true_indices():
    flags = torch.tensor([[False, True, False, True], [False, False, False, False], [True, False, False, False]])
    assert first_true_indices(flags).tolist() == [1, 4, 0]
    assert first_true_indices(torch.tensor([[0, 0, 1]])).tolist() == [2]  # 0/1 ints work too


def test_truncate_at_stop_keeps_stop_token():
    responses = torch.tensor([[5, 1, 7, 8], [5, 6, 7, 8], [1, 9, 1, 9], [4, 5, 6, 1]])
    got = truncate_at_stop(responses, stop_token_id=EOS, pad_token_id=PAD)
    assert got.tolist() == [[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 0, 0], [4, 5, 6, 1]]
    assert responses[0].tolist() == [5, 1, 7, 8]  # input untouched


def test_truncate_at_stop_none_is_identity():
    responses = torch.tensor([[5, 1, 7, 8]])
    assert truncate_at_stop(responses, None, PAD).tolist() == [[5, 1, 7, 8]]


def test_truncate_at_other_stop_id():
    got = truncate_at_stop(torch.tensor([[3, 7, 1, 7, 2]]), stop_token_id=7, pad_token_id=PAD)
    assert got.tolist() == [[3, 7, 0, 0, 0]]


def test_sequence_lengths():
    responses = torch.tensor([[5, 1, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0], [3, 0, 0, 0]])
    assert sequence_lengths(responses, PAD).tolist() == [1, 3, -1, 0]


# ---------------------------------------------------------------------------------------------- ppo_rollout

RAW = [
    [5, 1, 7, 1],  # EOS at 1; garbage after it (one more EOS, counted in num_eos_tokens as TRL does)
    [5, 6, 7, 8],  # no EOS, fills the width
    [4, 6, 1, 0],  # EOS at 2
    [0, 0, 0, 0],  # empty response
]
LP = [[-0.5, -1.0, -2.0, -3.0], [-0.2, -0.4, -0.6, -0.8], [-1.0, -0.1, -0.3, -5.0], [-7.0, -7.0, -7.0, -7.0]]
REF = [[-0.7, -0.9, -2.5, -1.0], [-0.1, -0.6, -0.6, -0.2], [-0.5, -0.4, -0.3, -9.0], [-1.0, -1.0, -1.0, -1.0]]
VAL = [[0.1, 0.2, 0.3, 0.4], [-0.1, 0.0, 0.5, 1.0], [0.3, -0.3, 0.6, 2.0], [0.7, 0.8, 0.9, 1.0]]
SCORES = [1.0, 2.0, -0.5, 0.3]
L = 4


def _naive_whiten(rows, mask, shift_mean=True):
    xs = [v for r, m in zip(rows, mask, strict=True) for v, k in zip(r, m, strict=True) if k]
    mu = sum(xs) / len(xs)
    var = sum((x - mu) ** 2 for x in xs) / len(xs)
    var *= len(xs) / (len(xs) - 1)
    out = [[(v - mu) / math.sqrt(var + 1e-8) for v in r] for r in rows]
    return out if shift_mean else [[v + mu for v in r] for r in out]


def _naive_rollout(
    kl_coef=0.05, gamma=1.0, lam=0.95, penalty=None, whiten_rewards=False, whiten_adv=True, position="trl"
):
    """The TRL PPO post-processing (ALGORITHMS.md §1.2-1.7) written out with Python lists."""
    resp, ell = [], []
    for row in RAW:
        stop = row.index(EOS) if EOS in row else L
        r = [tok if t <= stop else PAD for t, tok in enumerate(row)]
        resp.append(r)
        ell.append((r.index(PAD) if PAD in r else L) - 1)
    pm = [[t > e for t in range(L)] for e in ell]
    pm1 = [[t > e + 1 for t in range(L)] for e in ell]
    values = [[0.0 if pm1[b][t] else VAL[b][t] for t in range(L)] for b in range(4)]
    contains_eos = [EOS in r for r in resp]
    scores = [s - (penalty if penalty and not c else 0.0) for s, c in zip(SCORES, contains_eos, strict=True)]
    kl = [[0.0 if pm[b][t] else LP[b][t] - REF[b][t] for t in range(L)] for b in range(4)]
    non_score = [[-kl_coef * k for k in row] for row in kl]
    rewards = [list(r) for r in non_score]
    for b, e in enumerate(ell):
        end = (e + 1 if e + 1 < L else e) if position == "trl" else max(e, 0)
        rewards[b][end] += scores[b]
    if whiten_rewards:
        rewards = _naive_whiten(rewards, [[not x for x in r] for r in pm1], shift_mean=False)
        rewards = [[0.0 if pm1[b][t] else rewards[b][t] for t in range(L)] for b in range(4)]
    adv = []
    for b in range(4):
        delta = [rewards[b][t] + gamma * (values[b][t + 1] if t + 1 < L else 0.0) - values[b][t] for t in range(L)]
        adv.append([sum((gamma * lam) ** k * delta[t + k] for k in range(L - t)) for t in range(L)])
    returns = [[a + v for a, v in zip(ra, rv, strict=True)] for ra, rv in zip(adv, values, strict=True)]
    if whiten_adv:
        adv = _naive_whiten(adv, [[not x for x in r] for r in pm])
    adv = [[0.0 if pm[b][t] else adv[b][t] for t in range(L)] for b in range(4)]
    return dict(
        responses=resp,
        ell=ell,
        pm=pm,
        pm1=pm1,
        values=values,
        contains_eos=contains_eos,
        scores=scores,
        kl=kl,
        non_score=non_score,
        rewards=rewards,
        advantages=adv,
        returns=returns,
    )


def _run(**kw):
    return ppo_rollout(
        torch.tensor(RAW),
        torch.tensor(LP, dtype=torch.float64),
        torch.tensor(REF, dtype=torch.float64),
        torch.tensor(VAL, dtype=torch.float64),
        torch.tensor(SCORES, dtype=torch.float64),
        pad_token_id=PAD,
        eos_token_id=EOS,
        stop_token_id=EOS,
        **kw,
    )


def _close(got: torch.Tensor, expected, tol=1e-9):
    for g, e in zip(got.tolist(), expected, strict=True):
        assert g == pytest.approx(e, abs=tol)


def test_ppo_rollout_masks_and_lengths():
    out = _run()
    assert out.responses.tolist() == [[5, 1, 0, 0], [5, 6, 7, 8], [4, 6, 1, 0], [0, 0, 0, 0]]
    assert out.sequence_lengths.tolist() == [1, 3, 2, -1]
    assert out.num_eos_tokens.item() == 3  # counted on the raw responses
    assert out.contains_eos.tolist() == [True, False, True, False]
    assert out.padding_mask.int().tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1]]
    assert out.padding_mask_p1.int().tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1]]
    assert torch.equal(out.response_mask, ~out.padding_mask)
    assert torch.equal(out.value_mask, ~out.padding_mask_p1)
    # log-probs zeroed past ell, values past ell + 1
    assert out.logprobs[0].tolist() == [-0.5, -1.0, 0.0, 0.0]
    assert out.ref_logprobs[3].tolist() == [0.0] * 4
    assert out.values[0].tolist() == [0.1, 0.2, 0.3, 0.0]
    assert out.values[3].tolist() == [0.7, 0.0, 0.0, 0.0]


def test_ppo_rollout_score_positions():
    out = _run(kl_coef=0.0)
    # with no KL the rewards are just the scores at TRL's positions: ell + 1, or ell on the full-width row
    assert out.rewards.tolist() == [
        [0.0, 0.0, 1.0, 0.0],
        [0.0, 0.0, 0.0, 2.0],
        [0.0, 0.0, 0.0, -0.5],
        [0.3, 0.0, 0.0, 0.0],
    ]
    last = _run(kl_coef=0.0, score_position="last_token")
    assert last.rewards.tolist() == [
        [0.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 2.0],
        [0.0, 0.0, -0.5, 0.0],
        [0.3, 0.0, 0.0, 0.0],
    ]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"kl_coef": 0.2, "gamma": 0.9, "lam": 0.8},
        {"missing_eos_penalty": 1.0},
        {"whiten_rewards": True},
        {"whiten_advantages": False},
        {"score_position": "last_token", "kl_coef": 0.1},
    ],
    ids=["default", "gamma-lam", "eos-penalty", "whiten-rewards", "raw-advantages", "last-token"],
)
def test_ppo_rollout_matches_naive(kw):
    out = _run(**kw)
    exp = _naive_rollout(
        kl_coef=kw.get("kl_coef", 0.05),
        gamma=kw.get("gamma", 1.0),
        lam=kw.get("lam", 0.95),
        penalty=kw.get("missing_eos_penalty"),
        whiten_rewards=kw.get("whiten_rewards", False),
        whiten_adv=kw.get("whiten_advantages", True),
        position=kw.get("score_position", "trl"),
    )
    assert out.responses.tolist() == exp["responses"]
    assert out.sequence_lengths.tolist() == exp["ell"]
    assert out.scores.tolist() == pytest.approx(exp["scores"])
    for key, name in [
        ("kl", "kl"),
        ("non_score_reward", "non_score"),
        ("rewards", "rewards"),
        ("values", "values"),
        ("advantages", "advantages"),
        ("returns", "returns"),
    ]:
        _close(getattr(out, key), exp[name])


def test_ppo_rollout_penalty_changes_scores():
    out = _run(missing_eos_penalty=1.0)
    assert out.scores.tolist() == pytest.approx([1.0, 1.0, -0.5, -0.7])


def test_ppo_rollout_whitened_advantages_are_standardised():
    out = _run()
    sel = out.advantages[out.response_mask]
    assert sel.numel() == 9
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert sel.std().item() == pytest.approx(1.0, abs=1e-6)
    assert out.advantages[out.padding_mask].abs().sum().item() == 0.0
    # returns come from the un-whitened advantages: they are non-zero up to ell + 1
    assert out.returns[0, 2].item() != 0.0 and out.returns[0, 3].item() == 0.0


def test_rollout_metrics():
    out = _run(kl_coef=0.1, missing_eos_penalty=0.5)
    m = rollout_metrics(out)
    exp = _naive_rollout(kl_coef=0.1, penalty=0.5)
    kl_rows = [sum(r) for r in exp["kl"]]
    ent_rows = [sum(-LP[b][t] for t in range(L) if not exp["pm"][b][t]) for b in range(4)]
    nsr = sum(sum(r) for r in exp["non_score"]) / 4
    score = sum(exp["scores"]) / 4
    assert m["objective/kl"] == pytest.approx(sum(kl_rows) / 4)
    assert m["objective/entropy"] == pytest.approx(sum(ent_rows) / 4)
    assert m["objective/non_score_reward"] == pytest.approx(nsr)
    assert m["objective/rlhf_reward"] == pytest.approx(nsr + score)
    assert m["objective/scores"] == pytest.approx(score)
    assert m["val/num_eos_tokens"] == 3.0
    assert all(isinstance(v, float) for v in m.values())
