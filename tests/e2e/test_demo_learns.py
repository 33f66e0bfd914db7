"""PPO on the demo task learns: `rlhf up` on configs/demo.yaml (the digit-fraction rule reward, vLLM rollout, as a
user runs it), run for the demo's 60 steps; the mean reward of the last 5 steps is clearly above the first 5."""

from __future__ import annotations

import json

import pytest

from tests.support.up import demo_config, rlhf_up

STEPS = 60  # the demo's own length: at 40 steps the margin sat near the bound (+0.19 in one run)

pytestmark = pytest.mark.slow


def test_rlhf_up_demo_ppo_reward_rises(tmp_path, tiny_models):
    cfg = demo_config("demo", "e2e-demo", tmp_path, train_iters=STEPS, save_interval=STEPS)
    out, run_dir = rlhf_up(cfg, tmp_path, timeout=540)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rewards = [json.loads(line)["reward/mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"demo PPO reward: first-5 mean {first:.3f}, last-5 mean {last:.3f}, margin {last - first:+.3f}")
    assert last > first + 0.2, (first, last, rewards)
