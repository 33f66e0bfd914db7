"""rlhf.layout: a live transformers module's weights in its checkpoint layout, and back.

The reference is save_pretrained's own file: what weight sync sends must be exactly what a serving engine loads from
the model's folder (names, shapes and values), for tied embeddings and for transformers 5's fused MoE experts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from rlhf.layout import CheckpointLayout, checkpoint_state_dict, tie_aliases
from rlhf.lora import merged_state_dict, wrap_lora

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _llama(tied: bool):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tied)).eval()


def _moe():
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**SMALL, head_dim=16, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    return Qwen3MoeForCausalLM(cfg).eval()


@pytest.mark.parametrize("make", [lambda: _llama(False), lambda: _llama(True), _moe], ids=["llama", "tied", "moe"])
def test_checkpoint_layout_is_what_save_pretrained_writes_and_maps_back(make, tmp_path):
    model = make()
    model.save_pretrained(tmp_path)
    disk = load_file(tmp_path / "model.safetensors")
    live = model.state_dict()
    layout = CheckpointLayout(model, live)
    sent = layout.to_checkpoint(live)
    assert list(sent) == [name for name, _, _ in layout.specs()]  # the streamed plan's order is the pass's
    assert set(sent) == set(disk)
    for name, t in disk.items():
        assert torch.equal(sent[name], t), name
    back = layout.to_live(disk, live)
    assert set(back) == set(live) - layout.aliases
    for name, t in back.items():
        assert torch.equal(t, live[name]), name


def test_tied_alias_is_left_out_and_untied_models_pass_through_without_copies():
    tied = _llama(True)
    assert tie_aliases(tied) == {"lm_head.weight"}
    assert "lm_head.weight" not in checkpoint_state_dict(tied)
    untied = _llama(False)
    live = untied.state_dict()
    layout = CheckpointLayout(untied, live)
    assert layout.identity
    assert all(a is live[n] for n, a in layout.items(live))


def test_moe_experts_are_sent_per_expert_with_their_checkpoint_shapes():
    model = _moe()
    layout = CheckpointLayout(model, model.state_dict())
    specs = {name: shape for name, _, shape in layout.specs()}
    assert "model.layers.0.mlp.experts.gate_up_proj" not in specs
    for e in range(4):
        assert specs[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] == (16, 32)
        assert specs[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] == (16, 32)
        assert specs[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] == (32, 16)
    # the bf16 push: dtypes follow the cast, shapes and names do not change
    assert {dt for _, dt, _ in layout.specs(lambda d: torch.bfloat16)} == {torch.bfloat16}


def test_lora_wrapped_tied_model_keeps_the_base_names():
    pytest.importorskip("peft")

    model = wrap_lora(_llama(True), 4, 8, ["q_proj", "v_proj"])
    assert tie_aliases(model) == {"lm_head.weight"}
    merged = merged_state_dict(model)
    sent = CheckpointLayout(model, merged).to_checkpoint(merged)
    assert "lm_head.weight" not in sent and "model.embed_tokens.weight" in sent
    assert not any(".lora_" in k or ".base_layer." in k for k in sent)
