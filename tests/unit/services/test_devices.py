"""resource_pool and num_gpus_for_train / num_gpus_for_infer under ``rlhf up``: the devices each service sees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf.config import load_config, parse_config
from services.devices import plan_devices, rollout_replicas, trainer_procs, visible_devices
from services.plan import plan_services
from services.trainer.models import critic_device

SEED_004 = Path(__file__).parents[1] / "seed_configs" / "ray_online_dpo_full_llama32_1b_tp1pp1.yaml"


def _cfg(actor=None, pool=None):
    return parse_config({"actor_rollout_ref": {"actor_rollout": actor or {}}, "resource_pool": pool or {}})


def test_seed_004_gets_one_device_per_role_in_order(tmp_path):
    cfg = load_config(
        SEED_004, ["data.path=/data/ppo/llama32-ppo-trl/alpaca"]
    )  # actor_rollout [2] = 1 train + 1 infer, ref [1], reward [1]
    replicas = rollout_replicas(cfg, None)
    plan = plan_devices(cfg, ["0", "1", "2", "3", "4"], replicas, "CUDA_VISIBLE_DEVICES")
    assert (plan.trainer, plan.rollouts, plan.reference, plan.reward) == (["0"], [["1"]], ["2"], ["3"])
    specs = plan_services(
        redis_url="u",
        run_id="r",
        api_token="t",
        run_dir=tmp_path,
        rollout_replicas=replicas,
        ports=list(range(20000, 20008)),
        devices=plan,
    )
    assert {s.name: s.env["CUDA_VISIBLE_DEVICES"] for s in specs} == {
        "reward": "3",
        "reference": "2",
        "rollout": "1",
        "trainer": "0",
    }


def test_rollout_devices_become_replicas_of_the_tensor_parallel_size():
    cfg = _cfg({"num_gpus_for_infer": 4, "tensor_model_parallel_size": 2}, {"ref": [0], "reward": [1]})
    assert rollout_replicas(cfg, None) == 2
    plan = plan_devices(cfg, [str(i) for i in range(8)], 2, "ASCEND_RT_VISIBLE_DEVICES")
    assert plan.rollouts == [["1", "2"], ["3", "4"]] and plan.reference == [] and plan.reward == ["5"]
    assert plan.env_for("rollout-1") == {"ASCEND_RT_VISIBLE_DEVICES": "3,4"}
    assert plan.env_for("reference") == {"ASCEND_RT_VISIBLE_DEVICES": ""}  # no device: it runs on the CPU
    # resource_pool.actor_rollout alone: what the trainer leaves goes to rollout
    assert rollout_replicas(_cfg(pool={"actor_rollout": [4]}), None) == 3
    assert rollout_replicas(_cfg(), 2) == 2 and rollout_replicas(_cfg(), None) == 1


def test_asking_for_more_than_there_is_or_contradicting_the_flag_is_an_error():
    cfg = _cfg({"num_gpus_for_infer": 2}, {"ref": [1], "reward": [1]})
    with pytest.raises(ValueError, match="asks for 5 devices .* shows 4"):
        plan_devices(cfg, ["0", "1", "2", "3"], 2, "CUDA_VISIBLE_DEVICES")
    with pytest.raises(ValueError, match="--rollout-replicas 3 contradicts"):
        rollout_replicas(cfg, 3)
    with pytest.raises(ValueError, match="not a positive multiple"):
        rollout_replicas(_cfg({"tensor_model_parallel_size": 2}, {"actor_rollout": [2]}), None)
    with pytest.raises(ValueError, match="shares the trainer's 1 device"):
        plan_devices(_cfg({"tensor_model_parallel_size": 2}, {"actor_rollout": [1]}), ["0", "1"], 1, "X")


def test_colocated_rollout_shares_the_trainers_device():
    cfg = _cfg(pool={"actor_rollout": [1], "ref": [1], "reward": [0]})  # MindSpeed's colocated actor
    assert rollout_replicas(cfg, None) == 1
    plan = plan_devices(cfg, ["0", "1"], 1, "CUDA_VISIBLE_DEVICES")
    assert (plan.trainer, plan.rollouts, plan.reference, plan.reward) == (["0"], [["0"]], ["1"], [])


def test_visible_devices_follow_the_runtime_variable():
    assert visible_devices("cuda", {"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert visible_devices("npu", {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2"}) == ["0", "1", "2"]


def test_num_gpus_for_train_is_the_trainer_group_size():
    """MindSpeed's num_gpus_for_train: that many trainer processes (an FSDP2 group) under `rlhf up`."""
    assert trainer_procs(_cfg(), None) == 1 and trainer_procs(_cfg(), 3) == 3
    assert trainer_procs(_cfg({"num_gpus_for_train": 2}), None) == 2
    assert trainer_procs(_cfg({"num_gpus_for_train": 2}), 2) == 2
    with pytest.raises(ValueError, match="contradicts actor_rollout.num_gpus_for_train 2"):
        trainer_procs(_cfg({"num_gpus_for_train": 2}), 1)


MINDSPEED_PPO = Path(__file__).parents[1] / "seed_configs" / "mindspeed_ppo_trainer_keys.yaml"


def test_a_critic_with_a_device_of_its_own_is_seen_by_the_trainer_after_the_actors(tmp_path):
    cfg = load_config(MINDSPEED_PPO)  # actor_rollout [2] = 1 train + 1 infer, ref [1], critic [1], reward [1]
    plan = plan_devices(cfg, ["0", "1", "2", "3", "4"], rollout_replicas(cfg, None), "CUDA_VISIBLE_DEVICES")
    assert (plan.trainer, plan.rollouts, plan.reference, plan.reward) == (["0", "1"], [["2"]], ["3"], ["4"])
    with pytest.raises(ValueError, match=r"asks for 5 devices \(trainer 1, critic 1, rollout 1, reference 1"):
        plan_devices(cfg, ["0", "1", "2", "3"], 1, "CUDA_VISIBLE_DEVICES")


def test_the_critics_own_device_is_the_one_after_the_actors_and_must_exist(monkeypatch):

    own = _cfg(pool={"critic": [1]})
    cpu = torch.device("cpu")
    assert critic_device(own, cpu, None) == cpu  # the CPU is one device: the critic shares it
    assert critic_device(_cfg(), torch.device("cuda"), None) == torch.device("cuda")  # [0]: the actor's
    # the device runtime as this process would see it under rlhf up (one layer: the count is all it reads)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert critic_device(own, torch.device("cuda"), None) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"critic's own device would be cuda:1.*this process sees 1 cuda device"):
        critic_device(own, torch.device("cuda"), None)
    with pytest.raises(ValueError, match="in a trainer group .* is not built"):
        critic_device(own, torch.device("cuda"), object())
