"""A LoRA ring on vLLM (``lora_sync: auto``): every push is the adapter alone, which the replica serves as a LoRA
adapter of the pushed version, with the same versions, checksums and catch-up as full pushes. The run trains to the
end with nothing lost, the replica serves the trainer's last version with its checksum, and each push was a few
hundred KiB where the merged model is several MiB."""

from __future__ import annotations

import re

import pytest

from tests.e2e._ring import assert_ledger, http_json

pytestmark = pytest.mark.slow


def test_a_lora_ring_pushes_adapters_that_vllm_serves(rings, tiny_models):
    ring = rings(
        "e2e-lora",
        stage="ray_grpo",
        n=2,
        train_iters=3,
        engine="vllm",
        actor={"lora_r": 8, "lora_alpha": 16.0, "lora_target_modules": ["q_proj", "v_proj", "up_proj"]},
    )
    ring.start()
    ring.wait_trained(timeout=300)
    assert "weight sync to" not in ring.trainer.log_text()  # no push failed
    assert_ledger(ring, 3)
    served = http_json(ring.rollouts[0].http_url + "/v1/weights/version")
    assert served["engine"] == "vllm" and served["version"] == ring.state()["policy_version"] >= 3
    assert served["checksum"] != "initial"
    log = ring.rollouts[0].log_text()
    swaps = re.findall(r"serving the LoRA adapter of weights version (\d+) \((\d+) tensors, ([\d.]+) KiB", log)
    assert [int(v) for v, _, _ in swaps][-1] == served["version"]
    model_kib = (tiny_models.policy / "model.safetensors").stat().st_size / 1024
    for _, tensors, kib in swaps:
        assert int(tensors) == 2 * 3 * 2  # A and B for 3 modules in each of the tiny model's 2 layers
        assert float(kib) < model_kib / 4
    # every old adapter went once its requests were done: the last one serves, the others were unloaded
    unloaded = {int(v) for v in re.findall(r"unloaded the adapter of weights version (\d+)", log)}
    assert unloaded == {int(v) for v, _, _ in swaps[:-1]}
