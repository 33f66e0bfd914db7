"""Reference and reward models serve in bf16 on an accelerator when the trainer computes in bf16 (training.bf16), in
fp32 otherwise and always on the CPU (issue 27, D5: they ran in fp32 on the GPU beside a bf16 policy)."""

from __future__ import annotations

import pytest
import torch

import rlhf.models
from rlhf.config import parse_config
from rlhf.models import serving_dtype
from rlhf.serving import InvalidArgument
from services.reference.engine import LogProbsItem, ReferenceEngine
from services.reward.engine import RewardEngine
from services.reward.scorers import Item


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


def test_ref_and_reward_bf16_and_seq_length_are_each_roles_own(tiny_models, monkeypatch):
    """MindSpeed's per-role keys: ``ref.bf16`` / ``reward.bf16`` pick each model's dtype (default training.bf16), and
    ``ref.seq_length`` / ``reward.seq_length`` the longest sequence each takes (within the model's context)."""
    asked = []
    real = rlhf.models.serving_dtype
    monkeypatch.setattr(rlhf.models, "serving_dtype", lambda bf16, device: asked.append(bf16) or real(bf16, device))
    cfg = parse_config(
        {
            "training": {"bf16": False, "seq_length": 64},
            "actor_rollout_ref": {
                "actor_rollout": {"max_prompt_length": 4, "max_new_tokens": 4},
                "ref": {"bf16": True, "seq_length": 10},
            },
            "reward": {"seq_length": 12},
        }
    )
    ref = ReferenceEngine(cfg, device="cpu")
    ref.load()
    reward = RewardEngine(cfg, device="cpu")
    scorer = reward.scorers[0]
    scorer.load()
    assert asked == [True, False]  # ref.bf16 true, reward's from training (false)
    assert ref.max_len == 10 and scorer.max_len > 12  # the tiny models' context is longer
    ref.validate([LogProbsItem([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])], None)
    with pytest.raises(InvalidArgument, match=r"is 11 tokens.*context is 10 \(.*actor_rollout_ref.ref.seq_length"):
        ref.validate([LogProbsItem([1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])], None)
    # the policy's tokens count (the scorer's own encoding adds its chat template): 6 + 6 fit, 6 + 7 do not
    scorer.validate([Item("a b", " c", prompt_ids=[5] * 6, response_ids=[6] * 6)])
    with pytest.raises(InvalidArgument, match=r"is 13 tokens, more than reward.seq_length 12"):
        scorer.validate([Item("a b", " c", prompt_ids=[5] * 6, response_ids=[6] * 7)])
    with pytest.raises(InvalidArgument, match=r"more than reward.seq_length 12"):  # text only: its own tokens
        scorer.validate([Item("a b c d e f g h i j k l m n o p", " q r s t u v w x y z")])
