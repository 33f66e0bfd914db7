"""The seeds' MindSpeed-LLM configs run as a MindSpeed user runs them: seed 004's online DPO config as printed (its
prompts named only by ``actor_rollout.data_path``, a preprocessed .bin/.idx prefix written here) and a config with the
key set of MindSpeed-LLM's PPO trainer file (the critic on a device of its own), through ``rlhf up``. The only
command-line overrides point the model and save folders at the tiny models and the test's folder, the data at the
test's prefix, and shrink the run to two steps on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.config import read_config_data
from tests.support.indexed import write_indexed
from tests.support.up import rlhf_up

SEEDS = Path(__file__).parents[1] / "unit" / "seed_configs"
# the save folders of the files are relative (./ckpt): they go under the test's folder
CASES = {
    "seed-004-online-dpo": (SEEDS / "ray_online_dpo_full_llama32_1b_tp1pp1.yaml", []),
    "mindspeed-ppo-keys": (SEEDS / "mindspeed_ppo_trainer_keys.yaml", ["critic.load=tiny:reward", "critic.save={}"]),
}

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(CASES))
def test_a_mindspeed_config_trains_from_its_actor_data_path(name, tmp_path, tiny_models):
    path, extra = CASES[name]
    prefix = str(tmp_path / "alpaca")  # the prefix data_path names; the files carry MindSpeed's suffix
    write_indexed(prefix + "_packed_input_ids_document", [[[1, 40 + i, 50 + i, 60 + i]] for i in range(8)])
    overrides = [
        f"+run_id=e2e-{name}",
        "actor_rollout_ref.actor_rollout.load=tiny:policy",
        "actor_rollout_ref.ref.load=tiny:policy",
        "reward.load=tiny:reward",
        f"actor_rollout_ref.actor_rollout.save={tmp_path / 'actor-save'}",
        *(e.format(tmp_path / "critic-save") for e in extra),
        "training.tokenizer_name_or_path=null",
        f"actor_rollout_ref.actor_rollout.data_path={prefix}",
        "+actor_rollout_ref.actor_rollout.engine=hf",
        "training.train_iters=2",
        "training.global_batch_size=2",
        "training.seq_length=24",
        "actor_rollout_ref.actor_rollout.max_prompt_length=8",
        "actor_rollout_ref.actor_rollout.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor_rollout.micro_batch_size=2",
        f"+training.save={tmp_path / 'checkpoints'}",
    ]
    cfg = read_config_data(path, overrides)
    out, run_dir = rlhf_up(cfg, tmp_path, timeout=420)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    # said before the run starts: where the prompts come from
    assert f"actor_rollout_ref.actor_rollout.data_path: {prefix} is the prompt data (data.path)" in log, log[-4000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert [m["step"] for m in metrics] == [1, 2], metrics
    if "ppo" in name:  # the critic, on its own device (the CPU here), trained beside the actor
        assert all("loss/value" in m for m in metrics), metrics
