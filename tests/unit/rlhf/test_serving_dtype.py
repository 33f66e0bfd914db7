"""Reference and reward models serve in bf16 on an accelerator when the trainer computes in bf16 (training.bf16), in
fp32 otherwise and always on the CPU (issue 27, D5: they ran in fp32 on the GPU beside a bf16 policy)."""

from __future__ import annotations

import pytest
import torch

import rlhf.models
from rlhf.config import parse_config
from rlhf.models import serving_dtype
from services.reference.engine import ReferenceEngine
from services.reward.engine import RewardEngine


@pytest.mark.parametrize(
    ("bf16", "device", "dtype"),
    [(True, "cuda", torch.bfloat16), (False, "cuda", torch.float32), (True, "cpu", torch.float32)],
)
def test_serving_dtype(bf16, device, dtype):
    assert serving_dtype(bf16, torch.device(device)) == dtype


@pytest.mark.parametrize("bf16", [True, False])
def test_reference_and_reward_models_load_in_the_serving_dtype(tiny_models, monkeypatch, bf16):
    """The engines ask for the dtype serving_dtype gives for their device (CUDA here, faked: the load is recorded,
    then done on the CPU)."""
    asked = []

    def recording(real):
        def load(path, device="cpu", dtype="float32"):
            asked.append(rlhf.models.resolve_dtype(dtype))
            return real(path, device="cpu", dtype=dtype)

        return load

    monkeypatch.setattr(rlhf.models, "load_causal_lm", recording(rlhf.models.load_causal_lm))
    monkeypatch.setattr(rlhf.models, "load_sequence_classifier", recording(rlhf.models.load_sequence_classifier))
    cuda = rlhf.models.resolve_device
    monkeypatch.setattr(
        rlhf.models, "resolve_device", lambda d="auto": torch.device("cuda") if d == "cuda" else cuda(d)
    )
    cfg = parse_config({"training": {"bf16": bf16}})
    ReferenceEngine(cfg, device="cuda").load()
    reward = RewardEngine(cfg, device="cuda")
    for scorer in reward.scorers:
        scorer.load()
    want = torch.bfloat16 if bf16 else torch.float32
    assert asked == [want, want]
