"""What a record or a diverging update can do to the trainer's state: nothing. Records are checked against the model
before they reach it, a non-finite loss or gradient skips the optimizer step, and checkpoints are used only when
complete."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import PROMPTS, _config, _rollout

from rlhf.transport import MalformedRecord, pack_weights
from services.trainer.batch import NoUsableSamples
from services.trainer.checkpoint import incomplete_reason, latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.engine import TrainerEngine


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "where, ids",
    [("response", [600, 70000, 2**31 - 1]), ("response", [511, 512]), ("prompt", [5, 512]), ("prompt", [-1, 4])],
)
def test_token_ids_outside_the_vocabulary_are_refused_before_the_model(tiny_models, where, ids):
    engine = TrainerEngine(_config("ray_grpo", adv_estimator="grpo"))
    assert engine.vocab_size == 512
    (exp,) = _rollout(engine, PROMPTS[:1], 2)
    engine.check_record(exp)  # the sampled record is fine
    if where == "response":
        exp.samples[1].response_ids[:] = ids
        exp.samples[1].ref_logprobs[:] = [-1.0] * len(ids)
    else:
        exp.prompt_ids[:] = ids
    with pytest.raises(MalformedRecord, match="outside the vocabulary") as err:
        engine.check_record(exp)
    assert err.value.job_id == exp.job_id
    # Without the check this record fails the step (what used to kill the trainer on every restart); probe() finds
    # it without changing the model.
    before = _params(engine.actor)
    with pytest.raises((IndexError, RuntimeError)):
        engine.probe([exp])
    for p, q in zip(before, engine.actor.parameters(), strict=True):
        assert torch.equal(p, q)


def test_non_finite_loss_or_gradient_skips_the_update_and_counts_it(tiny_models):
    engine = TrainerEngine(_config("ray_ppo"))
    before, adam = _params(engine.actor), dict(engine.actor_opt.state)
    p0 = next(engine.actor.parameters())
    nan_loss = p0.sum() * float("nan")
    assert engine._actor_step(nan_loss) != engine._actor_step(nan_loss)  # NaN: no norm to report
    inf_grad = torch.sqrt((p0 * 0).sum())  # finite value (0), infinite gradient
    assert torch.isfinite(inf_grad)
    engine._actor_step(inf_grad)
    assert engine.skipped_updates == 3
    for p, q in zip(before, engine.actor.parameters(), strict=True):
        assert torch.equal(p, q)
    assert dict(engine.actor_opt.state) == adam  # Adam's moments were not touched either

    # A whole step whose rewards blow the loss up: every update skipped, weights still finite and unchanged.
    batch = _rollout(engine, PROMPTS[:4], 4)
    for exp in batch:
        for s in exp.samples:
            s.score = 3e38
    m = engine.step(batch)
    assert m["nonfinite/skipped_updates"] >= 1
    for p, q in zip(before, engine.actor.parameters(), strict=True):
        assert torch.equal(p, q)
    state = engine.policy_state_dict()
    pack_weights(state, 2)  # finite weights pack
    state[next(iter(state))][0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        pack_weights(state, 3)


def test_a_batch_without_any_scored_sample_names_the_scorer_error(tiny_models):
    engine = TrainerEngine(_config("ray_grpo", adv_estimator="grpo"))
    batch = _rollout(engine, PROMPTS[:2], 4)
    for exp in batch:
        for s in exp.samples:
            s.score_status, s.score_error = 3, "scorer 'mine' raised ZeroDivisionError"
    with pytest.raises(NoUsableSamples, match="scorer 'mine' raised ZeroDivisionError"):
        engine.step(batch)


def test_incomplete_checkpoints_are_never_loaded(tiny_models, tmp_path):
    engine = TrainerEngine(_config("ray_ppo"))
    first = save_checkpoint(tmp_path, engine, {"n": 1})
    engine.step(_rollout(engine, PROMPTS[:4], 4))
    second = save_checkpoint(tmp_path, engine, {"n": 2})
    assert incomplete_reason(second) is None and latest_checkpoint(tmp_path) == second
    assert json.loads((second / "manifest.json").read_text())["step"] == 1

    shutil.rmtree(second / "policy")  # what a racing writer used to leave: state.json, no policy/
    assert "missing policy/" in incomplete_reason(second)
    assert latest_checkpoint(tmp_path) == first  # falls back to the newest complete one
    with pytest.raises(ValueError, match="incomplete"):
        load_checkpoint(second, TrainerEngine(_config("ray_ppo")))

    (first / "optim.safetensors").write_bytes(b"truncated")
    assert "bytes, the manifest says" in incomplete_reason(first)
    assert latest_checkpoint(tmp_path) is None

    # The same step saved twice replaces the first copy whole.
    again = save_checkpoint(tmp_path, engine, {"n": 3})
    assert again == second and incomplete_reason(again) is None
    assert json.loads((again / "state.json").read_text())["n"] == 3
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob("*.old-*"))


def test_weights_that_do_not_cover_the_model_are_refused(tiny_models, tmp_path):
    engine = TrainerEngine(_config("ray_grpo", adv_estimator="grpo"))
    path = save_checkpoint(tmp_path, engine, {})
    f = next((path / "policy").glob("*.safetensors"))
    weights = load_file(f)
    dropped = next(k for k in weights if "layers.0" in k)
    del weights[dropped]
    save_file(weights, f, metadata={"format": "pt"})
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][str(f.relative_to(path))] = f.stat().st_size
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=dropped):
        load_checkpoint(path, TrainerEngine(_config("ray_grpo", adv_estimator="grpo")))


def test_staleness_counts_training_steps_across_a_restart(tiny_models, tmp_path):
    """A restart publishes the restored weights under a new version without a step: staleness must not jump."""
    engine = TrainerEngine(_config("ray_grpo", adv_estimator="grpo"))
    engine.state.step = engine.state.policy_version = 114  # steps 1-114, version = step
    save_checkpoint(tmp_path, engine, {})
    resumed = TrainerEngine(_config("ray_grpo", adv_estimator="grpo"))
    load_checkpoint(latest_checkpoint(tmp_path), resumed)
    # The lost life had published 115; the restart publishes the step-114 weights as 116 (what the trainer does).
    resumed.state.republish(115)
    assert (resumed.policy_version, resumed.version_segments[-1]) == (116, (116, 114))
    versions = torch.tensor([112, 113, 115, 116, 117])
    assert resumed.steps_behind(versions, 114).tolist() == [2, 1, 0, 0, 0]  # 115: weights the crash discarded
    assert resumed.steps_behind(versions, 116).tolist() == [4, 3, 1, 2, 1]
    assert engine.steps_behind(torch.tensor([110, 114]), 114).tolist() == [4, 0]  # one segment: version gaps


def test_a_ppo_batch_without_a_response_token_skips_the_update_and_says_so(tiny_models):
    """Every response is its pad token first (0 tokens by TRL's sequence lengths): nothing to whiten or train on.
    The step used to raise from masked_whiten, and the trainer restarted into the same batch; now the update is
    skipped (weights and Adam untouched), the step still counts (its records are consumed) and a metric says why."""
    engine = TrainerEngine(_config("ray_ppo"))
    batch = _rollout(engine, PROMPTS[:2], 4)
    for exp in batch:
        for s in exp.samples:
            s.response_ids[:] = [engine.pad_id, engine.pad_id]
            s.ref_logprobs[:] = [-1.0, -1.0]
            del s.sampling_logprobs[:]
    before, adam = _params(engine.actor), dict(engine.actor_opt.state)
    critic_before = _params(engine.critic)
    m = engine.step(batch)
    assert m["update/skipped_no_response_tokens"] == 1.0
    assert engine.step_count == 1
    for p, q in zip(before, engine.actor.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(critic_before, engine.critic.parameters(), strict=True):
        assert torch.equal(p, q)
    assert dict(engine.actor_opt.state) == adam
    m = engine.step(_rollout(engine, PROMPTS[:2], 4))  # the next batch with tokens trains as ever
    assert m["update/skipped_no_response_tokens"] == 0.0
    assert any(not torch.equal(p, q) for p, q in zip(before, engine.actor.parameters(), strict=True))


@pytest.mark.parametrize("stage", ["ray_grpo", "ray_rloo", "ray_reinforce_plus_plus", "ray_online_dpo"])
def test_a_critic_free_batch_without_a_response_token_trains_to_finite_figures(tiny_models, stage):
    """The same batch as above on the stages without a critic: their token means divide by a clamped count, so the
    step neither raises nor reports a NaN, and the next batch trains as ever."""
    engine = TrainerEngine(_config(stage))
    batch = _rollout(engine, PROMPTS[:2], 4)
    for exp in batch:
        for s in exp.samples:
            s.response_ids[:] = [engine.pad_id, engine.pad_id]
            s.ref_logprobs[:] = [-1.0, -1.0]
            del s.sampling_logprobs[:]
    m = engine.step(batch)
    assert engine.step_count == 1
    assert all(math.isfinite(v) for v in m.values()), {k: v for k, v in m.items() if not math.isfinite(v)}
    m = engine.step(_rollout(engine, PROMPTS[:2], 4))
    assert engine.step_count == 2 and all(math.isfinite(v) for v in m.values())
