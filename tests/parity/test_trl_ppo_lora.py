"""LoRA PPO parity: TRL 1.12.0 ``PPOTrainer.train()`` with a ``peft_config`` vs ``rlhf.lora`` + ``rlhf.algo``.

The same fixed-response comparison as test_trl_ppo.py (every rollout tensor, every minibatch loss and statistic, the
logged metrics), with the policy trained through LoRA adapters on both sides: TRL wraps the policy with
``get_peft_model`` and takes the policy with its adapters disabled as the reference; path B wraps it with
``rlhf.lora.wrap_lora`` from TRL's initial adapter weights (lora_A is random) and uses the initial policy as the
reference. After the update, the weights rollout would receive (``rlhf.lora.merged_state_dict``) must equal TRL's
policy merged by peft, and only the adapters may have moved.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_trl_ppo import SETTINGS, compare, make_case, order_of, run_ours, run_trl

from rlhf.lora import merged_state_dict
from tests.parity.parity_support import build_models, left_pad

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj"]
R, ALPHA = 4, 8.0
WEIGHT_TOL = 1e-5


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_lora_ppo_matches_trl(setting, seed: int, tmp_path, monkeypatch, parity_report):
    case = make_case(setting, seed)
    models = build_models(seed)
    peft_config = peft.LoraConfig(
        r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, bias="none", task_type="CAUSAL_LM"
    )
    trl = run_trl(case, models, tmp_path, monkeypatch, peft_config=peft_config)
    queries = left_pad([case.prompts[i] for i in order_of(case.prompts, trl["queries"])])
    assert torch.equal(queries, trl["queries"])
    assert trl["logs"]["policy/approxkl_avg"] > 1e-4 and 0 < trl["logs"]["policy/clipfrac_avg"] < 1
    lora = {"r": R, "alpha": ALPHA, "target_modules": TARGETS, "initial_adapter": trl["initial_adapter"]}
    ours = run_ours(case, models, queries, lora=lora)
    cmp = compare(case, trl, ours, parity_report)

    # the pushed (merged) weights: ours vs TRL's policy merged by peft, under the base model's names
    theirs = copy.deepcopy(trl["policy_model"]).merge_and_unload().state_dict()
    mine = merged_state_dict(ours["policy"])
    assert set(mine) == set(theirs)
    for name, value in theirs.items():
        cmp.add(f"merged weight {name}", mine[name], value, WEIGHT_TOL)
    # only the adapters trained: every base weight is still the initial policy's
    initial = models.fresh().policy.state_dict()
    base = {
        k.replace(".base_layer.", "."): v
        for k, v in ours["policy"].get_base_model().state_dict().items()
        if ".lora_" not in k
    }
    assert all(torch.equal(base[k], initial[k]) for k in initial)
    assert any(not torch.equal(mine[k], initial[k]) for k in initial if "q_proj" in k)
    cmp.check()
