"""``algorithm.distill``: on-policy distillation's config rules, and the shipped example config."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[3]


def _cfg(stage="ray_grpo", n=4, ref="tiny:qwen3/policy", algorithm=None):
    return {
        "training": {"stage": stage},
        "actor_rollout_ref": {"actor_rollout": {"n_samples_per_prompt": n}, "ref": {"load": ref}},
        "algorithm": {"distill": {"coef": 1.0}} if algorithm is None else algorithm,
    }


def test_the_example_config_loads_with_distillation_on_and_no_kl_penalty():
    cfg = load_config(REPO / "configs" / "distill-tiny.yaml")
    assert cfg.algorithm.distill.coef == 1.0 and cfg.algorithm.distill.reward_coef == 0.0
    assert cfg.actor_rollout_ref.ref.load and cfg.algorithm.kl_ctrl.kl_coef == 0.0
    assert cfg.training.stage == "ray_grpo" and not cfg.notes


@pytest.mark.parametrize(
    ("stage", "algorithm"),
    [
        ("ray_grpo", {}),
        ("ray_rloo", {"rloo_convention": "openrlhf"}),  # field default kl_coef 0.05
        ("ray_reinforce_plus_plus", {}),  # stage default kl_coef 0.01
    ],
)
def test_distillation_turns_the_stages_default_kl_penalty_off(stage, algorithm):
    cfg = parse_config(_cfg(stage, algorithm={"distill": {"coef": 1.0}, **algorithm}))
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.0
    without = parse_config(_cfg(stage, algorithm=algorithm))
    assert without.algorithm.kl_ctrl.kl_coef > 0 or stage == "ray_grpo"


@pytest.mark.parametrize(
    ("data", "keys"),
    [
        (
            _cfg(algorithm={"distill": {"coef": 1.0}, "kl_ctrl": {"kl_coef": 0.05}}),
            ["algorithm.distill.coef", "algorithm.kl_ctrl", "kl_coef: 0"],
        ),
        (
            _cfg(algorithm={"distill": {"coef": 1.0}, "kl_ctrl": {"type": "adaptive", "target_kl": 1.0}}),
            ["algorithm.distill.coef", "algorithm.kl_ctrl", "type: fixed"],
        ),
        (_cfg(ref=None), ["algorithm.distill.coef", "actor_rollout_ref.ref.load"]),
        (_cfg("ray_ppo", n=1), ["algorithm.distill", "ray_ppo"]),
        (_cfg("ray_online_dpo", n=2), ["algorithm.distill", "ray_online_dpo"]),
        (_cfg("ray_rloo"), ["algorithm.distill", "rloo_convention: openrlhf"]),
        (_cfg(algorithm={"distill": {"reward_coef": 1.0}}), ["algorithm.distill.reward_coef", "distill.coef"]),
        # mixing in the task reward compares each prompt's samples again: a group is needed
        (_cfg(n=1, algorithm={"distill": {"coef": 1.0, "reward_coef": 0.5}}), ["n_samples_per_prompt"]),
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_the_keys(data, keys):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    for key in keys:
        assert key in str(err.value), (key, str(err.value))


def test_pure_distillation_needs_no_group_and_kl_coef_zero_is_allowed():
    cfg = parse_config(_cfg(n=1, algorithm={"distill": {"coef": 1.0}, "kl_ctrl": {"kl_coef": 0.0}}))
    assert cfg.actor.n_samples_per_prompt == 1 and cfg.algorithm.kl_ctrl.kl_coef == 0.0
