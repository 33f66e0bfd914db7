"""The critic-free config fields: TRL's defaults per stage, explicit values win, and nothing is accepted and ignored."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, parse_config


def _cfg(stage: str, **algorithm):
    n = 4 if stage in ("ray_grpo", "ray_rloo", "ray_reinforce_plus_plus") else 1  # a group to compare
    return parse_config(
        {
            "training": {"stage": stage},
            "algorithm": algorithm,
            "actor_rollout_ref": {"actor_rollout": {"n_samples_per_prompt": n}},
        }
    )


def test_stage_defaults_follow_trl_and_openrlhf():
    grpo = _cfg("ray_grpo")
    assert grpo.algorithm.kl_ctrl.kl_coef == 0.0 and grpo.algorithm.kl_penalty == "low_var_kl"  # TRL beta 0, k3
    assert (grpo.algorithm.loss_type, grpo.algorithm.scale_rewards) == ("dapo", "group")
    assert grpo.algorithm.use_bias_correction_kl and grpo.algorithm.importance_sampling_level == "token"
    rloo = _cfg("ray_rloo")
    assert rloo.algorithm.kl_ctrl.kl_coef == 0.05 and not rloo.algorithm.whiten_advantages  # TRL RLOOConfig
    assert rloo.algorithm.rloo_convention == "trl"
    rpp = _cfg("ray_reinforce_plus_plus")
    assert rpp.algorithm.kl_ctrl.kl_coef == 0.01 and rpp.algorithm.loss_type == "bnpo"  # OpenRLHF
    assert rpp.algorithm.whiten_advantages
    ppo = _cfg("ray_ppo")
    assert ppo.algorithm.kl_ctrl.kl_coef == 0.05 and ppo.algorithm.kl_penalty == "kl"
    dr = _cfg("ray_grpo", adv_estimator="dr_grpo")
    assert (dr.algorithm.loss_type, dr.algorithm.scale_rewards) == ("dr_grpo", "none")
    assert dr.critic_free_estimator == "dr_grpo"


def test_explicit_values_win_over_stage_defaults():
    c = _cfg("ray_grpo", kl_ctrl={"kl_coef": 0.04}, kl_penalty="kl", adv_estimator="dr_grpo", loss_type="bnpo")
    assert (c.algorithm.kl_ctrl.kl_coef, c.algorithm.kl_penalty, c.algorithm.loss_type) == (0.04, "kl", "bnpo")
    assert _cfg("ray_rloo", whiten_advantages=True).algorithm.whiten_advantages


@pytest.mark.parametrize(
    "stage, algorithm, words",
    [
        ("ray_ppo", {"scale_rewards": "batch"}, "scale_rewards is not used by training.stage ray_ppo"),
        ("ray_online_dpo", {"loss_type": "grpo"}, "loss_type is not used"),
        ("ray_rloo", {"top_entropy_quantile": 0.2}, "top_entropy_quantile is not used"),
        ("ray_rloo", {"loss_type": "grpo"}, "one ratio per sequence"),
        ("ray_grpo", {"adv_estimator": "rloo"}, "does not apply to training.stage ray_grpo"),
        ("ray_ppo", {"adv_estimator": "grpo"}, "does not apply to training.stage ray_ppo"),
    ],
)
def test_fields_a_stage_does_not_read_are_errors(stage, algorithm, words):
    with pytest.raises(ConfigError, match=words):
        _cfg(stage, **algorithm)


def test_online_dpo_log_probs_are_at_temperature_one():
    c = parse_config(
        {"training": {"stage": "ray_online_dpo"}, "actor_rollout_ref": {"actor_rollout": {"temperature": 0.9}}}
    )
    assert c.logprob_temperature == 1.0
    assert _cfg("ray_grpo").logprob_temperature is None  # the sampling temperature, as TRL's GRPO
