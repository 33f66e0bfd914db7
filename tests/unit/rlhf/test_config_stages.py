"""The stage table (``rlhf.stages``): a ``Stage`` reads and prints as its YAML value, and each stage's traits say what
the config rules, the trainer and the publisher used to read from its name."""

from __future__ import annotations

import json

import pytest

from rlhf.config import parse_config
from rlhf.stages import CRITIC_FREE, STAGE_TRAITS, Stage

OLD_ESTIMATOR = {  # the critic-free estimator each (stage, adv_estimator) ran before the table
    ("ray_grpo", "gae"): "grpo",
    ("ray_grpo", "grpo"): "grpo",
    ("ray_grpo", "group_norm"): "grpo",
    ("ray_grpo", "dr_grpo"): "dr_grpo",
    ("ray_rloo", "gae"): "rloo",
    ("ray_rloo", "rloo"): "rloo",
    ("ray_reinforce_plus_plus", "gae"): "reinforce_plus_plus",
    ("ray_reinforce_plus_plus", "reinforce_plus_plus"): "reinforce_plus_plus",
    ("ray_reinforce_plus_plus", "reinforce_plus_plus_baseline"): "reinforce_plus_plus_baseline",
}


def _cfg(stage: str, **algorithm):
    n = 2 if stage == "ray_online_dpo" else 4
    return parse_config(
        {
            "training": {"stage": stage},
            "algorithm": algorithm,
            "actor_rollout_ref": {"actor_rollout": {"n_samples_per_prompt": n}},
        }
    )


@pytest.mark.parametrize("value", [s.value for s in Stage])
def test_a_stage_is_its_yaml_string(value):
    stage = _cfg(value).training.stage
    assert stage is Stage(value) and stage == value and isinstance(stage, str)
    assert f"{stage}" == str(stage) == value and json.dumps(stage) == f'"{value}"' and {value: 1}[stage] == 1


def test_every_stage_has_a_row_and_one_kind_of_update():
    assert set(STAGE_TRAITS) == set(Stage)
    for stage, t in STAGE_TRAITS.items():
        assert [t.critic, t.group_advantages, t.pairs].count(True) == 1, stage
        assert "gae" in t.estimators, stage  # the field's default is accepted by every stage
    assert CRITIC_FREE == (Stage.GRPO, Stage.RLOO, Stage.REINFORCE_PLUS_PLUS)
    assert [s for s in Stage if s.traits.critic] == [Stage.PPO]
    assert [s for s in Stage if s.traits.samples_per_prompt] == [Stage.ONLINE_DPO]
    assert Stage.ONLINE_DPO.traits.samples_per_prompt == 2 and Stage.ONLINE_DPO.traits.logprob_temperature == 1.0


@pytest.mark.parametrize(("stage", "estimator"), sorted(OLD_ESTIMATOR))
def test_the_critic_free_estimator_of_each_accepted_adv_estimator(stage, estimator):
    assert _cfg(stage, adv_estimator=estimator).critic_free_estimator == OLD_ESTIMATOR[stage, estimator]


@pytest.mark.parametrize("stage", ["ray_ppo", "ray_online_dpo"])
def test_stages_without_group_advantages_have_no_critic_free_estimator(stage):
    with pytest.raises(ValueError, match=f"{stage} is not a critic-free stage"):
        _cfg(stage).critic_free_estimator  # noqa: B018
