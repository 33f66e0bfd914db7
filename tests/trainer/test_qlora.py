"""QLoRA (seed 001's BitsAndBytesConfig, ``actor_rollout.load_in_4bit``): the trainer's actor base in 4 bits under
LoRA adapters where bitsandbytes runs (its wheel has a CPU backend: the qlora extra), refused with the reason
where it does not, and pushed as the dequantized base plus the adapters, which the replicas serve."""

from __future__ import annotations

import sys

import pytest
import torch

from rlhf.config import ConfigError, parse_config
from rlhf.models import four_bit_problem, load_causal_lm
from services.trainer.engine import TrainerEngine

pytest.importorskip("peft")

import asyncio

from test_training_options import _batch, _config  # same directory: the fixed-batch helpers
from transformers import AutoConfig

from rlhf import preflight
from rlhf.algo import logprobs_from_logits
from rlhf.models import causal_lm_logits
from services.reference.engine import LogProbsItem, ReferenceEngine
from services.trainer.checkpoint import save_policy

QLORA = {
    "lora_r": 4,
    "lora_alpha": 8.0,
    "lora_target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj"],
    "lora_sync": "merged",
    "load_in_4bit": True,
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True,
}


def test_without_bitsandbytes_a_4bit_actor_is_refused_at_start_with_the_install(tiny_models, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as on a machine without it: the import fails
    cfg = _config("ray_grpo", actor=QLORA)
    with pytest.raises(ValueError, match=r"load_in_4bit needs bitsandbytes.*pip install 'rlhf-pipeline\[qlora\]'"):
        TrainerEngine(cfg)
    report = preflight.check(cfg)  # rlhf up says it before starting anything
    assert any("load_in_4bit needs bitsandbytes" in p for p in report.problems)


def test_a_device_bitsandbytes_has_no_backend_for_is_refused():
    problem = four_bit_problem(torch.device("mps"))
    assert problem is not None and "no 4-bit backend for the trainer's device 'mps'" in problem


@pytest.mark.parametrize(
    ("actor", "message"),
    [
        ({"load_in_4bit": True}, "load_in_4bit needs lora_r > 0"),
        ({**QLORA, "lora_sync": "auto"}, "adapter-only push.*set lora_sync: merged"),  # auto + the vllm engine
        ({**QLORA, "lora_sync": "adapter"}, "adapter-only push"),
        ({"lora_r": 4, "bnb_4bit_quant_type": "fp4"}, "bnb_4bit_quant_type is read only with load_in_4bit"),
        ({"load_in_8bit": True}, "8-bit loading and a quantization_config mapping are not built"),
    ],
)
def test_4bit_options_that_cannot_work_are_refused_at_load(actor, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"actor_rollout_ref": {"actor_rollout": actor}})


def test_a_4bit_actor_trains_its_adapters_and_pushes_the_dequantized_base_plus_them(tiny_models, tmp_path):
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit  # noqa: PLC0415 - bitsandbytes: optional (the qlora extra)

    engine = TrainerEngine(_config("ray_grpo", actor=QLORA))
    q_proj = engine.actor.get_base_model().model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__name__ == "Linear4bit" and q_proj.base_layer.weight.dtype == torch.uint8
    trainable = {n for n, p in engine.actor.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    engine.step(_batch(engine))
    assert any(p.detach().abs().sum() > 0 for n, p in engine.actor.named_parameters() if ".lora_B." in n)

    pushed = engine.policy_state_dict()
    plain = load_causal_lm(tiny_models.policy).state_dict()
    assert {k: v.shape for k, v in pushed.items()} == {k: v.shape for k, v in plain.items()}
    base = dequantize_4bit(q_proj.base_layer.weight.data, q_proj.base_layer.weight.quant_state)
    want = base + q_proj.get_delta_weight("default")
    torch.testing.assert_close(pushed["model.layers.0.self_attn.q_proj.weight"], want, rtol=0, atol=1e-6)
    assert not torch.equal(base, plain["model.layers.0.self_attn.q_proj.weight"])  # the base really is 4-bit

    # a replica loading the pushed weights (full precision) computes what the trainer's 4-bit actor computes
    replica = load_causal_lm(tiny_models.policy)
    replica.load_state_dict(pushed)
    ids = torch.tensor([[2, 17, 33, 48, 60, 75, 91, 12]])
    with torch.no_grad():
        torch.testing.assert_close(engine.actor(input_ids=ids).logits, replica(input_ids=ids).logits, rtol=0, atol=1e-4)

    save_policy(engine, tmp_path / "policy")  # a checkpoint's policy folder: a plain model, no quantization config

    assert getattr(AutoConfig.from_pretrained(tmp_path / "policy"), "quantization_config", None) is None


@pytest.mark.parametrize(
    ("options", "want"),
    [
        ({"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}, ("nf4", True, torch.float32)),
        ({"bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": "bfloat16"}, ("fp4", False, torch.bfloat16)),
    ],
)
def test_the_bnb_4bit_options_reach_the_4bit_layers(tiny_models, options, want):
    pytest.importorskip("bitsandbytes")
    actor = {k: v for k, v in QLORA.items() if not k.startswith("bnb_")}
    engine = TrainerEngine(_config("ray_grpo", actor={**actor, **options}))
    layer = engine.actor.get_base_model().model.layers[0].mlp.gate_proj.base_layer
    state = layer.weight.quant_state
    assert (state.quant_type, state.nested, layer.compute_dtype) == want


def test_the_reference_of_a_4bit_actor_is_the_same_4bit_base_so_the_kl_starts_at_0(tiny_models):
    """TRL's reference under PEFT is the policy with its adapters off: the quantized base. The reference service
    loads the actor's initial weights the same way, so before any step its log-probs are the actor's."""
    pytest.importorskip("bitsandbytes")

    cfg = _config("ray_grpo", actor=QLORA)
    engine = TrainerEngine(cfg)
    ref = ReferenceEngine(cfg, device="cpu")
    ref.load()
    assert type(ref.model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    prompt, response = [2, 17, 33], [48, 60, 75, 91, 12]
    (got,), _ = asyncio.run(ref.logprobs([LogProbsItem(prompt, response)], 1.0))
    qr = torch.tensor([prompt + response])
    with torch.no_grad():
        want = logprobs_from_logits(causal_lm_logits(engine.actor, qr, engine.pad_id)[:, 2:-1], qr[:, 3:])[0]
    torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-6)
    plain = ReferenceEngine(_config("ray_grpo", actor={k: v for k, v in QLORA.items() if k == "lora_r"}), "cpu")
    plain.load()  # the full-precision base differs by the quantization error: the check above can fail
    (full,), _ = asyncio.run(plain.logprobs([LogProbsItem(prompt, response)], 1.0))
    assert (torch.tensor(full) - want).abs().max() > 1e-4
