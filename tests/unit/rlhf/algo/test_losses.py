"""rlhf.algo.losses: PPO policy/value losses, DPO, chosen/rejected selection, against plain-Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo import aggregate, dpo_loss, ppo_policy_loss, select_chosen_rejected, value_loss

# (B=3, L=4); row 2 has a single valid token; padded slots hold extreme values that must not leak.
NEW = [[-0.5, -1.0, -2.0, 40.0], [-0.3, -0.2, -4.0, -1.0], [-1.0, 9.0, 9.0, 9.0]]
OLD = [[-0.7, -0.8, -2.0, -40.0], [-0.6, -0.2, -3.5, -1.4], [-0.2, -9.0, -9.0, -9.0]]
ADV = [[1.0, -2.0, 0.5, 100.0], [-1.0, 3.0, 2.0, -0.5], [-1.5, 100.0, 100.0, 100.0]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def _t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def _naive_ppo(new, old, adv, mask, eps_low=0.2, eps_high=None, dual_clip=None, weights=None):
    eps_high = eps_low if eps_high is None else eps_high
    per, clipped, dual, ratios, kls = [], [], [], [], []
    for b in range(len(new)):
        row = []
        for t in range(len(new[0])):
            ratio = math.exp(new[b][t] - old[b][t])
            a = adv[b][t]
            unc = -a * ratio
            clp = -a * min(max(ratio, 1 - eps_low), 1 + eps_high)
            loss = max(unc, clp)
            d = False
            if dual_clip is not None and a < 0 and loss > -dual_clip * a:
                loss, d = -dual_clip * a, True
            if weights is not None:
                loss *= weights[b][t]
            row.append(loss)
            if mask[b][t]:
                clipped.append(clp > unc)
                dual.append(d)
                ratios.append(ratio)
                kls.append(0.5 * (new[b][t] - old[b][t]) ** 2)
        per.append(row)
    return per, {
        "clipfrac": sum(clipped) / len(clipped),
        "dual_clipfrac": sum(dual) / len(dual),
        "ratio": sum(ratios) / len(ratios),
        "approxkl": sum(kls) / len(kls),
    }


def _token_mean(per, mask):
    vals = [v for row, m in zip(per, mask, strict=True) for v, k in zip(row, m, strict=True) if k]
    return sum(vals) / len(vals)


def _seq_mean_token_mean(per, mask):
    rows = []
    for row, m in zip(per, mask, strict=True):
        vals = [v for v, k in zip(row, m, strict=True) if k]
        rows.append(sum(vals) / len(vals) if vals else 0.0)
    return sum(rows) / len(rows)


def _seq_mean_token_sum_norm(per, mask):
    total = sum(v for row, m in zip(per, mask, strict=True) for v, k in zip(row, m, strict=True) if k)
    return total / (len(per) * len(per[0]))


AGG = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


@pytest.mark.parametrize("how", list(AGG))
def test_aggregate_matches_loop(how):
    values = [[1.0, 2.0, 3.0, 50.0], [4.0, -1.0, 0.0, 2.0], [7.0, 50.0, 50.0, 50.0]]
    got = aggregate(_t(values), torch.tensor(MASK, dtype=torch.bool), how)
    assert got.item() == pytest.approx(AGG[how](values, MASK))


def test_aggregate_hand_values_and_all_masked_row():
    values, mask = _t([[1.0, 3.0], [5.0, 5.0]]), torch.tensor([[1, 1], [0, 0]])
    assert aggregate(values, mask, "token_mean").item() == 2.0
    assert aggregate(values, mask, "seq_mean_token_mean").item() == 1.0  # (2 + 0) / 2
    assert aggregate(values, mask, "seq_mean_token_sum_norm").item() == 1.0  # 4 / (2 * 2)


def test_aggregate_unknown():
    with pytest.raises(ValueError, match="'sum'"):
        aggregate(_t([[1.0]]), torch.ones(1, 1), "sum")


@pytest.mark.parametrize("how", list(AGG))
def test_ppo_policy_loss_matches_loop(how):
    loss, stats = ppo_policy_loss(_t(NEW, True), _t(OLD), _t(ADV), torch.tensor(MASK), aggregation=how)
    per, exp_stats = _naive_ppo(NEW, OLD, ADV, MASK)
    assert loss.item() == pytest.approx(AGG[how](per, MASK), abs=1e-12)
    for key in ("clipfrac", "ratio", "approxkl"):
        assert stats[key].item() == pytest.approx(exp_stats[key], abs=1e-12), key
    assert 0 < stats["clipfrac"].item() < 1  # the data exercise both branches
    assert "dual_clipfrac" not in stats and "tis_weight" not in stats


def test_ppo_policy_loss_hand_values():
    # ratio e^0.5 ~ 1.65 with A = 1: clipped at 1.2 -> loss -1.2; ratio 1 with A = -2 -> loss 2
    loss, stats = ppo_policy_loss(_t([[0.5, 0.0]], True), _t([[0.0, 0.0]]), _t([[1.0, -2.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx((-1.2 + 2.0) / 2)
    assert stats["clipfrac"].item() == 0.5
    assert stats["ratio"].item() == pytest.approx((math.exp(0.5) + 1.0) / 2)
    assert stats["approxkl"].item() == pytest.approx(0.5 * 0.25 / 2)


def test_ppo_policy_loss_asymmetric_clip():
    # ratio 1.25 with A > 0: clipped by eps 0.2 (loss -1.2 A), not by eps_high 0.28 (loss -1.25 A)
    new, old, adv, mask = _t([[math.log(1.25)]], True), _t([[0.0]]), _t([[2.0]]), torch.ones(1, 1)
    sym, s_stats = ppo_policy_loss(new, old, adv, mask, clip_ratio=0.2)
    asym, a_stats = ppo_policy_loss(new, old, adv, mask, clip_ratio=0.2, clip_ratio_high=0.28)
    assert sym.item() == pytest.approx(-2.4)
    assert asym.item() == pytest.approx(-2.5)
    assert s_stats["clipfrac"].item() == 1.0 and a_stats["clipfrac"].item() == 0.0
    # the low side still uses clip_ratio: ratio 0.7 with A < 0 is clipped to 0.8
    low, _ = ppo_policy_loss(_t([[math.log(0.7)]], True), old, _t([[-1.0]]), mask, 0.2, clip_ratio_high=0.28)
    assert low.item() == pytest.approx(0.8)
    # and the full batch agrees with the loop
    loss, stats = ppo_policy_loss(_t(NEW, True), _t(OLD), _t(ADV), torch.tensor(MASK), 0.1, clip_ratio_high=0.3)
    per, exp = _naive_ppo(NEW, OLD, ADV, MASK, eps_low=0.1, eps_high=0.3)
    assert loss.item() == pytest.approx(_token_mean(per, MASK), abs=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(exp["clipfrac"])


def test_ppo_policy_loss_dual_clip():
    # A = -1, ratio e^2 ~ 7.39: standard PPO loss 7.39, dual clip c = 3 caps it at 3; A > 0 tokens unaffected
    new = _t([[2.0, 2.0, 0.0]], True)
    old, adv, mask = _t([[0.0, 0.0, 0.0]]), _t([[-1.0, 1.0, -1.0]]), torch.ones(1, 3)
    loss, stats = ppo_policy_loss(new, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 - 1.2 + 1.0) / 3)
    assert stats["dual_clipfrac"].item() == pytest.approx(1 / 3)
    plain, _ = ppo_policy_loss(new, old, adv, mask)
    assert plain.item() == pytest.approx((math.exp(2.0) - 1.2 + 1.0) / 3)
    # batch vs loop
    loss, stats = ppo_policy_loss(_t(NEW, True), _t(OLD), _t(ADV), torch.tensor(MASK), dual_clip=1.2)
    per, exp = _naive_ppo(NEW, OLD, ADV, MASK, dual_clip=1.2)
    assert loss.item() == pytest.approx(_token_mean(per, MASK), abs=1e-12)
    assert stats["dual_clipfrac"].item() == pytest.approx(exp["dual_clipfrac"])
    assert exp["dual_clipfrac"] > 0


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_ppo_policy_loss_dual_clip_must_exceed_one(c):
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(_t(NEW, True), _t(OLD), _t(ADV), torch.tensor(MASK), dual_clip=c)


@pytest.mark.parametrize("clip", [-0.1, 1.0])
def test_ppo_policy_loss_bad_clip_ratio(clip):
    with pytest.raises(ValueError, match="clip_ratio"):
        ppo_policy_loss(_t(NEW, True), _t(OLD), _t(ADV), torch.tensor(MASK), clip_ratio=clip)


def test_ppo_policy_loss_truncated_importance_sampling():
    behavior = [[-0.9, -0.2, -2.5, 0.0], [-0.6, -1.5, -3.0, -1.0], [-2.0, 0.0, 0.0, 0.0]]
    cap = 1.5
    weights = [
        [min(math.exp(o - b), cap) for o, b in zip(ro, rb, strict=True)] for ro, rb in zip(OLD, behavior, strict=True)
    ]
    loss, stats = ppo_policy_loss(
        _t(NEW, True), _t(OLD), _t(ADV), torch.tensor(MASK), behavior_logprobs=_t(behavior), tis_cap=cap
    )
    per, _ = _naive_ppo(NEW, OLD, ADV, MASK, weights=weights)
    assert loss.item() == pytest.approx(_token_mean(per, MASK), abs=1e-12)
    valid_w = [w for rw, m in zip(weights, MASK, strict=True) for w, k in zip(rw, m, strict=True) if k]
    assert stats["tis_weight"].item() == pytest.approx(sum(valid_w) / len(valid_w))
    assert max(valid_w) == cap and min(valid_w) < 1  # both truncated and down-weighted tokens occur
    plain, _ = ppo_policy_loss(_t(NEW, True), _t(OLD), _t(ADV), torch.tensor(MASK))
    assert loss.item() != pytest.approx(plain.item())


def test_ppo_policy_loss_tis_needs_cap():
    with pytest.raises(ValueError, match="tis_cap"):
        ppo_policy_loss(_t(NEW, True), _t(OLD), _t(ADV), torch.tensor(MASK), behavior_logprobs=_t(OLD))


def test_ppo_policy_loss_gradient_only_through_logprobs():
    new, old, adv, behavior = _t(NEW, True), _t(OLD, True), _t(ADV, True), _t(OLD, True)
    loss, stats = ppo_policy_loss(new, old, adv, torch.tensor(MASK), behavior_logprobs=behavior, tis_cap=2.0)
    loss.backward()
    assert old.grad is None and adv.grad is None and behavior.grad is None
    for v in stats.values():
        assert not v.requires_grad
    # analytic gradient: d/dlp of -A * ratio / N where the unclipped branch is active, 0 where clipped, 0 off-mask
    n = sum(map(sum, MASK))
    for b in range(3):
        for t in range(4):
            ratio = math.exp(NEW[b][t] - OLD[b][t])
            a = ADV[b][t]
            clipped = -a * min(max(ratio, 0.8), 1.2) > -a * ratio
            expected = 0.0 if (not MASK[b][t] or clipped) else -a * ratio / n
            assert new.grad[b, t].item() == pytest.approx(expected, abs=1e-12), (b, t)
    assert (new.grad != 0).sum().item() > 0


def test_ppo_policy_loss_ignores_padding_values():
    mask = torch.tensor(MASK, dtype=torch.bool)
    base, base_stats = ppo_policy_loss(_t(NEW, True), _t(OLD), _t(ADV), mask)
    new2 = _t(NEW).masked_fill(~mask, -123.0).requires_grad_()
    adv2 = _t(ADV).masked_fill(~mask, 77.0)
    other, other_stats = ppo_policy_loss(new2, _t(OLD), adv2, mask)
    assert other.item() == pytest.approx(base.item(), abs=1e-12)
    for key in base_stats:
        assert other_stats[key].item() == pytest.approx(base_stats[key].item(), abs=1e-12)


# ---------------------------------------------------------------------------------------------- value loss

V = [[0.5, 1.0, -0.2, 9.0], [2.0, 0.0, 0.3, 0.1], [1.0, 5.0, 5.0, 5.0]]
V_OLD = [[0.0, 1.1, 0.5, -9.0], [1.0, 0.1, 0.3, 0.4], [0.4, 0.0, 0.0, 0.0]]
RET = [[1.0, 0.0, 0.6, 3.0], [0.5, 0.2, -0.1, 0.0], [2.0, 0.0, 0.0, 0.0]]


def _naive_value(eps):
    per, clipped = [], []
    for b in range(3):
        row = []
        for t in range(4):
            v, vo, r = V[b][t], V_OLD[b][t], RET[b][t]
            unc = (v - r) ** 2
            if eps:
                clp = (vo + min(max(v - vo, -eps), eps) - r) ** 2
                row.append(max(unc, clp))
                if MASK[b][t]:
                    clipped.append(clp > unc)
            else:
                row.append(unc)
        per.append(row)
    return per, (sum(clipped) / len(clipped) if clipped else 0.0)


@pytest.mark.parametrize("how", list(AGG))
def test_value_loss_clipped_matches_loop(how):
    loss, stats = value_loss(_t(V, True), _t(V_OLD), _t(RET), torch.tensor(MASK), cliprange_value=0.2, aggregation=how)
    per, clipfrac = _naive_value(0.2)
    assert loss.item() == pytest.approx(0.5 * AGG[how](per, MASK), abs=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(clipfrac)
    assert 0 < clipfrac < 1
    vals = [v for row, m in zip(V, MASK, strict=True) for v, k in zip(row, m, strict=True) if k]
    assert stats["vpred"].item() == pytest.approx(sum(vals) / len(vals))


@pytest.mark.parametrize("off", [None, 0.0, -1.0])
def test_value_loss_unclipped(off):
    loss, stats = value_loss(_t(V, True), _t(V_OLD), _t(RET), torch.tensor(MASK), cliprange_value=off)
    per, _ = _naive_value(None)
    assert loss.item() == pytest.approx(0.5 * _token_mean(per, MASK), abs=1e-12)
    assert stats["clipfrac"].item() == 0.0
    clipped, _ = value_loss(_t(V, True), _t(V_OLD), _t(RET), torch.tensor(MASK), cliprange_value=0.2)
    assert clipped.item() > loss.item()


def test_value_loss_hand_value_and_grad():
    # v = 2, v_old = 0, R = 1, eps = 0.5: unclipped (2-1)^2 = 1, clipped (0.5-1)^2 = 0.25 -> max 1, loss 0.5
    v = _t([[2.0]], True)
    loss, stats = value_loss(v, _t([[0.0]]), _t([[1.0]]), torch.ones(1, 1), cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5)
    assert stats["clipfrac"].item() == 0.0
    loss.backward()
    assert v.grad.item() == pytest.approx(1.0)  # d/dv 0.5 (v - R)^2


# ---------------------------------------------------------------------------------------------- DPO

PC, PR = [-10.0, -5.0, -7.0], [-12.0, -4.0, -7.5]
RC, RR = [-11.0, -5.5, -6.0], [-11.5, -4.5, -8.0]


def _log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_sigmoid_matches_formula(beta):
    loss, stats = dpo_loss(_t(PC, True), _t(PR), _t(RC), _t(RR), beta=beta)
    logits = [(pc - pr) - (rc - rr) for pc, pr, rc, rr in zip(PC, PR, RC, RR, strict=True)]
    assert logits == [1.5, 0.0, -1.5]
    expected = sum(-_log_sigmoid(beta * x) for x in logits) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    chosen = [beta * (pc - rc) for pc, rc in zip(PC, RC, strict=True)]
    rejected = [beta * (pr - rr) for pr, rr in zip(PR, RR, strict=True)]
    margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
    assert stats["rewards/chosen"].item() == pytest.approx(sum(chosen) / 3)
    assert stats["rewards/rejected"].item() == pytest.approx(sum(rejected) / 3)
    assert stats["rewards/margins"].item() == pytest.approx(sum(margins) / 3)
    assert stats["rewards/accuracies"].item() == pytest.approx(1 / 3)  # a zero margin is not a win
    assert stats["logps/chosen"].item() == pytest.approx(sum(PC) / 3)
    assert stats["logps/rejected"].item() == pytest.approx(sum(PR) / 3)


def test_dpo_sigmoid_hand_value():
    # logits 0 -> -log(1/2)
    loss, _ = dpo_loss(_t([-1.0]), _t([-1.0]), _t([-2.0]), _t([-2.0]), beta=0.3)
    assert loss.item() == pytest.approx(math.log(2.0))


def test_dpo_ipo_matches_formula():
    beta = 0.25
    loss, _ = dpo_loss(_t(PC), _t(PR), _t(RC), _t(RR), beta=beta, loss_type="ipo")
    logits = [1.5, 0.0, -1.5]
    expected = sum((x - 1 / (2 * beta)) ** 2 for x in logits) / 3  # (1.5-2)^2 + (0-2)^2 + (-1.5-2)^2 = 16.5
    assert expected == pytest.approx(16.5 / 3)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_dpo_gradient_pushes_chosen_up():
    pc = _t(PC, True)
    loss, _ = dpo_loss(pc, _t(PR), _t(RC), _t(RR), beta=0.1)
    loss.backward()
    assert (pc.grad < 0).all()  # minimising the loss raises the chosen log-probs


def test_dpo_errors():
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(_t(PC), _t(PR), _t(RC), _t(RR), beta=0.0)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(_t(PC), _t(PR), _t(RC), _t(RR), loss_type="hinge")


def test_select_chosen_rejected_with_tie():
    # block layout: rows 0..2 are the first samples of prompts 0..2, rows 3..5 the second samples
    scores = torch.tensor([1.0, 5.0, 3.0, 2.0, 5.0, 1.0])
    chosen, rejected = select_chosen_rejected(scores, 3)
    assert chosen.tolist() == [3, 1, 2]  # prompt 1 is a tie: the first sample wins
    assert rejected.tolist() == [0, 4, 5]
    assert (scores[chosen] >= scores[rejected]).all()


def test_select_chosen_rejected_wrong_count():
    with pytest.raises(ValueError, match="expected 6"):
        select_chosen_rejected(torch.zeros(5), 3)
