"""Tinker's built-in losses against a direct per-token computation of the formulas its docs give.

The reference below works token by token in Python floats and differentiates by hand (d/dp of each token's term), so
it shares no code path with rlhf.algo.tinker_losses: a wrong sign, a mean instead of a sum, a missing detach or a
clip on the wrong side shows up as a value or a gradient that differs.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo.tinker_losses import LOSSES, tinker_loss

LENGTHS = (5, 1, 8)


def _data(name: str, seed: int = 0):
    """Random data for ``name``: the target log-probs (leaf tensors, float64) and each datum's inputs."""
    gen = torch.Generator().manual_seed(seed)
    logprobs, inputs = [], []
    for n in LENGTHS:
        p = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
        datum = {"target_tokens": torch.randint(0, 100, (n,), generator=gen)}
        if name == "cross_entropy":
            datum["weights"] = (torch.rand(n, generator=gen) > 0.3).float()
        else:
            # sampler log-probs within +-0.7 of the learner's: ratios from 0.5 to 2, both sides of every clip
            datum["logprobs"] = (p + (torch.rand(n, generator=gen, dtype=torch.float64) - 0.5) * 1.4).float()
            datum["advantages"] = torch.randn(n, generator=gen)
        if name == "gspo":
            mask = (torch.rand(n, generator=gen) > 0.3).float()
            mask[0] = 1.0  # at least one token in the sequence ratio
            datum["sequence_ratio_mask"] = mask
        logprobs.append(p.requires_grad_(True))
        inputs.append(datum)
    return logprobs, inputs


def _reference(name: str, logprobs, inputs, config: dict | None = None):
    """(loss, [dloss/dp per datum]) computed token by token from the documented formulas."""
    cfg = {
        "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        "dro": {"beta": 0.05},
    }.get(name, {})
    cfg.update(config or {})
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    loss, grads = 0.0, []
    for p_t, datum in zip(logprobs, inputs, strict=True):
        p = p_t.detach().tolist()
        grad = []
        if name == "cross_entropy":
            w = datum["weights"].tolist()
            loss += sum(-pi * wi for pi, wi in zip(p, w, strict=True))
            grad = [-wi for wi in w]
        else:
            q = datum["logprobs"].double().tolist()
            a = datum["advantages"].double().tolist()
            if name == "gspo":
                m = datum["sequence_ratio_mask"].tolist()
                in_ratio = [pi - qi for pi, qi, mi in zip(p, q, m, strict=True) if mi != 0]
                seq = math.exp(sum(in_ratio) / len(in_ratio))
            for pi, qi, ai in zip(p, q, a, strict=True):
                r = math.exp(pi - qi)
                if name == "importance_sampling":
                    loss += -r * ai
                    grad.append(-r * ai)
                elif name in ("ppo", "gspo"):
                    # token ratio (ppo) or the sequence ratio with the token's own gradient (gspo): d ratio/dp = ratio
                    r = seq if name == "gspo" else r
                    clipped = min(max(r, lo), hi)
                    loss += -min(r * ai, clipped * ai)
                    # the min keeps the unclipped term unless the ratio is past the clip on the advantage's side
                    unclipped = r < hi if ai > 0 else r > lo
                    grad.append(-r * ai if unclipped else 0.0)
                elif name == "cispo":
                    c = min(max(r, lo), hi)
                    loss += -c * pi * ai
                    grad.append(-c * ai)
                elif name == "dro":
                    loss += -(pi * ai - 0.5 * cfg["beta"] * (pi - qi) ** 2)
                    grad.append(-(ai - cfg["beta"] * (pi - qi)))
        grads.append(torch.tensor(grad, dtype=torch.float64))
    return loss, grads


def _run(name, logprobs, inputs, config=None):
    for p in logprobs:
        p.grad = None
    loss, metrics = tinker_loss(name, logprobs, inputs, config)
    loss.backward()
    return loss, metrics, [p.grad for p in logprobs]


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_value_and_gradient_match_the_documented_formula(name, seed):
    logprobs, inputs = _data(name, seed)
    loss, metrics, grads = _run(name, logprobs, inputs)
    want_loss, want_grads = _reference(name, logprobs, inputs)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(want_loss, rel=1e-6, abs=1e-9)
    assert metrics == {"loss:sum": pytest.approx(want_loss, rel=1e-6, abs=1e-9)}
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", LOSSES)
def test_losses_are_sums_over_tokens_and_data_not_means(name):
    logprobs, inputs = _data(name)
    whole, _ = tinker_loss(name, logprobs, inputs)
    parts = [tinker_loss(name, [p], [x])[0].item() for p, x in zip(logprobs, inputs, strict=True)]
    assert whole.item() == pytest.approx(sum(parts), rel=1e-9)
    doubled, _ = tinker_loss(name, logprobs + logprobs, inputs + inputs)
    assert doubled.item() == pytest.approx(2 * whole.item(), rel=1e-9)


def test_the_rl_datum_of_tinkers_tutorial():
    # one token with sampler log-prob -0.7, learner log-prob -0.5, advantage 1 (tutorial 202's RL datum, one token)
    p = torch.tensor([-0.5], dtype=torch.float64, requires_grad=True)
    x = {"target_tokens": torch.tensor([7]), "logprobs": torch.tensor([-0.7]), "advantages": torch.tensor([1.0])}
    ratio = math.exp(0.2)
    assert tinker_loss("importance_sampling", [p], [x])[0].item() == pytest.approx(-ratio, rel=1e-6)
    assert tinker_loss("ppo", [p], [x])[0].item() == pytest.approx(-min(ratio, 1.2), rel=1e-6)  # 1.2214 > 1.2
    assert tinker_loss("cispo", [p], [x])[0].item() == pytest.approx(-ratio * -0.5, rel=1e-6)


@pytest.mark.parametrize(
    ("name", "defaults", "other"),
    [
        ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, {"clip_low_threshold": 0.9}),
        ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, {"clip_high_threshold": 1.1}),
        ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, {"clip_high_threshold": 1.1}),
        ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, {"clip_low_threshold": 0.9}),
        ("dro", {"beta": 0.05}, {"beta": 0.5}),
        ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, {"clip_low_threshold": 0.99}),
        ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, {"clip_high_threshold": 1.01}),
    ],
)
def test_none_config_is_the_defaults_and_each_parameter_changes_the_loss(name, defaults, other):
    logprobs, inputs = _data(name, seed=3)
    by_default, _, grads_default = _run(name, logprobs, inputs, None)
    explicit, _, grads_explicit = _run(name, logprobs, inputs, defaults)
    assert by_default.item() == explicit.item()
    changed, _, grads_changed = _run(name, logprobs, inputs, other)
    want_loss, want_grads = _reference(name, logprobs, inputs, other)
    assert changed.item() == pytest.approx(want_loss, rel=1e-6, abs=1e-9)
    for got, want in zip(grads_changed, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    assert changed.item() != pytest.approx(by_default.item(), rel=1e-6) or any(
        not torch.allclose(a, b) for a, b in zip(grads_changed, grads_default, strict=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(grads_default, grads_explicit, strict=True))


def test_gspo_clips_whole_sequences_by_the_geometric_mean_ratio():
    # token ratios 2 and 0.5 (geometric mean 1): PPO clips both tokens, GSPO neither
    p = torch.tensor([0.0, 0.0], dtype=torch.float64, requires_grad=True)
    x = {
        "target_tokens": torch.tensor([1, 2]),
        "logprobs": torch.tensor([-math.log(2.0), math.log(2.0)]),
        "advantages": torch.tensor([1.0, -1.0]),
        "sequence_ratio_mask": torch.tensor([1.0, 1.0]),
    }
    loss, _, (grad,) = _run("gspo", [p], [x])
    assert loss.item() == pytest.approx(-(1.0 - 1.0), abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-1.0, 1.0], dtype=torch.float64))
    x_ppo = {k: v for k, v in x.items() if k != "sequence_ratio_mask"}
    _, _, (grad_ppo,) = _run("ppo", [p], [x_ppo])
    torch.testing.assert_close(grad_ppo, torch.zeros(2, dtype=torch.float64))
    # with the second token left out of sequence_ratio_mask the sequence ratio is the first token's, 2: past the high
    # clip, which stops the positive advantage's token only (for a negative advantage the min keeps the unclipped term)
    x["sequence_ratio_mask"] = torch.tensor([1.0, 0.0])
    _, _, (grad_one,) = _run("gspo", [p], [x])
    torch.testing.assert_close(grad_one, torch.tensor([0.0, 2.0], dtype=torch.float64))


def test_cross_entropy_weights_mask_tokens():
    p = torch.tensor([-0.3, float("-inf"), -2.0, -0.1], dtype=torch.float64, requires_grad=True)
    x = {"target_tokens": torch.tensor([1, 2, 3, 4]), "weights": torch.tensor([1.0, 0.0, 0.5, 0.0])}
    loss, metrics, (grad,) = _run("cross_entropy", [p], [x])
    assert loss.item() == pytest.approx(0.3 + 1.0)  # the -inf and the -0.1 carry weight 0
    assert metrics == {"loss:sum": pytest.approx(1.3)}
    torch.testing.assert_close(grad, torch.tensor([-1.0, 0.0, -0.5, 0.0], dtype=torch.float64))


def test_cross_entropy_top_k_targets_and_signed_weights():
    # (N, K) targets: distillation onto K teacher tokens per position; forward_backward_custom sends signed weights
    p = torch.tensor([[-0.1, -2.0], [-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[0.75, 0.25], [-1.0, 0.0]])
    x = {"target_tokens": torch.tensor([[1, 2], [3, 4]]), "weights": w}
    loss, _, (grad,) = _run("cross_entropy", [p], [x])
    assert loss.item() == pytest.approx(0.075 + 0.5 - 0.5)
    torch.testing.assert_close(grad, -w.double())


def test_rl_advantages_of_zero_mask_prompt_tokens():
    # how tinker-cookbook's rl_loop masks the prompt: sampler log-prob 0 and advantage 0 there
    p = torch.tensor([-5.0, -0.2, -0.3], dtype=torch.float64, requires_grad=True)
    x = {
        "target_tokens": torch.tensor([1, 2, 3]),
        "logprobs": torch.tensor([0.0, -0.2, -0.3]),
        "advantages": torch.tensor([0.0, 1.0, 1.0]),
    }
    for name in ("importance_sampling", "ppo", "cispo"):
        _, _, (grad,) = _run(name, [p], [x])
        assert grad[0].item() == 0.0
        assert grad[1].item() == pytest.approx(-1.0)


@pytest.mark.parametrize("name", ["custom", "stable_reinforce", "grpo", "CROSS_ENTROPY", ""])
def test_unknown_and_unsupported_losses_are_refused_naming_the_supported_ones(name):
    logprobs, inputs = _data("cross_entropy")
    with pytest.raises(ValueError, match="supported: cross_entropy, importance_sampling, ppo, cispo, dro, gspo"):
        tinker_loss(name, logprobs, inputs)


def _bad(name, datum_index, change):
    logprobs, inputs = _data(name)
    change(logprobs, inputs[datum_index])
    return logprobs, inputs


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("importance_sampling", lambda lp, x: x.pop("advantages"), r"datum 1: missing loss_fn_inputs \['advantages'\]"),
        ("cross_entropy", lambda lp, x: x.pop("weights"), r"datum 1: missing loss_fn_inputs \['weights'\]"),
        ("gspo", lambda lp, x: x.pop("sequence_ratio_mask"), r"datum 1: missing .*'sequence_ratio_mask'"),
        ("ppo", lambda lp, x: x.update(mask=torch.ones(1)), r"datum 1: loss_fn_inputs \['mask'\] are not inputs"),
        ("cross_entropy", lambda lp, x: x.update(advantages=torch.ones(1)), r"datum 1: .*\['advantages'\] are not"),
        ("ppo", lambda lp, x: x.update(clip_low_threshold=torch.ones(1)), r"\['clip_low_threshold'\] are not inputs"),
        ("ppo", lambda lp, x: x.update(advantages=torch.ones(2)), r"datum 1: loss_fn_inputs\['advantages'\] has shape"),
        ("dro", lambda lp, x: x.update(logprobs=torch.ones(1, 1)), r"datum 1: loss_fn_inputs\['logprobs'\] has shape"),
        ("cispo", lambda lp, x: x.update(target_tokens=torch.ones(1, 1, dtype=torch.long)), r"datum 1: target_tokens"),
        ("ppo", lambda lp, x: x.update(target_tokens=torch.zeros(1)), r"datum 1: target_tokens must be integer"),
        ("ppo", lambda lp, x: x.update(advantages=torch.tensor([math.nan])), r"datum 1: .*'advantages'\] has a NaN"),
        ("cross_entropy", lambda lp, x: x.update(weights=torch.tensor([math.inf])), r"1: .*'weights'\] has a NaN"),
        ("ppo", lambda lp, x: x.update(advantages=[1.0]), r"datum 1: loss_fn_inputs\['advantages'\] is a list"),
        ("gspo", lambda lp, x: x.update(sequence_ratio_mask=torch.zeros(1)), r"datum 1: sequence_ratio_mask marks no"),
        ("ppo", lambda lp, x: lp.__setitem__(1, torch.zeros(2)), r"datum 1: target log-probs \(2,\) do not match"),
    ],
)
def test_missing_extra_or_misshaped_inputs_are_refused_naming_key_and_datum(name, change, message):
    logprobs, inputs = _bad(name, 1, change)
    with pytest.raises(ValueError, match=message):
        tinker_loss(name, logprobs, inputs)


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("ppo", {"clip_ratio": 0.2}, r"unknown loss_fn_config key 'clip_ratio'; ppo takes clip_high_threshold, clip"),
        ("importance_sampling", {"beta": 0.1}, r"importance_sampling takes no loss_fn_config"),
        ("cross_entropy", {"clip_low_threshold": 0.8}, r"cross_entropy takes no loss_fn_config"),
        ("dro", {"clip_low_threshold": 0.8}, r"dro takes beta"),
        ("ppo", {"clip_low_threshold": "0.8"}, r"must be a finite number, got '0.8'"),
        ("ppo", {"clip_low_threshold": math.nan}, r"must be a finite number"),
        ("cispo", {"clip_high_threshold": True}, r"must be a finite number"),
        ("ppo", {"clip_low_threshold": 1.3}, r"0 <= clip_low_threshold <= clip_high_threshold"),
        ("gspo", {"clip_low_threshold": -0.1}, r"0 <= clip_low_threshold"),
        ("dro", {"beta": -1}, r"'beta'\] must be >= 0"),
    ],
)
def test_bad_config_is_refused_naming_the_key(name, config, message):
    logprobs, inputs = _data(name)
    with pytest.raises(ValueError, match=message):
        tinker_loss(name, logprobs, inputs, config)


def test_data_and_logprobs_must_pair_up_and_not_be_empty():
    logprobs, inputs = _data("ppo")
    with pytest.raises(ValueError, match="3 logprob tensors for 2 data"):
        tinker_loss("ppo", logprobs, inputs[:2])
    with pytest.raises(ValueError, match="no data"):
        tinker_loss("ppo", [], [])


def test_inputs_follow_the_logprobs_dtype_and_the_loss_keeps_the_graph():
    # inputs arrive as float32 (the SDK's wire dtype); the loss is computed in the model's dtype
    p = torch.tensor([-0.2, -0.4], dtype=torch.bfloat16, requires_grad=True)
    x = {"target_tokens": torch.tensor([1, 2]), "weights": torch.tensor([1.0, 1.0])}
    loss, _ = tinker_loss("cross_entropy", [p], [x])
    assert loss.dtype == torch.bfloat16 and loss.requires_grad
