"""A policy checkpoint is a save_pretrained folder, in the checkpoint layout: restoring it must rebuild the live
module's tensors, for transformers 5's fused MoE experts (the folder holds them per expert) and a tied head (the
folder holds the embedding once) alike, and refuse a folder that misses a tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from services.trainer.checkpoint import _load_weights

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _moe(seed: int):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**SMALL, head_dim=16, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    return Qwen3MoeForCausalLM(cfg)


def _tied(seed: int):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True))


@pytest.mark.parametrize("make", [_moe, _tied], ids=["moe", "tied"])
def test_a_saved_policy_restores_into_a_fresh_model(make, tmp_path):
    trained, fresh = make(1), make(2)
    trained.save_pretrained(tmp_path)
    _load_weights(fresh, tmp_path)
    for name, t in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_a_folder_missing_an_expert_is_refused(tmp_path):
    _moe(1).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.experts.3.down_proj.weight'\]"):
        _load_weights(_moe(2), tmp_path)
