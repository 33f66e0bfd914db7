"""LoRA training of the actor (seed 001: peft's r, alpha, target modules): only the adapters change; what is pushed
to rollout is the merged model (``lora_sync: merged``, the hf engine) or the adapter alone (``adapter``, vLLM), and
checkpoints hold the merged model."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.lora import adapter_manifest
from services.rollout.swap import read_checkpoint_manifest
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.engine import TrainerEngine

pytest.importorskip("peft")

from test_training_options import _batch, _config  # same directory: the fixed-batch helpers

LORA = {"lora_r": 4, "lora_alpha": 8.0, "lora_target_modules": ["q_proj", "v_proj", "o_proj"], "lora_sync": "merged"}


def test_a_lora_run_changes_only_the_adapters_and_pushes_the_merged_model(tiny_models):
    engine = TrainerEngine(_config("ray_grpo", actor=LORA))
    before = {k: v.clone() for k, v in engine.actor.state_dict().items()}
    trainable = {n for n, p in engine.actor.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    engine.step(_batch(engine))
    after = engine.actor.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_B." in k or ".lora_A." in k for k in changed)
    assert any(".lora_B." in k for k in changed)  # B starts at 0: the adapters now move the model

    pushed = engine.policy_state_dict()
    reference = copy.deepcopy(engine.actor).merge_and_unload().state_dict()  # peft's own merge
    plain = TrainerEngine(_config("ray_grpo")).policy_state_dict()
    assert set(pushed) == set(plain) == set(reference)  # the base model's names, no adapter tensors
    for k, v in reference.items():
        torch.testing.assert_close(pushed[k], v, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(pushed[k], plain[k]) for k in pushed if "q_proj" in k)


def test_an_adapter_push_is_the_adapter_alone_under_the_names_and_shapes_the_replica_expects(tiny_models):
    engine = TrainerEngine(_config("ray_grpo", actor={**LORA, "lora_sync": "auto"}))  # auto with vllm: the adapter
    engine.step(_batch(engine))
    pushed = engine.policy_state_dict()
    expected = adapter_manifest(read_checkpoint_manifest(tiny_models.policy), 4, LORA["lora_target_modules"])
    assert {k: tuple(v.shape) for k, v in pushed.items()} == expected
    live = {k.replace(".default.", "."): v for k, v in engine.actor.state_dict().items() if ".lora_" in k}
    assert pushed.keys() == live.keys()
    for k, v in pushed.items():
        assert torch.equal(v, live[k])
    assert any(v.abs().sum() > 0 for k, v in pushed.items() if ".lora_B." in k)  # the step moved B


def test_a_lora_checkpoint_resumes_the_adapters_and_its_policy_is_the_merged_model(tiny_models, tmp_path):
    engine = TrainerEngine(_config("ray_grpo", actor=LORA))
    engine.step(_batch(engine))
    path = save_checkpoint(tmp_path, engine, {})
    merged = engine.policy_state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(path / "policy").state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(loaded[k], v)
    resumed = TrainerEngine(_config("ray_grpo", actor=LORA))
    load_checkpoint(latest_checkpoint(tmp_path), resumed)
    for k, v in resumed.policy_state_dict().items():
        torch.testing.assert_close(v, merged[k])
    batch = _batch(engine, seed=5)
    a, b = engine.step(batch), resumed.step(batch)
    assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-6)


def test_lora_dropout_is_accepted_recorded_and_off_while_training(tiny_models):
    """Seed 001's ``lora_dropout=0.05``: kept in the adapter's config, but every dropout module has p = 0 while the
    actor trains (in train mode), as TRL's RL trainers do, and a start-up note says so."""
    cfg = _config("ray_grpo", actor={**LORA, "lora_dropout": 0.05})
    assert any("lora_dropout 0.05" in n and "off while training" in n for n in cfg.notes)
    engine = TrainerEngine(cfg)
    assert engine.actor.peft_config["default"].lora_dropout == 0.05
    dropouts = [m for n, m in engine.actor.named_modules() if ".lora_dropout." in n]
    assert dropouts and all(isinstance(m, torch.nn.Dropout) and m.p == 0.0 for m in dropouts)
    assert engine.actor.training  # train mode: only p = 0 keeps the two passes below equal
    ids = torch.tensor([[2, 17, 33, 48, 60, 75, 91, 12]])
    with torch.no_grad():
        first, second = engine.actor(input_ids=ids).logits, engine.actor(input_ids=ids).logits
    assert torch.equal(first, second)
    metrics = engine.step(_batch(engine))
    assert metrics["policy/ratio"] == pytest.approx(1.0, abs=1e-6)  # first minibatch: new == old log-probs
