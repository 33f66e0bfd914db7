"""Which push a LoRA actor makes (``actor_rollout.lora_sync``), and the settings that cannot work refused at load."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, parse_config
from rlhf.lora import adapter_manifest, pushes_adapter
from services.rollout.factory import make_engine


def _cfg(**actor):
    return parse_config({"actor_rollout_ref": {"actor_rollout": actor}})


@pytest.mark.parametrize(
    ("actor", "adapter"),
    [
        ({}, False),  # no LoRA
        ({"lora_r": 8}, True),  # auto with vllm
        ({"lora_r": 8, "engine": "hf"}, False),  # auto with hf: the merged model
        ({"lora_r": 8, "lora_sync": "merged"}, False),
        ({"lora_r": 8, "lora_sync": "adapter"}, True),
    ],
)
def test_the_push_is_the_adapter_with_vllm_unless_merged_is_asked_for(actor, adapter):
    assert pushes_adapter(_cfg(**actor).actor) is adapter


@pytest.mark.parametrize(
    ("actor", "message"),
    [
        ({"lora_r": 8, "lora_sync": "adapter", "engine": "hf"}, "lora_sync adapter needs the vllm engine"),
        ({"lora_r": 1024}, "rank at most 512"),
        ({"lora_sync": "adapter"}, "read only with lora_r > 0"),
    ],
)
def test_a_lora_sync_that_cannot_work_is_refused_at_load(actor, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**actor)
    if actor.get("lora_r") == 1024:  # the merged push has no rank limit
        assert not pushes_adapter(_cfg(**actor, lora_sync="merged").actor)


def test_an_hf_replica_refuses_to_start_when_the_trainer_will_push_adapters(tiny_models):
    cfg = parse_config({"actor_rollout_ref": {"actor_rollout": {"load": str(tiny_models.policy), "lora_r": 8}}})
    with pytest.raises(ValueError, match="RLHF_ROLLOUT_ENGINE=hf.*lora_sync: merged"):
        make_engine(cfg, kind="hf")


def test_the_adapter_manifest_is_an_a_and_a_b_per_targeted_linear_weight():
    base = {
        "model.layers.0.self_attn.q_proj.weight": (64, 32),
        "model.layers.0.self_attn.q_proj.bias": (64,),
        "model.layers.0.mlp.up_proj.weight": (128, 32),
        "model.norm.weight": (32,),
    }
    assert adapter_manifest(base, 4, ["q_proj"]) == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (64, 4),
    }
    with pytest.raises(ValueError, match="name no linear weight"):
        adapter_manifest(base, 4, ["w_pack"])
