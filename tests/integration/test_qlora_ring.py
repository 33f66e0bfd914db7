"""A QLoRA ring (``actor_rollout.load_in_4bit``) under ``rlhf up``: the trainer's 4-bit actor base, the reference
service's same 4-bit base, hf replicas served the dequantized base plus the adapters from the first batch on."""

from __future__ import annotations

import json

import pytest

from tests.support.up import demo_config, run_up


def test_a_qlora_ring_samples_and_trains_on_the_4bit_weights_from_its_first_step(tmp_path, tiny_models):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    cfg = demo_config("demo", "qlora")
    run_dir = tmp_path / "run"
    cfg["training"].update(train_iters=2, global_batch_size=4, save_interval=2, save=str(run_dir / "checkpoints"))
    cfg["actor_rollout_ref"]["actor_rollout"].update(
        engine="hf",
        max_new_tokens=6,
        ppo_mini_batch_size=4,
        ppo_epochs=1,
        lora_r=8,
        lora_dropout=0.05,
        load_in_4bit=True,
        lora_sync="merged",
    )
    cfg["critic"].update(critic_mini_batch_size=4, critic_update_epochs=1)
    proc = run_up(cfg, tmp_path, run_dir)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "lora_dropout 0.05" in proc.stdout + proc.stderr  # the start-up note
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    # the replicas served the trainer's 4-bit weights before the first batch (pushed at start): a full-precision
    # base would sample with log-probs ~1e-4 away; and the reference is the same 4-bit base: no KL at the start
    assert first["mismatch/tokens"] > 0 and first["mismatch/kl"] < 1e-9, first
    assert abs(first["objective/kl"]) < 1e-6, first
    policy = next((run_dir / "checkpoints").glob("step_*")) / "policy" / "config.json"
    assert "quantization_config" not in json.loads(policy.read_text())
