"""The trainer-inference mismatch each stage measures (``mismatch/*``): which rows count, at which temperature, and
which replica made the samples that disagree."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from rlhf import runlog
from rlhf.algo import logprobs_from_logits
from rlhf.config import parse_config
from rlhf.models import causal_lm_logits
from services.trainer import loop
from services.trainer.engine import TrainerEngine
from tests.support import make_experience, make_sample

PROMPTS = [[2, 100 + i, 200 + i] for i in range(4)]


def _engine(stage: str, temperature: float = 1.0, **training) -> TrainerEngine:
    n = 2 if stage == "ray_online_dpo" else 4
    return TrainerEngine(
        parse_config(
            {
                "training": {"stage": stage, "device": "cpu", "lr": 1e-3, "seed": 7, **training},
                "actor_rollout_ref": {
                    "actor_rollout": {"n_samples_per_prompt": n, "ppo_mini_batch_size": 16, "temperature": temperature}
                },
                "critic": {"critic_mini_batch_size": 16},
            }
        )
    )


def _records(engine: TrainerEngine, n: int, temperature: float = 1.0, shift: float = 0.0, version: int = 0):
    """Samples of the actor with the sampling log-probs a rollout engine would report at ``temperature`` (plus
    ``shift``), tagged ``version``, from replica ``r<j % 2>``; responses of different lengths (one padded)."""
    out = []
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for j, prompt in enumerate(PROMPTS):
            exp = make_experience(f"j{j}", prompt, replica_id=f"r{j % 2}")
            for k in range(n):
                length = 5 if k else 3
                resp = torch.randint(3, 500, (length,), generator=g).tolist()
                ids = torch.tensor([prompt + resp])
                logits = causal_lm_logits(engine.actor, ids, engine.pad_id)[:, len(prompt) - 1 : -1]
                samp = logprobs_from_logits(logits, ids[:, len(prompt) :], temperature)[0] + shift
                exp.samples.append(
                    make_sample(
                        resp,
                        sampling_logprobs=samp.tolist(),
                        ref_logprobs=[-1.0] * length,
                        score=float(k),
                        policy_version=version,
                    )
                )
            out.append(exp)
    return out


def _tokens(records) -> int:
    return sum(len(s.response_ids) for e in records for s in e.samples)


@pytest.mark.parametrize("stage", ["ray_ppo", "ray_grpo"])
def test_on_policy_samples_agree_and_a_shift_is_measured(tiny_models, stage):
    engine = _engine(stage, temperature=0.7)
    records = _records(engine, 4, temperature=0.7)
    m = engine.step(records)
    assert m["mismatch/tokens"] == _tokens(records)
    assert m["mismatch/kl"] < 1e-9 and m["mismatch/max_abs"] < 1e-4, m
    # step 1 now: samples of the weights at step 1 (version 1), their log-probs off by 0.1 each
    m = engine.step(_records(engine, 4, temperature=0.7, shift=0.1, version=1))
    assert m["mismatch/kl"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-3)
    assert m["mismatch/max_abs"] == pytest.approx(0.1, rel=1e-3)
    kl, tokens, versions = engine.mismatch_by_replica["r0"]
    assert kl == pytest.approx(m["mismatch/kl"], rel=1e-3) and versions == [1]
    assert tokens + engine.mismatch_by_replica["r1"][1] == m["mismatch/tokens"]


def test_samples_of_other_weights_are_not_compared(tiny_models):
    engine = _engine("ray_ppo")
    engine.step(_records(engine, 4))
    stale = _records(engine, 4, shift=1.0, version=0)  # one step behind: they differ by training, not numerics
    m = engine.step(stale)
    assert m["mismatch/tokens"] == 0 and "mismatch/kl" not in m and "mismatch/max_abs" not in m
    assert engine.mismatch_by_replica == {}
    # a restart at step 2 published its weights as version 7: versions 3..6 were weights a crash discarded
    engine.version_segments.append((7, 2))
    assert engine.same_weights(torch.tensor([2, 4, 7, 8]), 2).tolist() == [True, False, True, False]
    assert engine.same_weights(torch.tensor([4, 8]), 4).tolist() == [False, False]
    assert engine.steps_behind(torch.tensor([4]), 2).tolist() == [0.0]  # what staleness counts instead


@pytest.mark.parametrize("stage", ["ray_ppo", "ray_grpo"])
def test_partial_rollouts_are_measured_per_token(tiny_models, stage):
    """Records whose tokens span two versions (a push interrupted them, partial rollouts): only the tokens the current
    weights sampled are compared, the older ones (off by 1.0 here) are not; staleness counts each sample by its oldest
    token; the per-token versions follow the spans."""
    engine = _engine(stage)
    engine.step(_records(engine, 4))  # step 1: the weights of version 1
    records = _records(engine, 4, version=0)
    split = 2
    for e in records:
        for smp in e.samples:
            smp.span_starts[:] = [0, split]
            smp.span_versions[:] = [0, 1]
            for k in range(split):  # sampled by version 0: not what the weights of version 1 give
                smp.sampling_logprobs[k] += 1.0
    batch = engine.collate(records)
    assert batch.token_versions[:, :split].eq(0).all() and batch.token_versions[:, split:].eq(1).all()
    assert batch.policy_versions.eq(0).all()
    m = engine.step(records)
    assert m["mismatch/tokens"] == _tokens(records) - split * 16
    assert m["mismatch/kl"] < 1e-9 and m["mismatch/max_abs"] < 1e-4, m
    assert m["staleness/max"] == 1.0


def test_version_spans_that_do_not_cover_the_response_are_refused(tiny_models):
    engine = _engine("ray_grpo")
    for starts, versions in [([1, 3], [0, 1]), ([0, 3, 2], [0, 1, 2]), ([0, 9], [0, 1]), ([0, 2], [0])]:
        records = _records(engine, 4)
        smp = records[1].samples[2]
        smp.span_starts[:], smp.span_versions[:] = starts, versions
        with pytest.raises(ValueError, match="job j1: version spans .* do not cover the 5 response tokens"):
            engine.collate(records)
    records = _records(engine, 4)
    records[0].samples[1].span_starts[:], records[0].samples[1].span_versions[:] = [0, 2], [1, 2]
    with pytest.raises(ValueError, match="job j0: policy_version 0 is not the oldest"):
        engine.collate(records)


def test_online_dpo_measures_its_first_minibatch_at_temperature_one_only(tiny_models):
    engine = _engine("ray_online_dpo")
    records = _records(engine, 2, shift=0.05)
    m = engine.step(records)
    assert m["mismatch/tokens"] == _tokens(records)  # one minibatch: every pair, before the optimizer step
    assert m["mismatch/kl"] == pytest.approx(math.exp(-0.05) - 1 + 0.05, rel=1e-3)
    hot = _engine("ray_online_dpo", temperature=0.7)  # its log-probs are at 1.0: not comparable, not reported
    assert "mismatch/tokens" not in hot.step(_records(hot, 2, temperature=0.7))


def _trainer(tmp_path, **config):
    """A Trainer with only what its mismatch check reads (and its stop writes: the run folder's events, its exit code,
    a stop request to its runner)."""
    t = loop.Trainer.__new__(loop.Trainer)
    t.cfg = parse_config(config)
    t.engine = type(
        "E", (), {"mismatch_by_replica": {"rollout-1": (0.3, 24, [4]), "rollout-0": (1e-14, 24, [4])}, "step_count": 5}
    )()
    t.run_dir = tmp_path
    t._mismatch_steps = 0  # as Trainer.__init__ sets these
    t.exit_code, t.tasks, t.fleet, t.evaluator = None, [], None, None
    t.runner = SimpleNamespace(stop_requested=False)
    t.runner.request_stop = lambda: setattr(t.runner, "stop_requested", True)
    return t


def _step(t, kl: float | None) -> None:
    m = {"policy_version": 5, "mismatch/tokens": 0.0 if kl is None else 48.0}
    if kl is not None:
        m.update({"mismatch/kl": kl, "mismatch/max_abs": 0.9})
    t._check_mismatch(m)


def test_the_mismatch_check_stops_after_patience_steps_over_the_bound(caplog, tmp_path):
    t = _trainer(tmp_path, training={"max_mismatch_kl": 0.01, "mismatch_patience": 2})
    _step(t, 0.5)
    _step(t, 1e-6)  # under the bound: the count starts again
    _step(t, 0.5)
    _step(t, None)  # no on-policy token: no evidence either way, the count stays
    with pytest.raises(runlog.StoppedByRule):
        _step(t, 0.02)
    assert t.exit_code == 3 and t.runner.stop_requested  # runlog.EXIT_STOPPED_BY_RULE: not restarted
    err = caplog.records[-1].getMessage()
    assert err.startswith("stopping the run: trainer-inference mismatch over training.max_mismatch_kl for 2 steps")
    assert "mismatch/kl 0.02" in err and "at policy version 4" in err and "serves other weights" in err
    # the worst replica first, with the versions its samples claimed
    assert err.index("replica rollout-1: 0.3 over 24 tokens of version(s) 4") < err.index("replica rollout-0")
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "stopped" and event["message"] == err.removeprefix("stopping the run: ")


def test_the_mismatch_check_is_off_when_null_and_only_warns_with_top_p(caplog, tmp_path):
    off = _trainer(tmp_path, training={"max_mismatch_kl": None, "mismatch_patience": 1})
    _step(off, 5.0)
    truncated = _trainer(
        tmp_path,
        training={"mismatch_patience": 1},
        actor_rollout_ref={"actor_rollout": {"top_p": 0.9}},
    )
    _step(truncated, 0.5)  # the truncated distribution's log-probs differ by design: a warning, not a stop
    assert "expected with top_p 0.9" in caplog.records[-1].getMessage()
