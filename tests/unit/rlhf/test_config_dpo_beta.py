"""Online DPO's beta as MindSpeed-LLM's online DPO reads it: its ``dpo_beta`` argument (default 0.1), set in the
``training`` section or the actor's, never ``algorithm.kl_ctrl.kl_coef`` (seed 004 sets 0.05, which MindSpeed's PPO and
GRPO trainers read and its online DPO does not); the unread kl_coef is named at start-up with the beta in force."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf.config import ConfigError, config_warning, parse_config, read_config_data

SEED_004 = Path(__file__).parents[1] / "seed_configs" / "ray_online_dpo_full_llama32_1b_tp1pp1.yaml"


def _seed_004() -> dict:
    """Seed 004's online DPO config as printed, less its data (not what these tests are about)."""
    raw = read_config_data(SEED_004)
    raw["actor_rollout_ref"]["actor_rollout"].pop("data_path")
    return raw


def test_seed_004_kl_coef_is_not_its_beta_and_start_up_says_which_is():
    cfg = parse_config(_seed_004())
    assert cfg.training.stage == "ray_online_dpo"
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.05
    assert cfg.algorithm.dpo_beta == 0.1  # MindSpeed's --dpo-beta default, not the kl_coef
    (note,) = [n for n in cfg.notes if n.startswith("algorithm.kl_ctrl: ")]
    assert "not read by ray_online_dpo" in note and "algorithm.dpo_beta (0.1 here)" in note
    assert "MindSpeed-LLM" in note and "kl_ctrl.kl_coef" in note
    assert note in config_warning(cfg)


def test_mindspeed_dpo_arguments_in_training_or_the_actor_section_set_the_loss():
    raw = _seed_004()
    raw["training"]["dpo_beta"] = 0.3
    raw["training"]["dpo_loss_type"] = "ipo"
    cfg = parse_config(raw)
    assert (cfg.algorithm.dpo_beta, cfg.algorithm.dpo_loss_type) == (0.3, "ipo")
    assert any("algorithm.dpo_beta (0.3 here)" in n for n in cfg.notes)
    # the actor's own section wins over training's, as MindSpeed merges a role's arguments over the common ones
    raw["actor_rollout_ref"]["actor_rollout"]["dpo_beta"] = 0.2
    assert parse_config(raw).algorithm.dpo_beta == 0.2
    # the same value in algorithm as well: no contradiction
    raw["algorithm"]["dpo_beta"] = 0.2
    assert parse_config(raw).algorithm.dpo_beta == 0.2


@pytest.mark.parametrize(
    ("section", "key"),
    [
        (("training",), "training.dpo_beta"),
        (("actor_rollout_ref", "actor_rollout"), "actor_rollout_ref.actor_rollout.dpo_beta"),
    ],
)
def test_a_mindspeed_dpo_beta_that_contradicts_algorithm_dpo_beta_is_an_error_naming_both(section, key):
    raw = _seed_004()
    target = raw
    for name in section:
        target = target[name]
    target["dpo_beta"] = 0.3
    raw["algorithm"]["dpo_beta"] = 0.1
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert f"{key} (0.3) contradicts algorithm.dpo_beta (0.1)" in str(err.value)
