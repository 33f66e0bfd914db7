"""rlhf.preflight on real model folders: the tokenizer checks."""

from __future__ import annotations

import json
import shutil

from rlhf import preflight
from rlhf.config import parse_config
from rlhf.models import load_tokenizer


def _with_tokenizer(tmp_path, tiny_models, **changes):
    model = tmp_path / "policy"
    shutil.copytree(tiny_models.policy, model)
    cfg_path = model / "tokenizer_config.json"
    tok = json.loads(cfg_path.read_text())
    tok.update(changes)
    cfg_path.write_text(json.dumps(tok))
    actor = {"actor_rollout": {"load": str(model)}}
    scorers = [{"type": "rule", "name": "char_fraction"}]
    return parse_config({"actor_rollout_ref": actor, "reward": {"scorers": scorers}})


def test_a_pad_token_that_is_the_eos_token_is_warned_about(tmp_path, tiny_models):
    ok = preflight.check(_with_tokenizer(tmp_path / "a", tiny_models))
    assert ok.problems == [] and ok.warnings == []
    same = preflight.check(_with_tokenizer(tmp_path / "b", tiny_models, pad_token="</s>"))
    assert same.problems == []
    assert len(same.warnings) == 1 and "uses its EOS token as padding" in same.warnings[0]
    assert "padding with '<pad>' (id 0) instead" in same.warnings[0]
    assert "warning: " in preflight.format_report(same, "x.yaml")


def test_a_tokenizer_without_a_pad_token_pads_with_an_unused_token_not_eos(tmp_path, tiny_models):
    """Llama-3 has no pad token; seed 001 sets pad = EOS, which masks each response's EOS. Loading picks a token that
    never appears in text (here the tiny tokenizer's reserved <pad>) and every service loads it the same way."""
    cfg = _with_tokenizer(tmp_path, tiny_models, pad_token=None)
    report = preflight.check(cfg)
    assert report.problems == [] and "has no pad token of its own: padding with '<pad>'" in report.warnings[0]
    tok = load_tokenizer(cfg.actor.load)
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    eos_tok = load_tokenizer(_with_tokenizer(tmp_path / "eos", tiny_models, pad_token="</s>").actor.load)
    assert eos_tok.pad_token_id == tok.pad_token_id


def test_a_model_folder_that_does_not_exist_is_a_problem(tmp_path):
    cfg = parse_config(
        {
            "actor_rollout_ref": {"actor_rollout": {"load": str(tmp_path / "nope")}},
            "reward": {"scorers": [{"type": "rule", "name": "char_fraction"}]},
        }
    )
    report = preflight.check(cfg)
    assert len(report.problems) == 1 and "actor_rollout_ref.actor_rollout.load" in report.problems[0]


def test_a_megatron_mcore_checkpoint_is_refused_with_how_to_convert_it(tmp_path):
    """Seed 000/004 load Megatron-mcore folders (llama32-mcore/, -orm/): the problem names MindSpeed-LLM's converter
    in the mcore -> hf direction, and --orm for the reward model the critic and reward load."""
    mcore = tmp_path / "llama32-mcore"
    (mcore / "iter_0000100" / "mp_rank_00").mkdir(parents=True)
    (mcore / "latest_checkpointed_iteration.txt").write_text("100")
    plain = tmp_path / "not-a-model"
    plain.mkdir()
    cfg = parse_config(
        {
            "actor_rollout_ref": {"actor_rollout": {"load": str(mcore)}, "ref": {"load": str(plain)}},
            "reward": {"scorers": [{"type": "rule", "name": "char_fraction"}]},
        }
    )
    actor, ref = preflight.check(cfg).problems
    assert actor.startswith(f"actor_rollout_ref.actor_rollout.load: model directory {mcore} is a Megatron checkpoint")
    for part in ("python convert_ckpt.py", "--load-model-type mg --save-model-type hf", f"--load-dir {mcore}", "mg2hf"):
        assert part in actor, (part, actor)
    assert "--orm" in actor
    assert "has no config.json: give a Hugging Face model folder" in ref and "convert_ckpt.py" in ref
