"""The options built for one trainer process are refused in a torchrun group, each with its reason (issue 31 item 4):
no silent wrong training on every rank."""

from __future__ import annotations

import pytest

from rlhf.config import parse_config
from services.trainer.models import NO_LOAD_OPTIM_IN_GROUP, ONE_PROCESS_ONLY, refuse_in_group


@pytest.mark.parametrize(
    "key, section",
    [
        ("actor_rollout.lora_r", {"actor_rollout_ref": {"actor_rollout": {"lora_r": 8}}}),
        ("algorithm.kl_penalty: full", {"algorithm": {"kl_penalty": "full"}}),
        (
            "actor_rollout.ptx_coef",
            {"actor_rollout_ref": {"actor_rollout": {"ptx_coef": 0.1}}, "data": {"pretrain_data": "x.jsonl"}},
        ),
        ("critic.save", {"critic": {"save": "critic-out"}}),
        ("critic.shared_backbone", {"critic": {"shared_backbone": True}}),
    ],
)
def test_each_one_process_option_is_refused_with_its_reason(key, section):
    cfg = parse_config({"training": {"stage": "ray_ppo"}, **section})
    with pytest.raises(ValueError) as err:
        refuse_in_group(cfg)
    assert f"{key}: {ONE_PROCESS_ONLY[key]}" in str(err.value) and "--trainer-procs 1" in str(err.value)
    assert sum(k in str(err.value) for k in ONE_PROCESS_ONLY) == 1  # only the option that is on


def test_a_plain_config_and_no_load_optim_start_in_a_group():
    refuse_in_group(parse_config({"training": {"stage": "ray_ppo"}}))
    # matters only when a group resumes (the seeds set it for their first start too): refused there, with its reason
    refuse_in_group(parse_config({"training": {"stage": "ray_ppo", "no_load_optim": True}}))
    assert "not built" in NO_LOAD_OPTIM_IN_GROUP and "training.no_load_optim" in NO_LOAD_OPTIM_IN_GROUP
