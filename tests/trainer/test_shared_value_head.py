"""Seed 001's PPO layout (``critic.shared_backbone``): one model, a value head on the actor's own backbone (LoRA
adapters shared), the loss ``pg_loss + vf_coef * vf_loss`` in one backward (TRL's AutoModelForCausalLMWithValueHead).
What must hold: the values are the head on the actor's hidden states, the value loss trains the shared backbone (it
cannot with a separate critic), the head learns the returns, the push is the policy alone, a checkpoint resumes the
head and both optimizers, and the settings that cannot apply are refused."""

from __future__ import annotations

import pytest
import torch
from test_training_options import _batch, _config, _params  # same directory: the fixed-batch helpers

from rlhf.config import ConfigError, parse_config
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.engine import TrainerEngine
from services.trainer.models import ValueHeadOnActor

SHARED = {"shared_backbone": True}


def _shared_config(stage="ray_ppo", critic=None, actor=None):
    """test_training_options' config with a shared value head (which has no critic minibatch size of its own)."""
    return parse_config(
        {
            "training": {"stage": stage, "device": "cpu", "lr": 1e-3, "seed": 3, "clip_grad": 0.0, "train_iters": 10},
            "actor_rollout_ref": {
                "actor_rollout": {"n_samples_per_prompt": 4, "ppo_mini_batch_size": 8, **(actor or {})}
            },
            "critic": {**SHARED, **(critic or {})},
            "algorithm": {"kl_ctrl": {"kl_coef": 0.01}},
        }
    )


def _shared(vf_coef: float = 1.0, actor=None) -> TrainerEngine:
    return TrainerEngine(_shared_config(critic={"vf_coef": vf_coef}, actor=actor))


def test_the_values_are_a_head_on_the_actors_own_hidden_states(tiny_models):
    engine = _shared()
    assert isinstance(engine.critic, ValueHeadOnActor)
    assert [n for n, _ in engine.critic.named_parameters()] == ["score.weight"]  # the backbone is the actor's
    qr = torch.tensor([[2, 10, 20, 33, 44, 55], [2, 11, 21, 34, 45, 0]])
    with torch.no_grad():
        values = engine._values(qr, 3)
        hidden = engine.actor.model(input_ids=qr, attention_mask=(qr != 0).long()).last_hidden_state
        want = engine.critic.score(hidden).squeeze(-1)[:, 2:-1]
    torch.testing.assert_close(values, want)


def test_the_value_loss_trains_the_shared_backbone_and_only_there(tiny_models):
    def actor_after(vf_coef: float, shared: bool) -> list[torch.Tensor]:
        engine = _shared(vf_coef) if shared else TrainerEngine(_config("ray_ppo", critic={"vf_coef": vf_coef}))
        engine.step(_batch(engine))
        return _params(engine.actor)

    shared = [actor_after(c, True) for c in (0.01, 10.0)]
    separate = [actor_after(c, False) for c in (0.01, 10.0)]
    assert any(not torch.equal(a, b) for a, b in zip(*shared, strict=True))  # the value gradient moved the actor
    assert all(torch.equal(a, b) for a, b in zip(*separate, strict=True))  # a separate critic's cannot


def test_the_head_learns_the_returns_and_the_push_is_the_policy_alone(tiny_models):
    engine = _shared()
    batch = _batch(engine)
    losses = [engine.step(batch)["loss/value"] for _ in range(6)]
    assert losses[-1] < 0.5 * losses[0], losses
    pushed = engine.policy_state_dict()
    plain = TrainerEngine(_config("ray_ppo")).policy_state_dict()
    assert set(pushed) == set(plain)  # no value head in what rollout gets


def test_lora_with_a_shared_value_head_trains_the_adapters_and_the_head(tiny_models):
    pytest.importorskip("peft")
    lora = {"lora_r": 4, "lora_alpha": 8.0, "lora_target_modules": ["q_proj", "v_proj"], "lora_sync": "merged"}
    engine = _shared(actor=lora)
    base = {k: v.clone() for k, v in engine.actor.state_dict().items()}
    head = engine.critic.score.weight.detach().clone()
    engine.step(_batch(engine))
    changed = {k for k, v in engine.actor.state_dict().items() if not torch.equal(v, base[k])}
    assert changed and all(".lora_" in k for k in changed)
    assert not torch.equal(engine.critic.score.weight, head)


def test_a_checkpoint_resumes_the_head_and_both_optimizers(tiny_models, tmp_path):
    engine = _shared()
    engine.step(_batch(engine))
    save_checkpoint(tmp_path, engine, {})
    assert (latest_checkpoint(tmp_path) / "critic" / "value_head.safetensors").is_file()
    resumed = _shared()
    load_checkpoint(latest_checkpoint(tmp_path), resumed)
    torch.testing.assert_close(resumed.critic.score.weight, engine.critic.score.weight, rtol=0, atol=0)
    batch = _batch(engine, seed=5)
    a, b = engine.step(batch), resumed.step(batch)
    assert a["loss/value"] == pytest.approx(b["loss/value"], abs=1e-6)
    assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-6)


@pytest.mark.parametrize(
    ("stage", "critic", "actor", "message"),
    [
        ("ray_grpo", {}, {}, "stage ray_grpo has no critic"),
        ("ray_ppo", {"load": "tiny:reward"}, {}, "critic.load describe a separate critic"),
        ("ray_ppo", {"critic_update_epochs": 2}, {}, "critic.critic_update_epochs describe"),
        ("ray_ppo", {}, {"freezing_actor_steps": 1}, "freezing_actor_steps trains the critic alone"),
    ],
)
def test_what_a_shared_value_head_cannot_use_is_refused(stage, critic, actor, message):
    with pytest.raises(ConfigError, match=message):
        _shared_config(stage, critic=critic, actor=actor)
