"""PPO, online DPO and GRPO end to end: a real ring (redis-server, reward, reference, rollout in worker mode,
trainer) trains a few steps of each, synchronously (max_staleness 0) or asynchronously (max_staleness 1).

Each ring is started once per module (all three together: their start-up is mostly imports and overlaps) and the
tests read what it left: metrics.jsonl, the checkpoints, the rollout's served version and the Redis queues.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e._ring import assert_ledger

pytestmark = pytest.mark.slow

# name -> ring options. PPO runs on vLLM (what users run); the others on the faster-starting hf engine.
RINGS = {
    "ppo": {"stage": "ray_ppo", "engine": "vllm", "train_iters": 4, "max_staleness": 0},
    "dpo": {"stage": "ray_online_dpo", "train_iters": 3, "max_staleness": 0},
    # GRPO also evaluates 3 held-out prompts x 2 samples beside training, at step 3 and at the end (step 4)
    "grpo": {
        "stage": "ray_grpo",
        "train_iters": 4,
        "max_staleness": 1,
        "eval": {
            "interval": 3,
            "path": "builtin:arithmetic",
            "max_samples": 3,
            "n": 2,
            "temperature": 1.0,
            "pass_threshold": 0.5,
            "max_new_tokens": 4,  # the training samples get 6
        },
    },
}


@pytest.fixture(scope="module")
def rings(module_rings):
    started = {name: module_rings(f"e2e-{name}", **opts) for name, opts in RINGS.items()}
    for ring in started.values():
        for r in ring.rollouts:
            r.start(wait_ready=False)
    for ring in started.values():
        ring.start()
    for ring in started.values():
        ring.wait_trained(timeout=300)
    return started


def _policy(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("name", list(RINGS))
def test_trains_pushes_weights_and_trains_every_job_once(rings, name, tiny_models):
    ring = rings[name]
    steps = ring.train_iters
    metrics = ring.metrics()
    assert [int(m["step"]) for m in metrics] == list(range(1, steps + 1))
    n = ring.cfg["actor_rollout_ref"]["actor_rollout"]["n_samples_per_prompt"]
    # Every sample of every job was scored by the reward service (a failed score would be dropped, not trained).
    assert all(m["samples"] == ring.batch * n for m in metrics), [m["samples"] for m in metrics]

    # The weights changed: the final checkpoint's policy is not the initial tiny policy.
    initial = _policy(tiny_models.policy)
    final = _policy(ring.checkpoint_dir() / "policy")
    assert initial.keys() == final.keys()
    assert any(not torch.equal(initial[k], final[k]) for k in initial), "training did not change the weights"

    # The rollout replica serves the trainer's last policy version.
    state = assert_ledger(ring, steps)
    assert state["policy_version"] == steps == int(metrics[-1]["policy_version"])
    assert ring.served_version() == state["policy_version"]


def test_synchronous_mode_trains_only_current_samples(rings):
    for name in ("ppo", "dpo"):
        metrics = rings[name].metrics()
        assert [m["staleness/max"] for m in metrics] == [0.0] * len(metrics), name


def test_asynchronous_mode_stays_within_max_staleness(rings):
    metrics = rings["grpo"].metrics()
    staleness = [m["staleness/max"] for m in metrics]
    assert all(s <= 1 for s in staleness), staleness
    # Admission lets 2 batches be issued at version 0: the second is generated while the first trains, so it is
    # one version old when trained.
    assert max(staleness) == 1, staleness


def test_evaluates_held_out_prompts_beside_training(rings):
    ring = rings["grpo"]
    evals = ring.metrics(eval_rows=True)
    assert [int(m["step"]) for m in evals] == [3, 4]  # every 3 steps and at the end
    for m in evals:
        assert m["eval/failed_fraction"] == 0.0, m
        assert m["eval/prompts"] == 3 and m["eval/samples"] == 6
        assert 0.0 <= m["eval/reward_mean"] <= 1.0 and 0.0 <= m["eval/pass@1"] <= m["eval/pass@2"] <= 1.0
        assert 0 < m["eval/response_length_mean"] <= 4
    assert evals[-1]["eval/policy_version"] == ring.train_iters  # the last step's weights
    # The eval samples never entered the experience stream: every step trained its configured batch (asserted with
    # the ledger in test_trains_pushes_weights_and_trains_every_job_once), and nothing else is in the streams.
    assert all(m["samples"] == ring.batch * 4 for m in ring.metrics())
    assert not any(j.startswith("eval") for j in ring.stream_job_ids("experience"))
